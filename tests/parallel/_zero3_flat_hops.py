"""A chain of resumes through several layouts, one epoch (3 steps) per hop, with AdamW so that the optimizer moments
cross every layout too; the end must match one uninterrupted single-process run (shared by the checkpoint tests)."""

from __future__ import annotations

from tests.strategies._lm import assert_rel_close, reference_run, tiny_config, trainer_run

NUM_SAMPLES = 12  # global batch 4: one epoch is 3 steps, every checkpoint sits on an epoch boundary
FLAT = dict(zero_stage=3, zero3_impl="flat")


def check_hops(launcher, tmp_path, hops: list[dict], world: int = 2, config=None) -> None:
    config = config or tiny_config()
    _, ref_params = reference_run(config, 3 * len(hops), num_samples=NUM_SAMPLES, optimizer="adamw")
    previous = None
    for hop, layout in enumerate(hops, start=1):
        path = str(tmp_path / f"hop{hop}.ckpt")
        results = launcher(
            world, trainer_run, layout, config, 3 * hop, max_epochs=hop, num_samples=NUM_SAMPLES,
            ckpt_path=previous, save_path=path if hop < len(hops) else None, optimizer="adamw",
        )  # fmt: skip
        for losses, _ in results:
            assert len(losses) == 3, f"hop {hop} ({layout}) must resume at step {3 * hop - 2}, not start over"
        previous = path
    for _, params in results:
        for name, want in ref_params.items():
            assert_rel_close(params[name], want, 1e-5, f"{hops}: {name}")

"""A chain of resumes through several layouts, one epoch (3 steps) per hop, with AdamW so that the optimizer moments
cross every layout too; the end must match one uninterrupted single-process run (shared by the checkpoint tests,
which assert on what ``run_hops`` returns)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.strategies._lm import reference_run, rel_error, tiny_config, trainer_run

NUM_SAMPLES = 12  # global batch 4: one epoch is 3 steps, every checkpoint sits on an epoch boundary
FLAT = dict(zero_stage=3, zero3_impl="flat")
STEPS_PER_HOP = 3


@dataclass
class Hops:
    steps_per_hop: list[set[int]]
    """Per hop, the number of steps each rank trained (``{3}`` when it resumed where the previous hop stopped)."""
    rel_error: float
    """Largest relative error ``||a - e|| / ||e||`` of a final parameter against the single-process run."""
    worst: str
    """The parameter (and rank) with that error."""


def run_hops(launcher, tmp_path, hops: list[dict], world: int = 2, config=None, callbacks=None) -> Hops:
    """``callbacks``: Lightning callbacks every hop's ``Trainer`` gets (checks run inside the workers)."""
    config = config or tiny_config()
    _, ref_params = reference_run(config, STEPS_PER_HOP * len(hops), num_samples=NUM_SAMPLES, optimizer="adamw")
    previous, steps = None, []
    for hop, layout in enumerate(hops, start=1):
        path = str(tmp_path / f"hop{hop}.ckpt")
        results = launcher(
            world, trainer_run, layout, config, STEPS_PER_HOP * hop, max_epochs=hop, num_samples=NUM_SAMPLES,
            ckpt_path=previous, save_path=path if hop < len(hops) else None, optimizer="adamw", callbacks=callbacks,
        )  # fmt: skip
        steps.append({len(losses) for losses, _ in results})
        previous = path
    errors = {
        f"rank {rank}: {name}": rel_error(params[name], want)
        for rank, (_, params) in enumerate(results)
        for name, want in ref_params.items()
    }
    worst = max(errors, key=errors.get)
    return Hops(steps_per_hop=steps, rel_error=errors[worst], worst=worst)

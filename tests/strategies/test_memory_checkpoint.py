"""In-memory (flash) checkpoints restore exactly, under the layout that took them and under another one.

In the shared workers (world 4, tiny model, plain SGD, ragged labels): a run of 4 steps snapshots every 2 steps; its
step-4 snapshot is then deleted (a crash before it was complete) and the snapshot folder copied. A fresh Trainer on the
same workers resumes with ``ckpt_path="last"`` (the newest of memory and disk, chosen collectively):

- under the same layout (TP, PP, EP, flat ZeRO-3, FSDP2 over TP; ZeRO-1 slices saved without gathers): steps 3-4 and the final weights equal the uninterrupted run's to
  the last bit;
- under another layout (TP=2 -> ZeRO-1 DP=4, PP=2 -> flat ZeRO-3, flat ZeRO-3 -> TP=2 x PP=2): losses and weights
  match the single-process oracle within 1e-5 (the layouts sum in other orders), as a disk checkpoint does.

One real SIGKILL (own processes, the main recipe's module with AdamW, warmup + cosine, ``LMDataModule``): a snapshot
newer than the last disk checkpoint is restored, bit-exact (its uninterrupted run trains beside the killed one).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_flagscale.callbacks import MemoryCheckpoint
from lightning_flagscale.checkpoint.in_memory import (
    default_snapshot_root,
    list_snapshots,
    remove_snapshots,
    run_folder,
    snapshot_path,
)
from tests._background import background
from tests.strategies._kill import final_weights, launch, launch_ok, losses
from tests.strategies._lm import GRAD_NORMS, assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS, CRASH, SAMPLES = 4, 2, 8  # 2 steps per epoch: plain DataLoaders resume at an epoch boundary
ZERO1 = dict(zero_stage=1)
TP2 = dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1)
PP2 = dict(pipeline_parallel_size=2, micro_batch_size=1, zero_stage=1)
FLAT3 = dict(zero_stage=3, zero3_impl="flat")
TP2PP2 = dict(tensor_parallel_size=2, pipeline_parallel_size=2, micro_batch_size=1)
EP2 = dict(expert_parallel_size=2, zero_stage=1)
TP2FSDP = dict(tensor_parallel_size=2, zero_stage=3)  # FSDP2 over TP: DTensor shards, staged as DTensors


def _moe_config():
    from lightning_flagscale.config import TransformerConfig

    return TransformerConfig.from_preset(
        "mixtral-tiny", num_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_aux_loss_coeff=0.0,
    )  # fmt: skip


class _KeepSnapshots(MemoryCheckpoint):
    """Leaves its snapshots behind as a crash would (a successful ``fit`` removes them)."""

    def on_fit_end(self, trainer, pl_module):
        self.wait()


def _crash_and_resume(first: dict, others: list[dict], moe: bool, folder: str) -> dict:
    """Every rank: the uninterrupted run under ``first`` (snapshots at steps 2 and 4), then, for each layout of
    ``others``, a fresh Trainer resuming from the step-2 snapshot (step 4 deleted as if a crash interrupted it)."""
    import torch.distributed as dist

    config = _moe_config() if moe else tiny_config()
    root = Path(folder)
    full = trainer_run(
        first, config, STEPS, num_samples=SAMPLES, callbacks=[_KeepSnapshots(every_n_train_steps=CRASH, dirpath=root)]
    )
    taken = list_snapshots(root)
    if dist.get_rank() == 0:
        shutil.rmtree(snapshot_path(root, STEPS))
        for i in range(len(others)):
            shutil.copytree(root, root.with_name(f"{root.name}-{i}"))
    dist.barrier()
    resumed = []
    for i, layout in enumerate(others):
        memory = MemoryCheckpoint(every_n_train_steps=CRASH, dirpath=root.with_name(f"{root.name}-{i}"))
        resumed.append(trainer_run(layout, config, STEPS, num_samples=SAMPLES, ckpt_path="last", callbacks=[memory]))
        dist.barrier()
        assert not memory.folder(None).exists(), "a successful fit removes its snapshots"
    return {"full": full, "resumed": resumed, "taken": taken}


def _assert_bitwise(resumed: tuple, full: tuple, what: str) -> None:
    (losses, params), (want_losses, want_params) = resumed, full
    assert losses == want_losses[CRASH:], (what, losses, want_losses)
    for name, value in want_params.items():
        if name != GRAD_NORMS:
            assert torch.equal(params[name], value), f"{what}: {name} differs from the uninterrupted run"


@pytest.mark.parametrize(
    ("first", "others", "moe"),
    [
        pytest.param(PP2, [PP2, FLAT3], False, id="pp2-then-pp2-and-flat-zero3"),
        pytest.param(FLAT3, [FLAT3, TP2PP2], False, id="flat-zero3-then-flat-zero3-and-tp2pp2"),
        pytest.param(TP2, [TP2, ZERO1], False, id="tp2-then-tp2-and-zero1"),
        pytest.param(EP2, [EP2], True, id="ep2"),
        pytest.param(TP2FSDP, [TP2FSDP], False, id="tp2-fsdp2"),
    ],
)
def test_snapshot_resumes_bit_exact_in_its_layout_and_resharded_in_another(launcher, tmp_path, first, others, moe):
    got = launcher(4, _crash_and_resume, first, others, moe, str(tmp_path / "mem"))
    assert got[0]["taken"] == [CRASH, STEPS]
    config = _moe_config() if moe else tiny_config()
    oracle = reference_run(config, STEPS, num_samples=SAMPLES)
    assert_matches_reference([r["full"] for r in got], oracle, f"uninterrupted {first}")
    for i, layout in enumerate(others):
        what = f"{first} -> {layout}"
        resumed = [r["resumed"][i] for r in got]
        assert_matches_reference(resumed, (oracle[0][CRASH:], oracle[1]), what)
        if layout == first:
            for rank, result in enumerate(got):
                _assert_bitwise(resumed[rank], result["full"], f"rank {rank} {what}")


# ----------------------------------------------------------------------------------------- one real SIGKILL
SPEC = dict(max_steps=8, every_n_steps=4, memory_every=1, layout=dict(zero_stage=1))


@pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)
def test_sigkill_after_memory_snapshot_resumes_from_memory_bit_exact(tmp_path):
    """SIGKILL every rank once the step-7 snapshot is written (disk: step 4); the restart resumes from memory."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    folder = run_folder(default_snapshot_root(), str((out / "ckpt").resolve()))
    try:
        with background(workers=1) as jobs:
            jobs.submit("ref", launch_ok, {**SPEC, "out": str(ref)})
            killed = launch({**SPEC, "out": str(out), "kill_after_snapshot": 7, "resume": "auto"})
            jobs.result("ref")
        assert not run_folder(default_snapshot_root(), str((ref / "ckpt").resolve())).exists(), "removed at fit end"
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("epoch")) == ["epoch=0-step=4.ckpt"]
        # The two newest are kept (step 5's deletion, queued behind step 7's write, may not have run before the kill).
        assert list_snapshots(folder)[-2:] == [6, 7]

        resumed = launch({**SPEC, "out": str(out), "resume": "auto"})
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        log = resumed.stdout + resumed.stderr
        assert "in-memory snapshot of step 7" in log, log[-3000:]
        assert not folder.exists()
        want, got = losses(ref), losses(out)
        assert sorted(got) == list(range(1, 9))
        for step in range(1, 9):  # same LR, same batch, same loss as the uninterrupted run, to the last bit
            assert got[step]["lr"] == want[step]["lr"], (step, got[step], want[step])
            assert got[step]["loss"] == want[step]["loss"], (step, got[step], want[step])
        ref_weights, weights = final_weights(ref), final_weights(out)
        assert weights.keys() == ref_weights.keys()
        for name, value in ref_weights.items():
            assert torch.equal(weights[name], value), name
    finally:
        remove_snapshots(folder)  # a failing run leaves nothing in /dev/shm

"""Under TP=2 (world 4): flat ZeRO-3 loads FSDP2's checkpoint (``_StridedShard`` x TP placements, AdamW state
included). Its templates are built with the same placements it saves with, so this also checks what it writes.
Inside the same runs: once flattened, no flat unit keeps the original TP-local weights alive (issue 37 item 1)."""

from __future__ import annotations

import lightning as L

from tests.parallel._zero3_flat_hops import FLAT, STEPS_PER_HOP, run_hops


class FlatLayoutsHoldNoWeights(L.Callback):
    """A flat unit keeps each TP parameter's layout (mesh, placements, global shape) for its views and checkpoints;
    it held the original DTensor, and so the whole TP-local weight, for the whole run (on a GPU, a second copy of
    the model's TP shard beside the ZeRO-3 shards). Raises in the worker when a layout holds storage."""

    def on_train_start(self, trainer, pl_module):
        from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3

        layouts = [
            s.dtensor
            for part in find_flat_zero3(pl_module)
            for u in part.units
            for s in u.slots
            if s.dtensor is not None
        ]
        assert layouts or trainer.strategy.parallel.zero3_impl != "flat", "no TP parameter in a flat unit"
        held = {str(d.to_local().device) for d in layouts} - {"meta"}
        assert not held, f"flat units keep the original TP-local weights on {held}"


def test_tp2_flat_zero3_resumes_tp2_fsdp2_checkpoint(launcher, tmp_path):
    tp = dict(tensor_parallel_size=2)
    hops = [dict(tp, zero_stage=3, zero3_impl="fsdp2"), dict(tp, **FLAT)]
    out = run_hops(launcher, tmp_path, hops, world=4, callbacks=[FlatLayoutsHoldNoWeights()])
    assert out.steps_per_hop == [{STEPS_PER_HOP}] * len(out.steps_per_hop), out.steps_per_hop  # resumed, not restarted
    assert out.rel_error <= 1e-5, f"{out.worst}: relative error {out.rel_error:.3e} against one process"

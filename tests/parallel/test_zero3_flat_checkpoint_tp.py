"""Under TP=2 (world 4): flat ZeRO-3 loads FSDP2's checkpoint (``_StridedShard`` x TP placements, AdamW state
included). Its templates are built with the same placements it saves with, so this also checks what it writes."""

from __future__ import annotations

from tests.parallel._zero3_flat_hops import FLAT, STEPS_PER_HOP, run_hops


def test_tp2_flat_zero3_resumes_tp2_fsdp2_checkpoint(launcher, tmp_path):
    tp = dict(tensor_parallel_size=2)
    hops = [dict(tp, zero_stage=3, zero3_impl="fsdp2"), dict(tp, **FLAT)]
    out = run_hops(launcher, tmp_path, hops, world=4)
    assert out.steps_per_hop == [{STEPS_PER_HOP}] * len(out.steps_per_hop), out.steps_per_hop  # resumed, not restarted
    assert out.rel_error <= 1e-5, f"{out.worst}: relative error {out.rel_error:.3e} against one process"

"""Under TP=2 (world 4): flat ZeRO-3 loads FSDP2's checkpoint (``_StridedShard`` x TP placements, AdamW state
included). Its templates are built with the same placements it saves with, so this also checks what it writes."""

from __future__ import annotations

from tests.parallel._zero3_flat_hops import FLAT, check_hops


def test_tp2_flat_zero3_resumes_tp2_fsdp2_checkpoint(launcher, tmp_path):
    tp = dict(tensor_parallel_size=2)
    hops = [dict(tp, zero_stage=3, zero3_impl="fsdp2"), dict(tp, **FLAT)]
    check_hops(launcher, tmp_path, hops, world=4)

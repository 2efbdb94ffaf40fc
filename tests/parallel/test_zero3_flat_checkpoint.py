"""Flat ZeRO-3 checkpoints reshard into FSDP2 and back (AdamW state included); ZeRO-1 in the sibling file."""

from __future__ import annotations

from tests.parallel._zero3_flat_hops import FLAT, STEPS_PER_HOP, run_hops


def test_flat_zero3_checkpoint_reshards_to_fsdp2_and_back(launcher, tmp_path):
    out = run_hops(launcher, tmp_path, [FLAT, dict(zero_stage=3, zero3_impl="fsdp2"), FLAT])
    assert out.steps_per_hop == [{STEPS_PER_HOP}] * len(out.steps_per_hop), out.steps_per_hop  # resumed, not restarted
    assert out.rel_error <= 1e-5, f"{out.worst}: relative error {out.rel_error:.3e} against one process"

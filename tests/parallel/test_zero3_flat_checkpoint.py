"""Flat ZeRO-3 checkpoints reshard into FSDP2 and back (AdamW state included); ZeRO-1 in the sibling file."""

from __future__ import annotations

from tests.parallel._zero3_flat_hops import FLAT, check_hops


def test_flat_zero3_checkpoint_reshards_to_fsdp2_and_back(launcher, tmp_path):
    check_hops(launcher, tmp_path, [FLAT, dict(zero_stage=3, zero3_impl="fsdp2"), FLAT])

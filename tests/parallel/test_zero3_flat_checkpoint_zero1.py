"""Flat ZeRO-3 checkpoints reshard into ZeRO-1 (our distributed optimizer) and back (AdamW state included)."""

from __future__ import annotations

from tests.parallel._zero3_flat_hops import FLAT, check_hops


def test_flat_zero3_checkpoint_reshards_to_zero1_and_back(launcher, tmp_path):
    check_hops(launcher, tmp_path, [FLAT, dict(zero_stage=1), FLAT])

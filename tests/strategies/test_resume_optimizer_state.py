"""Optimizer state resharded across layouts: one AdamW run saved and resumed under four layouts in turn equals one
uninterrupted single-process AdamW run.

The other layout-changing resumes (``test_checkpoint.py``, ``test_pipeline_loop.py``, ``test_hetero_meshes.py``)
train with plain SGD, which keeps no state: they prove the weights reshard, not the optimizer. Here every step after
a resume depends on Adam's moments and step count, so a moment lost, resharded to the wrong parameter rows or reset
changes the weights. The chain (4 processes, 3 steps per layout, a checkpoint at each epoch end):

1. TP=2 + SP x DP=2, ZeRO-1 (Adam's moments sharded over DP, each a TP shard; the norms', plain weights whose
   gradients the step sums over TP, sliced over DP x TP);
2. TP=1 x DP=4, ZeRO-1: ZeRO-1 optimizer state across a TP change (and DP 2 -> 4);
3. heterogeneous meshes [TP=2 | DP=2], 3 + 1 layers, ZeRO-1: homogeneous -> hetero optimizer state;
4. TP=2 x DP=2 (no SP), ZeRO-1 again: hetero -> homogeneous.

Each leg's losses, pre-clip gradient norms (clipped at 1.0: below every norm) and final weights match the oracle's
steps (rel. err <= 1e-5).
"""

from __future__ import annotations

import pytest

from tests.strategies._lm import GRAD_NORMS, assert_rel_close, reference_run, tiny_config, trainer_run

NUM_SAMPLES, STEPS_PER_EPOCH, CLIP = 12, 3, 1.0  # global batch 4: each checkpoint sits on an epoch boundary
HOMOGENEOUS = dict(tensor_parallel_size=2, zero_stage=1)
HETERO = dict(hetero_meshes=[dict(tensor_parallel_size=2), dict(data_parallel_size=2)], hetero_layers=[3, 1],
              micro_batch_size=2, zero_stage=1)  # fmt: skip
LEGS = [  # (what, strategy keywords, DataLoader batch per rank)
    # saved under SP: the norm weights plain, their Adam moments in ZeRO-1 slices over dp x tp (summed over TP at the
    # step), read back by DP 4 (leg 2); leg 4 loads them into TP 2 without SP (replicated DTensor norms)
    ("tp2-sp-xdp2-zero1", dict(HOMOGENEOUS, sequence_parallel=True), 2),
    ("tp1xdp4-zero1", dict(zero_stage=1), 1),
    ("hetero-tp2|dp2-zero1", HETERO, 4),
    ("tp2xdp2-zero1-again", HOMOGENEOUS, 2),
]


def _config():
    return tiny_config(num_layers=4)


def test_adam_state_reshards_across_tp_zero1_and_hetero_layouts(launcher, tmp_path):
    references = [
        reference_run(_config(), STEPS_PER_EPOCH * (leg + 1), clip=CLIP, num_samples=NUM_SAMPLES, optimizer="adamw")
        for leg in range(len(LEGS))
    ]
    ref_losses, ref_params = references[-1]
    assert (ref_params[GRAD_NORMS] > CLIP).all(), ref_params[GRAD_NORMS]  # clipping active at every step
    checkpoint = None
    for leg, (what, strategy, batch_size) in enumerate(LEGS):
        save = str(tmp_path / f"{leg}-{what}.ckpt")
        results = launcher(4, trainer_run, strategy, _config(), -1, max_epochs=leg + 1, num_samples=NUM_SAMPLES,
                           clip=CLIP, optimizer="adamw", batch_size=batch_size, ckpt_path=checkpoint,
                           save_path=save)  # fmt: skip
        steps = slice(STEPS_PER_EPOCH * leg, STEPS_PER_EPOCH * (leg + 1))
        want = references[leg][1]
        for rank, (losses, params) in enumerate(results):
            where = f"leg {leg + 1} ({what}) rank {rank}"
            assert losses == pytest.approx(ref_losses[steps], rel=1e-5), (where, losses, ref_losses[steps])
            assert_rel_close(params.pop(GRAD_NORMS), ref_params[GRAD_NORMS][steps], 1e-5, f"{where} gradient norms")
            assert params, where
            for name, value in params.items():  # pipeline ranks hold their stages' parameters
                assert_rel_close(value, want[name], 1e-5, f"{where} {name}")
        held = {name for _, params in results for name in params}
        assert held == set(want) - {GRAD_NORMS}, f"leg {leg + 1} ({what}): parameters held across ranks"
        checkpoint = save

"""``parallel.memory.expected_state_bytes`` is what the strategy really holds: state bytes measured at the optimizer
step of a Trainer run (parameters, gradients, master copies, Adam states per rank) for DDP and ZeRO-1/2/3, in fp32
and bf16-mixed, match the formula that ``tune`` and ``bench/`` use; so does ZeRO-2's gradient peak during backward
(its fp32 shard plus the staging buckets alive at once)."""

from __future__ import annotations

import pytest

from tests.strategies._lm import tiny_config, trainer_run

STAGES = (0, 1, 2, 3)


def _measure(precision: str) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3, summon_full_params

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.measured: dict = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:  # Adam states exist from the second step on
                self.measured.update(vars(state_bytes(pl_module, [optimizer])))
                with summon_full_params(pl_module.model):  # flat ZeRO-3 (the default engine) holds shards
                    params = {id(p): p for p in pl_module.model.parameters()}.values()
                    self.measured["psi"] = sum(p.shape.numel() if isinstance(p, DTensor) else p.numel() for p in params)
                # Flat ZeRO-3 gives each rank whole rows of every parameter, so its share is off psi / N by under a
                # row per parameter: the elements this rank holds, exactly.
                parts = find_flat_zero3(pl_module.model)
                held = sum(s.hi - s.lo for part in parts for u in part.units for s in u.slots)
                world = trainer.world_size
                self.measured["row_slack"] = abs(held - self.measured["psi"] / world) if parts else 0.0
                dopts = list(trainer.strategy._dist_optimizers.values())
                if trainer.strategy.parallel.zero_stage < 3:
                    self.measured["staging_peak"] = 4 * max(d.reducer.peak_staging_numel for d in dopts)
                    self.measured["bucket"] = max(b.padded for d in dopts for b in d.buckets)

    out = {}
    for stage in STAGES:
        measure = Measure()
        trainer_run(
            dict(zero_stage=stage), tiny_config(), 2, precision=precision, callbacks=[measure], optimizer="adamw"
        )
        out[stage] = measure.measured
    return out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_measured_state_bytes_match_expected(launcher, precision):
    from lightning_flagscale.accounting.state_bytes import expected_state_bytes

    for per_stage in launcher(2, _measure, precision):
        for stage, m in per_stage.items():
            want = vars(expected_state_bytes(m["psi"], 2, stage, precision))
            for key, value in want.items():
                # Beyond the formula: Adam's 4-byte step per tensor (~20 tensors) and shard padding (a few rows);
                # flat ZeRO-3's whole-row shards: the elements held beyond psi / N, at most 8 bytes (Adam's moments) each.
                slack = 256 + 1e-3 * value + 8 * m["row_slack"]
                assert abs(m[key] - value) <= slack, (precision, stage, key, m[key], value)
            if stage == 2:
                peak = expected_state_bytes(m["psi"], 2, 2, precision, when="backward_peak", bucket_numel=m["bucket"])
                got = m["grads"] + m["staging_peak"]
                assert m["staging_peak"] > 0 and abs(got - peak.grads) <= 256, (precision, got, peak.grads)

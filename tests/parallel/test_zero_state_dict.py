"""ZeRO-1 optimizer-state checkpoints gather each state key with a collective: every rank must gather the keys in the
same order whatever order its state dict holds them in (after ``load_state_dict`` it differed between ranks, and
the second checkpoint after a resume held rank 0's ``exp_avg`` next to rank 1's ``exp_avg_sq``; issue 14)."""

from __future__ import annotations

import torch

from tests.strategies._lm import tiny_config, trainer_run


def _state_dict_is_independent_of_key_order(_):
    import lightning as L
    import torch.distributed as dist

    checks: list[bool] = []

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            (dopt,) = trainer.strategy._dist_optimizers.values()
            before = dopt.state_dict()["state"]
            for bucket in dopt.buckets:  # one rank holds its keys in reverse order
                state = dopt.optimizer.state[bucket.main_param]
                if dist.get_rank() == 1:
                    dopt.optimizer.state[bucket.main_param] = dict(reversed(list(state.items())))
            after = dopt.state_dict()["state"]
            checks.append(all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n]))
            dopt.load_state_dict({"state": after})  # and a load keeps the states apart
            again = dopt.state_dict()["state"]
            checks.append(all(torch.equal(before[n][k], again[n][k]) for n in before for k in before[n]))
            checks.append(any(not torch.equal(s["exp_avg"], s["exp_avg_sq"]) for s in before.values()))

    trainer_run(dict(zero_stage=1), tiny_config(), 2, callbacks=[Check()], optimizer="adamw")
    return checks


def test_zero1_optimizer_state_dict_gathers_keys_in_one_order(launcher):
    for checks in launcher(2, _state_dict_is_independent_of_key_order, None):
        assert checks == [True, True, True]

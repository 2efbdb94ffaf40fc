"""A 2-process run in which rank 1 misbehaves at step 2, for the watchdog tests (launched as a subprocess).

``python -m tests.strategies._hang_run <mode> <watchdog_timeout> <out>``: ``mode`` is ``hang`` (rank 1 sleeps
inside a step: its peers block in the next collective) or ``die`` (rank 1 SIGKILLs itself). ``out`` gets a line
per finished step, so a test can tell when the failure has happened.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(mode: str, timeout: float, out: str) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from tests.strategies._lm import TokenDataset, make_module, tiny_config

    torch.set_num_threads(1)

    class Misbehave(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with open(out, "a") as f:
                f.write(f"{dist.get_rank()} {trainer.global_step}\n")
            if trainer.global_step == 2 and dist.get_rank() == 1:
                if mode == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FlagScaleStrategy(zero_stage=1, watchdog_timeout=timeout),
        max_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Misbehave()],
    )  # fmt: skip
    config = tiny_config()
    trainer.fit(make_module(config), DataLoader(TokenDataset(config.vocab_size, 400), batch_size=2))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])

"""A real training run of the main recipe's module for the kill/resume tests, launched as a subprocess.

``python -m tests.strategies._resume_run '<json spec>'`` trains ``CausalLMModule`` (AdamW, linear warmup then
cosine decay, as in ``recipes/llama_tiny.yaml``) on ``LMDataModule``'s synthetic corpus with ``FlagScaleStrategy``
on ``devices`` CPU processes started by Lightning's own launcher, writing a sharded checkpoint every
``every_n_steps`` optimizer steps. Spec keys:

- ``out``: folder; ``ckpt/`` holds the checkpoints, ``losses.jsonl`` one line per optimizer step (global token mean,
  the LR the step ran at), ``final.ckpt`` the end state.
- ``layout``: ``FlagScaleStrategy`` keyword arguments; ``devices``; ``max_steps``; ``every_n_steps``.
- ``kill_at``: every rank SIGKILLs itself right after this optimizer step (before any later checkpoint).
- ``ckpt_path``: resume from it (a path, ``"last"``) or ``None``; ``resume``: ``FlagScaleStrategy(resume=...)``.
- ``async``: ``async_checkpoint=True``; ``save_last`` (default True), ``save_top_k`` (default 1): ``ModelCheckpoint``.
- ``kill_event``: ``[event, text]``: SIGKILL (1 s later) at that step of the save whose path contains ``text``
  (see ``checkpoint.sharded._save_event``).
- ``accumulate``: ``Trainer(accumulate_grad_batches=...)``; ``batch_size``: per data-parallel rank (default 2).
- ``num_nodes``: ``Trainer(num_nodes=...)``; ``record_layout``: every rank writes ``layout-<rank>.json``.
- ``fault``: ``[where, step, micro]``: every rank SIGKILLs itself inside optimizer step ``step``, in the forward or
  backward of micro-batch ``micro`` of its window, or in the optimizer step (see ``_fault``).
- ``preset``: ``TransformerConfig.from_preset(preset, **config)`` instead of the tiny llama.
- ``memory_every``: add ``MemoryCheckpoint(every_n_train_steps=...)``; ``kill_after_snapshot``: every rank SIGKILLs
  itself once its snapshot of that step is written.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

SEQ_LEN, BATCH, SAMPLES = 32, 2, 48  # 48 samples / (2 per rank x DP=2) = 12 steps per epoch


def _callbacks(spec: dict[str, Any], out: Path) -> list:
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    class RecordAndKill(L.Callback):
        """Rank 0 appends the step's global loss and LR; every rank SIGKILLs itself after step ``kill_at``."""

        window = 0.0
        lr = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lr = optimizer.param_groups[0]["lr"]  # the LR this step runs at

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if spec.get("trace") and trainer.is_global_zero:
                row = {"epoch": trainer.current_epoch, "batch_idx": batch_idx, "step": trainer.global_step,
                       "ids": batch["input_ids"][:, 1].tolist()}  # fmt: skip
                with open(out / "trace.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
            # Lightning's loss is what it backpropagated (divided by the accumulation count): sum it per window.
            self.window = self.window + outputs["loss"].detach().clone()
            if (batch_idx + 1) % trainer.accumulate_grad_batches:
                return
            loss, self.window = self.window, 0.0
            dist.all_reduce(loss)  # as `log(sync_dist=True)`: the mean over ranks is the global token mean
            if trainer.is_global_zero:
                row = {"step": trainer.global_step, "loss": loss.item() / dist.get_world_size(), "lr": self.lr}
                with open(out / "losses.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
            if trainer.global_step == spec.get("kill_at"):
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    class RecordLayout(L.Callback):
        """Every rank writes ``layout-<rank>.json``: its node (as the cluster environment reports it), its local rank
        and the global ranks of its tensor-parallel group."""

        def on_train_start(self, trainer, pl_module):
            strategy = trainer.strategy
            tp = dist.get_process_group_ranks(strategy.meshes["tp"].get_group())
            row = {"rank": trainer.global_rank, "node": strategy.node_rank, "local": trainer.local_rank, "tp": tp,
                   "env": type(strategy.cluster_environment).__name__}  # fmt: skip
            (out / f"layout-{trainer.global_rank}.json").write_text(json.dumps(row))

    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", every_n_train_steps=spec["every_n_steps"], save_top_k=spec.get("save_top_k", 1),
        monitor="step", mode="max", save_last=spec.get("save_last", True),
    )  # fmt: skip
    extra = [RecordLayout()] if spec.get("record_layout") else []
    if spec.get("fault"):
        extra.append(_fault(*spec["fault"]))
    if not spec.get("memory_every"):
        return [RecordAndKill(), *extra, checkpoint]
    from lightning_flagscale.callbacks import MemoryCheckpoint

    memory = MemoryCheckpoint(every_n_train_steps=spec["memory_every"])

    class KillAfterSnapshot(L.Callback):
        """Runs after MemoryCheckpoint: waits for this rank's snapshot of step ``kill_after_snapshot`` to be written,
        then SIGKILLs the rank (a crash right after a snapshot newer than the last disk checkpoint)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == spec.get("kill_after_snapshot"):
                memory.wait()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    return [RecordAndKill(), *extra, memory, KillAfterSnapshot(), checkpoint]


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _fault(where: str, step: int, micro: int = 0):
    """SIGKILL every rank from inside optimizer step ``step`` (1-based): in the forward of its micro-batch ``micro``
    (a forward hook on the first module with parameters), in that micro-batch's backward (a gradient hook on the last
    parameter, whose gradient backward computes first), or in the optimizer step (``on_before_optimizer_step``: after
    the gradient reduction, before the update). Each rank dies at the same point of its own program, so none is left
    waiting in a collective."""
    import lightning as L

    if where not in ("forward", "backward", "optimizer"):
        raise ValueError(f"fault point {where!r}")

    class Fault(L.Callback):
        armed = False

        def on_train_start(self, trainer, pl_module):
            if where == "forward":
                first = next(m for m in pl_module.modules() if any(True for _ in m.parameters(recurse=False)))
                first.register_forward_hook(lambda *_: _die() if self.armed else None)
            elif where == "backward":
                [p for p in pl_module.parameters() if p.requires_grad][-1].register_hook(
                    lambda grad: _die() if self.armed else None
                )

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            micro_step = batch_idx % trainer.accumulate_grad_batches
            self.armed = trainer.global_step == step - 1 and micro_step == micro

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if where == "optimizer" and trainer.global_step == step - 1:
                _die()

    return Fault()


def _inject_save_kill(event: str, text: str) -> None:
    import time

    from lightning_flagscale.checkpoint import sharded

    def kill(name: str, path: Path) -> None:
        if name == event and text in path.name:
            time.sleep(1.0)  # let the training thread go on (and retention ask to delete the older checkpoint)
            os.kill(os.getpid(), signal.SIGKILL)

    sharded._save_event = kill


def main(spec: dict[str, Any]) -> None:
    import lightning as L

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.data import LMDataModule
    from lightning_flagscale.models import CausalLMModule
    from tests.strategies._lm import tiny_config

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(1234)
    if spec.get("preset"):
        from lightning_flagscale.models import TransformerConfig

        config = TransformerConfig.from_preset(spec["preset"], **spec.get("config", {}))
    else:
        config = tiny_config(**spec.get("config", {}))
    module = CausalLMModule(config, learning_rate=3e-3, warmup_steps=4, min_lr_ratio=0.1)
    data = LMDataModule(
        seq_len=SEQ_LEN, batch_size=spec.get("batch_size", BATCH), num_train_samples=SAMPLES, num_val_samples=8
    )
    if spec.get("kill_event"):
        _inject_save_kill(*spec["kill_event"])
    strategy = FlagScaleStrategy(**spec["layout"], async_checkpoint=spec.get("async", False), resume=spec.get("resume"))
    trainer = L.Trainer(
        accelerator="cpu", devices=spec.get("devices", 2), strategy=strategy, plugins=[FlagScalePrecision("32-true")],
        max_steps=spec["max_steps"], logger=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, limit_val_batches=0, num_sanity_val_steps=0,
        accumulate_grad_batches=spec.get("accumulate", 1), callbacks=_callbacks(spec, out),
        num_nodes=spec.get("num_nodes", 1),
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=spec.get("ckpt_path"))
    trainer.save_checkpoint(out / "final.ckpt")
    strategy.wait_for_checkpoint()


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))

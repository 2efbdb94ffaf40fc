"""Two rounds of checkpointing with retention, SIGKILLed at one step of the second round (fault injection).

``python -m tests.checkpoint._save_kill <folder> <sync|async> <event>``: round 1 writes ``step3.ckpt`` and
``last.ckpt`` (step 3); round 2 writes ``step6.ckpt``, asks retention to delete ``step3.ckpt`` (as ``ModelCheckpoint``
with ``save_top_k=1`` does, right after the save call returns) and replaces ``last.ckpt``. The process SIGKILLs
itself at the first ``event`` (see ``sharded._save_event``) of round 2. Tensors hold the step number.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def main(folder: Path, mode: str, event: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_flagscale.checkpoint import sharded

    dist.init_process_group("gloo", init_method=f"file://{folder}/.store", rank=0, world_size=1)
    group = dist.new_group(backend="gloo") if mode == "async" else None
    ckpt = folder / "ckpt"

    def save(name: str, step: int):
        state = {"state_dict": {"w": torch.full((64, 64), float(step))}}
        return sharded.save_sharded(ckpt / name, state, {"global_step": step}, async_group=group)

    def remove(pending, old: Path) -> None:  # what FlagScaleStrategy.remove_checkpoint does
        if pending is not None:
            pending.remove_after(old)
        else:
            sharded.remove_checkpoint_path(old)

    for name in ("step3.ckpt", "last.ckpt"):
        pending = save(name, 3)
        if pending is not None:
            pending.wait()

    def kill_at(name: str, path: Path) -> None:
        if name == event:
            os.kill(os.getpid(), signal.SIGKILL)

    sharded._save_event = kill_at
    pending = save("step6.ckpt", 6)
    remove(pending, ckpt / "step3.ckpt")
    if pending is not None:
        pending.wait()
    pending = save("last.ckpt", 6)
    if pending is not None:
        pending.wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])

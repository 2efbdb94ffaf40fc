"""Python's cyclic garbage collector between training steps, not inside one (issue 42 item 2).

A pipeline schedule's step creates many autograd and communication objects; left automatic, the collector now and
then runs a full collection in the middle of a step, and every rank downstream waits for it: in
``bench/pipeline.py`` one step in five idled 2-6 points of the step more at m = 16, always in the same schedules, and
``--manual-gc`` (what this callback does) brought every step within 1.5 points of theory. Megatron-LM's
``--manual-gc`` / ``--manual-gc-interval`` and torchtitan's ``gc_freq`` do the same: automatic collection off for
training, one collection of the young generations every ``every_n_steps`` optimizer steps, the collector restored
when training ends (also on an exception), so evaluation and the rest of the process run as before.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
from typing_extensions import override

__all__ = ["ManualGC"]


class ManualGC(L.Callback):
    """Collect garbage every ``every_n_steps`` optimizer steps, at a step boundary, and never inside a step.

    ``generation``: the oldest generation collected there (``gc.collect(generation)``; 1, torchtitan's choice, is
    cheap; 2 is a full collection). The process's own collector setting is restored when training ends."""

    def __init__(self, every_n_steps: int = 50, generation: int = 1) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"ManualGC(every_n_steps={every_n_steps!r}): give a positive number of optimizer steps.")
        if generation not in (0, 1, 2):
            raise ValueError(f"ManualGC(generation={generation!r}): Python's collector has generations 0, 1 and 2.")
        self.every_n_steps = every_n_steps
        self.generation = generation
        self._was_enabled: bool | None = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # start from a clean heap: what setup left behind is not collected inside the first steps
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # optimizer steps: an accumulation window collects once, after its step
        if step != self._last_step and step % self.every_n_steps == 0:
            gc.collect(self.generation)
        self._last_step = step

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

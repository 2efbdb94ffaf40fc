"""Resilience pieces of ``FlagScaleStrategy`` that run around the training loop rather than inside a step.

- :class:`FlagScaleLauncher`: Lightning's script launcher, plus two things done in the launching process before
  any worker exists: the layout checks (one error, once, instead of one traceback per spawned rank) and the
  choice of the checkpoint to resume from when ``resume="auto"`` (with a ``MemoryCheckpoint`` callback, also for
  ``ckpt_path="last"``: ``_memory.NEWEST``, chosen collectively in ``load_checkpoint``).
- :func:`auto_resume_path`: the newest complete checkpoint in the folders of the ``ModelCheckpoint`` callbacks.
- :class:`StepGuard`: the per-step decision on non-finite losses/gradients (``nan_policy``) and loss spikes.
- :class:`ResilienceHooks`: how ``FlagScaleStrategy`` uses them (launcher, watchdog, step guard).
"""

from __future__ import annotations

import copy
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_flagscale.parallel.data_parallel.grad_buckets import profiler_active
from lightning_flagscale.parallel.data_parallel.optimizer import grads_finite
from lightning_flagscale.strategies._snapshots import NEWEST, memory_callback
from lightning_flagscale.strategies._state import auto_resume_path, load_training_state
from lightning_flagscale.strategies._watchdog import Watchdog

__all__ = [
    "FlagScaleLauncher",
    "NanPolicy",
    "ResilienceHooks",
    "StepGuard",
    "StepVerdict",
    "fit_arguments",
    "guard_step",
    "validate_before_launch",
]

# `Trainer.fit` hands `_fit_impl(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)`
# to the launcher; these are the positions read here.
_FIT_DATA, _FIT_DATAMODULE, _FIT_CKPT = 1, 3, 4


def fit_arguments(function: Callable, args: tuple) -> dict[str, Any] | None:
    """The datamodule and ckpt_path a launched ``Trainer.fit`` was given, or None for validate/test/predict."""
    if getattr(function, "__name__", "") != "_fit_impl" or len(args) <= _FIT_CKPT:
        return None
    import lightning as L

    datamodule = args[_FIT_DATAMODULE]
    if datamodule is None and isinstance(args[_FIT_DATA], L.LightningDataModule):
        datamodule = args[_FIT_DATA]
    return {"datamodule": datamodule, "ckpt_path": args[_FIT_CKPT]}


class FlagScaleLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (it spawns nothing when the processes were created externally, e.g. torchrun)
    that first runs ``validate(datamodule)`` and, for ``resume="auto"``, picks the checkpoint to resume from."""

    def __init__(
        self, *args: Any, validate: Callable[[Any], None], resume: str | None, spawn: bool, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._validate = validate
        self._resume = resume
        self._spawn = spawn

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        fit = fit_arguments(function, args)
        self._validate(fit["datamodule"] if fit else None)
        chosen = None
        if fit is not None and trainer is not None:
            chosen, args = self._resume_choice(fit, trainer, args)
        try:
            if self._spawn:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            return function(*args, **kwargs)
        finally:
            if chosen is not None:
                trainer.ckpt_path = None  # a later `validate`/`test` must not reload it

    def _resume_choice(self, fit: dict[str, Any], trainer: Any, args: tuple) -> tuple[str | None, tuple]:
        """The checkpoint ``fit`` resumes from (set as ``trainer.ckpt_path``, Lightning's public way to choose it)."""
        auto = self._resume == "auto" and fit["ckpt_path"] is None and trainer.ckpt_path is None
        chosen = None
        if memory_callback(trainer) is not None and (auto or fit["ckpt_path"] == "last"):
            # Snapshot or disk checkpoint: rank 0 picks the newest complete one in `load_checkpoint(NEWEST)`.
            chosen = NEWEST
            args = (*args[:_FIT_CKPT], None, *args[_FIT_CKPT + 1 :])
        elif auto:
            chosen = auto_resume_path(trainer)
        if chosen is not None:
            rank_zero_info(f"FlagScaleStrategy: resuming from {chosen}")
            trainer.ckpt_path = str(chosen)
        return chosen, args


NanPolicy = Literal["raise", "skip_step", "rollback"]


@dataclass(kw_only=True)
class StepVerdict:
    """What every rank does with this optimizer step (the same on every rank: decided from gathered flags)."""

    action: Literal["step", "skip", "rollback"]
    loss: float
    """The step's global loss (mean over ranks of each rank's share, as ``log(sync_dist=True)``)."""
    message: str = ""


class StepGuard:
    """Non-finite loss/gradient policy and FlagScale's ``auto_skip_spiky_loss``, decided once per optimizer step.

    Every rank takes the same decision and names the ranks that saw the NaN/Inf:

    - the loss part, ``[loss share, non-finite loss]`` of each rank, is all-gathered asynchronously as soon as the
      window's last loss is known (:meth:`launch`, before its backward), so it completes under backward;
    - the gradient part is one flag per rank, all-gathered when :meth:`decide` runs after the gradient reduction,
      except when the reduced gradients are the same on every rank (``replicated_grads``: plain data parallelism,
      stage 0 without TP/PP/EP): then every rank's own check is the world's answer and no collective is needed.

    A spike is a global loss above ``(1 + spike_threshold)`` times the mean of the last ``spike_window`` stepped
    losses (FlagScale skips such iterations to ride out data spikes).
    """

    def __init__(self, nan_policy: NanPolicy, spike_threshold: float | None, spike_window: int = 10) -> None:
        if nan_policy not in ("raise", "skip_step", "rollback"):
            raise ValueError(f"nan_policy={nan_policy!r} is unknown; use 'raise', 'skip_step' or 'rollback'.")
        if spike_threshold is not None and spike_threshold <= 0:
            raise ValueError(f"skip_spiky_loss={spike_threshold} must be > 0 (a relative rise, e.g. 0.2) or None.")
        self.nan_policy = nan_policy
        self.spike_threshold = spike_threshold
        self.history: deque[float] = deque(maxlen=spike_window)
        self.window_loss: Tensor | None = None
        self.skipped_steps = 0
        self._loss_rows: tuple[list[Tensor], Any] | None = None  # (gathered rows, pending work or None)

    def observe(self, loss: Any) -> None:
        """Add a micro-batch's loss (as the strategy's ``training_step`` returns it) to the step's window."""
        value = loss.get("loss") if isinstance(loss, Mapping) else loss
        if isinstance(value, Tensor):
            value = value.detach().float().reshape(())
            self.window_loss = value if self.window_loss is None else self.window_loss + value

    @torch.no_grad()
    def launch(self, accumulate: int, device: torch.device) -> None:
        """Start exchanging the window's loss (``[loss share, non-finite loss]`` per rank); :meth:`decide` waits
        for it. Called once the window's last loss is observed; a window not launched is exchanged in ``decide``."""
        self._wait_loss_rows()  # a window launched but never decided (manual optimization): superseded
        loss = self.window_loss if self.window_loss is not None else torch.zeros((), device=device)
        self.window_loss = None
        loss = loss.to(device) / accumulate
        mine = torch.stack([loss, (~torch.isfinite(loss)).float()])
        if not dist.is_initialized():
            self._loss_rows = ([mine], None)
            return
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        # Under torch.profiler a work must not outlive the step (see grad_buckets.profiler_active): exchange now.
        work = dist.all_gather(rows, mine, async_op=not profiler_active())
        self._loss_rows = (rows, work)

    def _wait_loss_rows(self) -> list[Tensor] | None:
        if self._loss_rows is None:
            return None
        rows, work = self._loss_rows
        self._loss_rows = None
        if work is not None:
            work.wait()
        return rows

    @torch.no_grad()
    def decide(
        self,
        params: Iterable[Tensor],
        step: int,
        accumulate: int,
        device: torch.device,
        *,
        replicated_grads: bool = False,
    ) -> StepVerdict:
        if self._loss_rows is None:
            self.launch(accumulate, device)
        loss_rows = torch.stack(self._wait_loss_rows()).cpu()
        world = loss_rows.shape[0]
        params = list(params)
        bad_grad = (~grads_finite(params)).to(device=device, dtype=torch.float32).reshape(1)
        if replicated_grads or world == 1 or not params:  # (no params: the loss scaler checks the gradients)
            grad_flags = bad_grad.cpu().expand(world)  # the same reduced gradients on every rank
        else:
            flags = [torch.empty_like(bad_grad) for _ in range(world)]
            dist.all_gather(flags, bad_grad)
            grad_flags = torch.cat(flags).cpu()
        global_loss = float(loss_rows[:, 0].mean())
        bad_loss_ranks = [r for r in range(world) if loss_rows[r, 1] > 0]
        bad_grad_ranks = [r for r in range(world) if grad_flags[r] > 0]
        if bad_loss_ranks or bad_grad_ranks:
            what = "; ".join(
                f"non-finite {kind} on rank(s) {ranks}"
                for kind, ranks in (("loss", bad_loss_ranks), ("gradients", bad_grad_ranks))
                if ranks
            )
            message = f"Step {step}: {what} (global loss {global_loss})."
            if self.nan_policy == "raise":
                raise FloatingPointError(
                    f"{message} Training stopped (FlagScaleStrategy(nan_policy='raise')); lower the learning rate,"
                    " check the data, or choose nan_policy='skip_step' / 'rollback'."
                )
            self.skipped_steps += 1
            action = "skip" if self.nan_policy == "skip_step" else "rollback"
            return StepVerdict(action=action, loss=global_loss, message=message)
        if self.spike_threshold is not None and len(self.history) == self.history.maxlen:
            mean = sum(self.history) / len(self.history)
            if global_loss > (1.0 + self.spike_threshold) * mean:
                self.skipped_steps += 1
                message = (
                    f"Step {step}: loss {global_loss:.4f} is a spike (> (1 + {self.spike_threshold}) x {mean:.4f},"
                    f" the mean of the last {len(self.history)} steps); step skipped (skip_spiky_loss)."
                )
                return StepVerdict(action="skip", loss=global_loss, message=message)
        self.history.append(global_loss)
        return StepVerdict(action="step", loss=global_loss)


def validate_before_launch(
    parallel: Any, module: Any, world_size: int, datamodule: Any, validate_model: Callable[[Any, Any], None]
) -> None:
    """Every check that needs only the layout, the world size, the model's and the data's config (on a copy: the
    launching process must not resolve the strategy's own config)."""
    parallel = copy.deepcopy(parallel).resolve(world_size)
    validate_model(parallel, module)
    seq_len = getattr(datamodule, "seq_len", None)
    cp = parallel.context_parallel_size
    if parallel.cp_enabled and isinstance(seq_len, int) and seq_len % (2 * cp):
        raise ValueError(
            f"{type(datamodule).__name__}(seq_len={seq_len}) is not divisible by 2 x context_parallel_size ="
            f" {2 * cp} (context parallelism cuts each sequence into 2 x cp chunks); use a seq_len that is a"
            f" multiple of {2 * cp}."
        )


def guard_step(strategy: Any, guard: StepGuard, params: list[Tensor], replicated_grads: bool = False) -> bool:
    """Apply ``guard``'s verdict for this optimizer step: True to step; else the gradients are dropped (and, for
    "rollback", weights and optimizer states reloaded from the newest complete checkpoint). Same on every rank."""
    trainer = strategy.lightning_module.trainer
    # Under a loss scaler non-finite gradients are overflows the scaler handles; only the loss is checked.
    checked = params if strategy.precision_plugin.scaler is None else []
    verdict = guard.decide(
        checked, trainer.global_step, trainer.accumulate_grad_batches, strategy.root_device,
        replicated_grads=replicated_grads,
    )  # fmt: skip
    if verdict.action == "step":
        return True
    for param in params:
        param.grad = None
    if verdict.action == "rollback":
        strategy.wait_for_checkpoint()
        path = strategy._last_checkpoint or (auto_resume_path(trainer) if trainer.checkpoint_callback else None)
        if path is None:
            raise FloatingPointError(f"{verdict.message} nan_policy='rollback' found no complete checkpoint.")
        rank_zero_warn(f"{verdict.message} Rolling weights and optimizer states back to {path}.")
        load_training_state(Path(path), strategy.model, strategy.optimizers, strategy._dist_opt, strict=True)
    else:
        rank_zero_warn(f"{verdict.message} Step skipped ({guard.skipped_steps} so far).")
    return False


class ResilienceHooks:
    """The strategy's launcher, watchdog and step guard. Mixed into ``FlagScaleStrategy``, which sets
    ``_resume``, ``_guard`` (a :class:`StepGuard`), ``_watchdog_timeout`` and ``_check_layout``."""

    _watchdog: Watchdog | None = None

    @override
    def _configure_launcher(self) -> None:
        # Also with externally created processes (torchrun, SLURM): the launcher validates and picks the checkpoint
        # of resume="auto" before `fit` starts, and spawns workers only when Lightning has to.
        assert self.cluster_environment is not None
        self._launcher = FlagScaleLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes, validate=self._validate_before_launch,
            resume=self._resume, spawn=not self.cluster_environment.creates_processes_externally,
        )  # fmt: skip

    def _validate_before_launch(self, datamodule: Any) -> None:
        """Run in the launching process before any worker exists (``setup_environment`` repeats the layout checks
        for launchers that bypass this one)."""
        world_size = self.num_nodes * self.num_processes
        # The job's layout: under hetero_meshes an earlier stage (`fit` before `validate`) left its rank's in `parallel`.
        job = self.hetero_parallel or self.parallel
        validate_before_launch(job, self.lightning_module, world_size, datamodule, self._check_layout)

    def _start_watchdog(self) -> None:
        if self._watchdog_timeout is None or self._watchdog is not None:
            return
        env = self.cluster_environment
        run_id = self.broadcast(uuid.uuid4().hex)  # a fresh key space in the store for this run
        self._watchdog = Watchdog(
            rank=self.global_rank, world_size=self.world_size, host=env.main_address, port=env.main_port,
            run_id=run_id, timeout=self._watchdog_timeout,
        )  # fmt: skip
        self._watchdog.start()

    def _mark(self, phase: str) -> None:
        if self._watchdog is not None:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            self._watchdog.mark(phase, trainer.global_step if trainer is not None else None)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._watchdog is not None and isinstance(exception, (RuntimeError, dist.DistBackendError)):
            print(f"[FlagScale watchdog, rank {self.global_rank}] after {type(exception).__name__} in"
                  f" {self._watchdog.phase!r}: {self._watchdog.diagnose()}", file=sys.stderr, flush=True)  # fmt: skip

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _apply_step_guard(self, params: list[Tensor], replicated_grads: bool = False) -> bool:
        """``nan_policy`` / ``skip_spiky_loss`` (see ``_resilience.guard_step``): True to step."""
        return guard_step(self, self._guard, params, replicated_grads)

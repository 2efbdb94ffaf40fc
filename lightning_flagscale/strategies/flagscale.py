"""``FlagScaleStrategy``: hybrid parallelism behind the unchanged Lightning ``Trainer`` and ``training_step``.

Hook order (Lightning's): ``setup_environment`` validates the layout against the world size and the model's config
before any process group exists, then creates the process group and the named meshes; ``configure_model`` runs on
the meta device; ``setup`` parallelises (TP -> CP -> EP -> ZeRO-3/FSDP2), materialises and initialises the weights,
applies precision, builds the optimizers and turns them into DDP/ZeRO-1/2 optimizers. ``optimizer_step`` runs the
closure, reduces gradients over data x context ranks, unscales/clips by the global norm, steps, and re-gathers.

Each parallelism lives in ``lightning_flagscale/parallel/``; this file only sequences them.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.checkpoint.recovery import clean_interrupted
from lightning_flagscale.checkpoint.sharded import PendingSave, read_meta, remove_checkpoint_path, save_sharded
from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models.protocol import find_protocol_model, validate_layout
from lightning_flagscale.parallel.data import DistributedOptimizer, clip_grad_norm_, reduction_groups
from lightning_flagscale.parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes, build_meshes
from lightning_flagscale.parallel.parallelize import RankLayout, parallelize
from lightning_flagscale.parallel.pipeline_model import PipelinedModel, deferred_zero_grad, exclude_tied_copy_from_norm
from lightning_flagscale.parallel.schedules import ScheduleName
from lightning_flagscale.precision.flagscale import FlagScalePrecision, as_flagscale_precision, check_precision_layout
from lightning_flagscale.strategies._checkpoint import (
    load_training_state,
    model_state,
    optimizer_state,
    restore_training_meta,
    training_meta,
)
from lightning_flagscale.strategies._data import distribute_loader
from lightning_flagscale.strategies._resilience import (
    FlagScaleLauncher,
    NanPolicy,
    StepGuard,
    guard_step,
    validate_before_launch,
)
from lightning_flagscale.strategies._tokens import NUM_ITEMS_KEY, batch_size_of, scale_loss, uses_global_token_loss
from lightning_flagscale.strategies._watchdog import Watchdog

__all__ = ["FlagScaleStrategy"]


class FlagScaleStrategy(ParallelStrategy):
    """Megatron/FlagScale-class hybrid parallelism for the Lightning ``Trainer``.

    Pass the parallel sizes as keyword arguments (the fields of :class:`~lightning_flagscale.config.ParallelConfig`)
    or a ready ``ParallelConfig`` as ``parallel``. ``data_parallel_size=None`` takes the remaining ranks.

    Resilience: ``resume="auto"`` resumes ``fit`` from the newest complete checkpoint of the ``ModelCheckpoint``
    folder; ``nan_policy`` ("raise" | "skip_step" | "rollback") handles non-finite losses/gradients and
    ``skip_spiky_loss`` (a relative rise, e.g. 0.2) skips loss spikes; ``watchdog_timeout`` (seconds, None: off)
    bounds how long a dead rank or a hung collective can stall the job (see ``_resilience.py``, ``_watchdog.py``).
    """

    strategy_name = "flagscale"

    def __init__(
        self,
        parallel: ParallelConfig | None = None,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        virtual_pipeline_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        context_parallel_mode: Literal["ring", "ulysses", "hybrid"] = "ring",
        ulysses_size: int | None = None,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        data_parallel_size: int | None = None,
        zero_stage: Literal[0, 1, 2, 3] = 0,
        sequence_parallel: bool = False,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        pipeline_schedule: ScheduleName = "1f1b",
        pipeline_layers: list[int] | None = None,
        pipeline_balance: Literal["even", "cost"] = "even",
        recompute: Literal["none", "selective", "full"] | list[Literal["none", "selective", "full"]] = "none",
        hetero_dp_batch_sizes: list[int] | None = None,
        hetero_meshes: list[dict[str, Any]] | None = None,
        hetero_layers: list[int] | None = None,
        hetero_device_speed: dict[str, float] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        overlap_grad_reduce: bool = True,
        async_checkpoint: bool = False,
        resume: Literal["auto"] | None = None,
        nan_policy: NanPolicy = "raise",
        skip_spiky_loss: float | None = None,
        watchdog_timeout: float | None = 600.0,
    ) -> None:
        super().__init__()
        if resume not in (None, "auto"):
            raise ValueError(f"resume={resume!r} is unknown; use 'auto' (newest complete checkpoint) or None.")
        if parallel is None:
            parallel = ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                virtual_pipeline_parallel_size=virtual_pipeline_parallel_size,
                context_parallel_size=context_parallel_size,
                context_parallel_mode=context_parallel_mode,
                ulysses_size=ulysses_size,
                expert_parallel_size=expert_parallel_size,
                expert_tensor_parallel_size=expert_tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                zero_stage=zero_stage,
                sequence_parallel=sequence_parallel,
                micro_batch_size=micro_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps,
                pipeline_schedule=pipeline_schedule,
                pipeline_layers=pipeline_layers,
                pipeline_balance=pipeline_balance,
                recompute=recompute,
                hetero_dp_batch_sizes=hetero_dp_batch_sizes,
                hetero_meshes=hetero_meshes,
                hetero_layers=hetero_layers,
                hetero_device_speed=hetero_device_speed,
            )
        self.parallel = parallel
        # Heterogeneous meshes: the user's layout; `parallel` becomes this rank's stage-group layout in setup.
        self.hetero_parallel: ParallelConfig | None = parallel if parallel.hetero_enabled else None
        self._hetero_groups: list | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._grad_bucket_numel = grad_bucket_numel
        self._overlap_grad_reduce = overlap_grad_reduce  # issue 15: DDP/ZeRO-1/2 buckets reduced during backward
        self._async_checkpoint = async_checkpoint
        self._resume = resume
        self._guard = StepGuard(nan_policy, skip_spiky_loss)
        self._last_checkpoint: Path | None = None  # newest complete checkpoint this run wrote (rollback target)
        if watchdog_timeout is not None and watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout={watchdog_timeout} must be > 0 seconds, or None to disable it.")
        self._watchdog_timeout = watchdog_timeout
        self._watchdog: Watchdog | None = None
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._pending_save: PendingSave | None = None
        self._meshes: ParallelMeshes | None = None
        self._dist_optimizers: dict[int, DistributedOptimizer] = {}
        self._fsdp_roots: list[nn.Module] = []
        self._pipeline: PipelinedModel | None = None
        self._batch_model: nn.Module | None = None
        self._pp_zero_grad_pending = True
        self._moe_layers: list[nn.Module] = []
        self._expert_grad_scale = 1.0
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties
    @property
    def meshes(self) -> ParallelMeshes:
        if self._meshes is None:
            raise RuntimeError("The meshes exist only after `setup_environment` (inside `Trainer.fit/validate`).")
        return self._meshes

    @property
    def device_mesh(self):
        return self.meshes.world

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning to inject a DistributedSampler built from ``distributed_sampler_kwargs``."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only data-parallel replicas see different samples; TP/CP/PP ranks of one replica share a batch.
        return {"num_replicas": self.meshes.size(MeshDim.DP), "rank": self.meshes.local_rank(MeshDim.DP)}

    def global_tokens(self, local_tokens: int) -> int:
        """Tokens of the whole step given this rank's share (for tokens/s): data x context ranks hold disjoint
        tokens, in equal shares or in ``hetero_dp_batch_sizes`` proportions."""
        cp = self.meshes.size(MeshDim.CP)
        shares = self.parallel.hetero_dp_batch_sizes
        if shares is not None:
            return local_tokens * cp * sum(shares) // shares[self.meshes.local_rank(MeshDim.DP)]
        return local_tokens * cp * self.meshes.size(MeshDim.DP)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    @override
    def precision_plugin(self) -> FlagScalePrecision:
        plugin = self._precision_plugin if self._precision_plugin is not None else FlagScalePrecision()
        if not isinstance(plugin, FlagScalePrecision):
            plugin = as_flagscale_precision(plugin)
            self._precision_plugin = plugin
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = None if precision_plugin is None else as_flagscale_precision(precision_plugin)

    # ------------------------------------------------------------------ environment
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
        validate_before_launch(self.parallel, self.lightning_module, world_size, datamodule, self._check_layout)

    def _check_layout(self, parallel: ParallelConfig, module: Any) -> None:
        validate_layout(parallel, module)
        check_precision_layout(self.precision_plugin.precision, parallel)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        # Validate before any process group exists: a wrong layout fails in milliseconds, not after a rendezvous.
        self.parallel.resolve(self.world_size)
        self._check_layout(self.parallel, self.lightning_module)
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        if self.hetero_parallel is not None:
            self._build_hetero_meshes()
        else:
            self._meshes = build_meshes(self.parallel, self.root_device.type)
        if self._async_checkpoint:
            # The background writer's collectives get their own group, never interleaved with training's.
            self._checkpoint_group = dist.new_group(backend="gloo")
        self.lightning_module._device_mesh = self._meshes.world
        self._start_watchdog()

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

    def _build_hetero_meshes(self) -> None:
        """Every stage group's meshes; this rank keeps its group's meshes and its group's layout as ``parallel``."""
        from lightning_flagscale.parallel.hetero_mesh import build_hetero_layout

        num_layers = getattr(getattr(self.lightning_module, "config", None), "num_layers", None)
        if num_layers is None:
            raise ValueError("hetero_meshes needs the module's `config.num_layers` to split the blocks over meshes.")
        self._hetero_groups, self._meshes, self.parallel = build_hetero_layout(
            self.hetero_parallel, num_layers, self.root_device.type
        )

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `configure_model` builds on the meta device; `setup` materialises after parallelising.
        with torch.device("meta") if empty_init is not False else nullcontext():
            yield

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None
        self.accelerator.setup(trainer)
        p = self.parallel
        if p.gradient_accumulation_steps > 1:
            if trainer.accumulate_grad_batches not in (1, p.gradient_accumulation_steps):
                raise ValueError(
                    f"gradient_accumulation_steps={p.gradient_accumulation_steps} conflicts with"
                    f" Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); set only one of them."
                )
            trainer.accumulate_grad_batches = p.gradient_accumulation_steps
        module = self.lightning_module
        inner = find_protocol_model(module)
        self._batch_model = inner  # kept for its batch hooks: under PP, module.model becomes the PipelinedModel
        precision = self.precision_plugin
        # Autocast + fp32 weights for any module, Megatron's half-precision layout for modules that declare it.
        precision.select_layout(module, self.root_device.type)
        layout = RankLayout(
            config=p, meshes=self.meshes, device=self.root_device, hetero_groups=self._hetero_groups,
            param_dtype=None if precision.param_dtype == torch.float32 else precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
        )  # fmt: skip
        result = parallelize(module, inner, layout)
        self._pipeline = result.pipeline
        self._fsdp_roots = result.fsdp_roots
        self._expert_grad_scale = result.expert_grad_scale
        if p.zero_stage < 3:
            self.model = precision.convert_module(self.model)
        self.model_to_device()
        # Tags live on Parameter objects, which materialising and dtype/device moves may replace: set them last.
        if self._pipeline is not None:
            exclude_tied_copy_from_norm(self._pipeline)
        if p.ep_enabled:
            from lightning_flagscale.parallel.expert import tag_expert_params

            tag_expert_params(module.model if self._pipeline is not None else inner)
        precision.grad_norm_fn = partial(
            clip_grad_norm_, pp_size=p.pipeline_parallel_size,
            stage_ranks=self.meshes.size(MeshDim.STAGE) if self._hetero_groups is not None else None,
        )  # fmt: skip
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        from lightning_flagscale.moe.balance import moe_layers

        self._moe_layers = [layer for _, layer in moe_layers(module)]

    @override
    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for dopt in self._dist_optimizers.values():
            dopt.close()  # issue 15: the old optimizers' gradient hooks
        self._dist_optimizers = {}
        if self._pipeline is not None:
            for opt in self.optimizers:
                # Lightning zeroes grads between training_step and backward; under PP that would wipe the
                # schedule's gradients. Keep the real zero_grad for `training_step` to call at the right time.
                opt._flagscale_zero_grad = opt.zero_grad
                opt.zero_grad = deferred_zero_grad
        if self.parallel.zero_stage == 3:
            return
        groups, divisors = reduction_groups(self.meshes, self.parallel)
        for opt in self.optimizers:
            self._dist_optimizers[id(opt)] = DistributedOptimizer(
                opt,
                self.lightning_module,
                groups,
                stage=self.parallel.zero_stage,
                master_weights=self.precision_plugin.master_weights,
                bucket_numel=self._grad_bucket_numel,
                divisors=divisors,
                # issue 15: under PP the schedule's weight-gradient passes may bypass autograd's accumulation (and
                # tied embeddings are summed across stages first): buckets are filled and reduced at the step.
                overlap=self._overlap_grad_reduce,
                hooks=self._pipeline is None,
            )

    def _expert_params(self) -> list[nn.Parameter]:
        return [param for layer in self._moe_layers for param in layer.experts.parameters()]

    def _dist_opt(self, optimizer) -> DistributedOptimizer | None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._dist_optimizers.get(id(optimizer))

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Data layouts our parallelism needs, then the step's token count on training loaders (``_data.py``)."""
        module = self.lightning_module
        return distribute_loader(
            dataloader, training=module.trainer.training, parallel=self.parallel, meshes=self.meshes,
            hetero_groups=self._hetero_groups, accumulate=module.trainer.accumulate_grad_batches,
            count_tokens=uses_global_token_loss(module),
        )  # fmt: skip

    # ------------------------------------------------------------------ step
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        self._mark("training_step: forward/backward (TP/SP, CP, EP, pipeline collectives)")
        args = self._shard_for_cp(args)
        scaler = self.precision_plugin.scaler
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        loss_scale = scaler.scale if scaler is not None else 1.0
        # Aux-loss gradients are attached inside the layers: a mean over accumulation steps and, under PP, over the
        # schedule's micro-batches (their gradients are summed, not averaged), times the loss scale.
        micro = self._pipeline.runner.count_microbatches(batch_size_of(args)) if self._pipeline is not None else 1
        for layer in self._moe_layers:
            layer.aux_loss_scale = loss_scale / (accumulate * micro)
        # The module's loss is this rank's share of the step's token mean (see _tokens.py): the gradient reduction
        # averages over the data x context ranks and Lightning divides by the accumulation count; undo both.
        normalised = bool(args) and isinstance(args[0], Mapping) and NUM_ITEMS_KEY in args[0]
        token_factor = self.meshes.size(MeshDim.DP_CP) * accumulate if normalised else 1
        if self._pipeline is not None:
            if self._pp_zero_grad_pending:
                # Under PP the schedule runs backward inside training_step, before the point where Lightning's loop
                # zeroes gradients; the zeroing happens here instead, at the start of each accumulation window.
                for opt in self.optimizers:
                    opt._flagscale_zero_grad(set_to_none=True)
                for param in self.lightning_module.parameters():
                    param.grad = None
                self._pp_zero_grad_pending = False
            # The schedule backpropagates each micro-batch itself: Lightning's division by the accumulation count
            # never reaches it, so only the data x context factor (or, for a per-micro-batch mean, 1 / A) applies.
            self._pipeline.grad_scale = loss_scale * (token_factor / accumulate if normalised else 1 / accumulate)
        output = super().training_step(*args, **kwargs)
        output = scale_loss(output, token_factor) if token_factor != 1 else output
        self._guard.observe(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        self._mark("validation_step: forward (TP/SP, CP, EP, pipeline collectives)")
        args = self._shard_for_cp(args)
        return super().validation_step(*args, **kwargs)

    def _shard_for_cp(self, args: tuple) -> tuple:
        if not self.parallel.cp_enabled or not args or not isinstance(args[0], Mapping):
            return args
        from lightning_flagscale.parallel.context import shard_batch_for_cp

        # The model protocol's batch hooks (models/protocol.py): per-token tensors computed on the full sequence.
        prepare = getattr(self._batch_model, "prepare_batch", None)
        batch = prepare(dict(args[0])) if prepare is not None else dict(args[0])
        keys = tuple(getattr(self._batch_model, "cp_sequence_keys", ()))
        return (shard_batch_for_cp(batch, self.meshes["cp"], sequence_keys=keys), *args[1:])

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # ZeRO-2 reduce-scatters after every backward and frees the full gradients; stages 0/1 reduce once per step
        # (as does ZeRO-2 under PP: tied-embedding gradients are summed across stages first, in optimizer_step).
        if self.parallel.zero_stage == 2 and self._pipeline is None:
            for dopt in self._dist_optimizers.values():
                dopt.reduce_grads()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this around every micro-step of an accumulation window but the last one.
        for root in self._fsdp_roots:
            root.set_requires_gradient_sync(False)
        for dopt in self._dist_optimizers.values():
            dopt.require_sync = False  # issue 15: stages 0-1 accumulate into their buckets without reducing
        try:
            yield
        finally:
            for root in self._fsdp_roots:
                root.set_requires_gradient_sync(True)
            for dopt in self._dist_optimizers.values():
                dopt.require_sync = True

    @override
    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None or not self.lightning_module.training:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule already ran forward and backward of every micro-batch inside `loss_fn`; only the
        # hooks remain (on_before_backward / on_after_backward), so callbacks see the usual sequence.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        self.precision_plugin.pre_backward(closure_loss.detach(), module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        precision = self.precision_plugin
        closure_result = closure()
        if self._expert_grad_scale != 1.0:
            for param in self._expert_params():
                if param.grad is not None:
                    param.grad.mul_(self._expert_grad_scale)
        if self._pipeline is not None:
            self._pipeline.runner.sync_tied_grads()
        dopt = self._dist_opt(opt)
        self._mark("optimizer_step: gradient all-reduce/reduce-scatter over data x context ranks")
        if dopt is not None and (self.parallel.zero_stage < 2 or self._pipeline is not None):
            dopt.reduce_grads()
        params = [q for g in opt.param_groups for q in g["params"]]
        self._mark("optimizer_step: non-finite check (all_gather), global grad norm (all_reduce), step")
        if self._apply_step_guard(params):
            skip = precision.unscale_and_check(params)
            precision._after_closure(model, opt)  # on_before_optimizer_step hooks, then clipping by the global norm
            if not skip:
                opt.step(**kwargs)
            elif precision.scaler is not None:
                rank_zero_warn(
                    f"Step {self.lightning_module.trainer.global_step}: gradient overflow under {precision.precision};"
                    f" step skipped, loss scale lowered to {precision.scaler.scale:g}"
                    f" ({precision.scaler.skipped_steps} skipped so far)."
                )
        if dopt is not None:
            self._mark("optimizer_step: ZeRO parameter all-gather")
            dopt.sync_params()
        self._pp_zero_grad_pending = True
        self._mark("between steps: data loading, callbacks, logging (sync_dist all-reduce)")
        return closure_result

    def _apply_step_guard(self, params: list[Tensor]) -> bool:
        """``nan_policy`` / ``skip_spiky_loss`` (see ``_resilience.guard_step``): True to step."""
        return guard_step(self, self._guard, params)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"):
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        self.wait_for_checkpoint()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state(self.model, self._dist_optimizers.values())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return optimizer_state(self.model, opt, self._dist_opt(opt))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FlagScaleStrategy.save_checkpoint does not take storage_options (it writes DCP folders).")
        self._mark("save_checkpoint: DCP write, all_gather_object, barriers")
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        checkpoint.update(training_meta(self.lightning_module, self.optimizers, self.world_size))
        checkpoint["parallel_config"] = vars(self.parallel).copy()
        self.wait_for_checkpoint()  # one save in flight at a time
        self._pending_save = save_sharded(path, state, checkpoint, async_group=self._checkpoint_group)
        if self._pending_save is None:
            self._last_checkpoint = path

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight is complete (renamed into place)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            self._last_checkpoint = pending.wait()

    @override
    def remove_checkpoint(self, filepath) -> None:
        # Retention (save_top_k, last) asks right after `save_checkpoint` returns: with an asynchronous save still
        # in flight the old checkpoint is deleted only once the new one is complete (never if it fails).
        if not self.is_global_zero:
            return
        if self._pending_save is not None:
            self._pending_save.remove_after(filepath)
        else:
            remove_checkpoint_path(filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        self._mark("load_checkpoint: DCP read, barriers")
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            clean_interrupted(path.parent)  # saves a crash interrupted: removed (or restored) with a warning
        self.barrier()
        meta = read_meta(path)
        strict = getattr(self.lightning_module, "strict_loading", True)
        load_training_state(path, self.model, self.optimizers, self._dist_opt, strict=strict)
        restore_training_meta(meta, self.lightning_module, self.optimizers, self.global_rank, self.world_size)
        meta.pop("parallel_config", None)
        return meta

"""``FlagScaleStrategy``: hybrid parallelism behind the unchanged Lightning ``Trainer`` and ``training_step``.

Hook order (Lightning's): ``setup_environment`` validates the layout against the world size and the model's config
before any process group exists, then creates the process group and the named meshes; ``configure_model`` runs on
the meta device; ``setup`` hands the model and this rank's layout to ``parallel.parallelize`` (PP split -> TP -> CP
-> EP -> recompute -> ZeRO-3 -> materialise), applies precision, builds the optimizers and turns them into
DDP/ZeRO-1/2 optimizers. ``optimizer_step`` runs the closure, reduces gradients over data x context ranks,
unscales/clips by the global norm, steps, and re-gathers.

Each parallelism lives in ``lightning_flagscale/parallel/``; this file only sequences them. Checkpoint hooks are in
``_checkpoint.py``, the launcher / watchdog / step guard in ``_resilience.py``, data loaders in ``_data.py`` and the
token-mean loss in ``_tokens.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
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
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.config import ParallelConfig, RecomputeMode
from lightning_flagscale.config.schedules import ScheduleName
from lightning_flagscale.models.protocol import find_protocol_model, validate_layout
from lightning_flagscale.moe.balance import moe_layers
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.data_parallel.optimizer import (
    DistributedOptimizer,
    clip_grad_norm_,
    distributed_optimizers,
)
from lightning_flagscale.parallel.data_parallel.zero3_flat_state import flat_zero3_optimizers
from lightning_flagscale.parallel.hetero_dp.shares import gather_dp_speeds
from lightning_flagscale.parallel.hetero_mesh.build import build_hetero_layout
from lightning_flagscale.parallel.hetero_mesh.profile import apply_profiled_split
from lightning_flagscale.parallel.hetero_mesh.ranks import (
    gather_rank_order,
    install_emulated_slowdown,
    rank_device_type,
)
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes, build_meshes
from lightning_flagscale.parallel.pipeline_parallel.model import (
    PipelinedModel,
    defer_zero_grad,
    zero_grad_now,
)
from lightning_flagscale.parallel.plan import RankLayout, parallelize
from lightning_flagscale.precision.flagscale import FlagScalePrecision, as_flagscale_precision, check_precision_layout
from lightning_flagscale.strategies._checkpoint import CheckpointHooks
from lightning_flagscale.strategies._data import distribute_loader, shard_for_cp
from lightning_flagscale.strategies._resilience import NanPolicy, ResilienceHooks, StepGuard
from lightning_flagscale.strategies._tokens import (
    apply_accumulation,
    batch_size_of,
    global_tokens,
    resolve_token_count,
    scale_loss,
    step_scales,
    uses_global_token_loss,
)

__all__ = ["FlagScaleStrategy"]


class FlagScaleStrategy(CheckpointHooks, ResilienceHooks, ParallelStrategy):
    """Megatron/FlagScale-class hybrid parallelism for the Lightning ``Trainer``.

    Pass the parallel sizes as keyword arguments (the fields of :class:`~lightning_flagscale.config.ParallelConfig`)
    or a ready ``ParallelConfig`` as ``parallel``. ``data_parallel_size=None`` takes the remaining ranks.

    Resilience: ``resume="auto"`` resumes ``fit`` from the newest complete checkpoint of the ``ModelCheckpoint``
    folder; ``nan_policy`` ("raise" | "skip_step" | "rollback") handles non-finite losses/gradients and
    ``skip_spiky_loss`` (a relative rise, e.g. 0.2) skips loss spikes; ``watchdog_timeout`` (seconds, None: off)
    bounds how long a dead rank or a hung collective can stall the job (see ``_resilience.py``, ``_watchdog.py``).

    Gradient reduction (DDP, ZeRO-1/2): ``grad_bucket_numel`` elements per bucket, reduced while backward runs
    (``overlap_grad_reduce``). ``overlap_param_gather=True`` (ZeRO-1/2) leaves the all-gather of the updated weights
    in flight after the optimizer step; each module waits for its parameters before its next forward, and
    ``state_dict()`` and :meth:`wait_params` wait for all of them (Megatron's ``overlap_param_gather``).
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
        zero3_impl: Literal["auto", "fsdp2", "flat"] = "auto",
        sequence_parallel: bool = False,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        pipeline_schedule: ScheduleName = "1f1b",
        pipeline_layers: list[int] | None = None,
        pipeline_balance: Literal["even", "cost"] = "even",
        recompute: RecomputeMode | list[RecomputeMode] = "none",
        hetero_dp_batch_sizes: list[int] | Literal["auto"] | None = None,
        hetero_meshes: list[dict[str, Any]] | None = None,
        hetero_layers: list[int] | None = None,
        hetero_device_speed: dict[str, float] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = False,
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
            # The explicit keywords above are ParallelConfig's fields (LightningCLI reads this signature; a test keeps
            # the two equal): pass them through by name.
            given = locals()
            parallel = ParallelConfig(**{f.name: given[f.name] for f in dataclasses.fields(ParallelConfig)})
        if overlap_param_gather and parallel.zero_stage not in (1, 2):
            raise ValueError(
                f"overlap_param_gather=True overlaps ZeRO-1/2's parameter all-gather with the next forward, but"
                f" zero_stage={parallel.zero_stage} has none to overlap (stage 0 keeps whole weights, ZeRO-3"
                " prefetches its own); set zero_stage=1 or 2, or drop overlap_param_gather."
            )
        self.parallel = parallel
        # Heterogeneous meshes: the user's layout; `parallel` becomes this rank's stage-group layout in setup.
        self.hetero_parallel: ParallelConfig | None = parallel if parallel.hetero_enabled else None
        self._hetero_groups: list | None = None
        self._accumulating = False  # inside block_backward_sync: a micro-step before the window's last
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._grad_bucket_numel = grad_bucket_numel
        self._overlap_grad_reduce = overlap_grad_reduce  # issue 15: DDP/ZeRO-1/2 buckets reduced during backward
        self._overlap_param_gather = overlap_param_gather  # ZeRO-1/2: parameter all-gather under the next forward
        self._async_checkpoint = async_checkpoint
        self._resume = resume
        self._guard = StepGuard(nan_policy, skip_spiky_loss)
        if watchdog_timeout is not None and watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout={watchdog_timeout} must be > 0 seconds, or None to disable it.")
        self._watchdog_timeout = watchdog_timeout
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
        """Tokens of the whole step given this rank's share (for tokens/s)."""
        return global_tokens(local_tokens, self.parallel, self.meshes)

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

    def _build_hetero_meshes(self) -> None:
        """Every stage group's meshes; this rank keeps its group's meshes and its group's layout as ``parallel``."""
        num_layers = getattr(getattr(self.lightning_module, "config", None), "num_layers", None)
        if num_layers is None:
            raise ValueError("hetero_meshes needs the module's `config.num_layers` to split the blocks over meshes.")
        order = gather_rank_order(self.hetero_parallel.hetero_meshes, self.root_device)  # ranks by device type
        self._hetero_groups, self._meshes, self.parallel = build_hetero_layout(
            self.hetero_parallel, num_layers, self.root_device.type, order
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
        apply_accumulation(p, trainer)
        module = self.lightning_module
        inner = find_protocol_model(module)
        self._batch_model = inner  # kept for its batch hooks: under PP, module.model becomes the PipelinedModel
        precision = self.precision_plugin
        # Autocast + fp32 weights for any module, Megatron's half-precision layout for modules that declare it.
        precision.select_layout(module, self.root_device.type)
        if self._hetero_groups is not None:  # hetero_layers=None: the split of a profiling pass on these ranks
            self._hetero_groups = apply_profiled_split(
                self.hetero_parallel, self._hetero_groups, inner, self.root_device
            )
        self._dp_speeds = gather_dp_speeds(p, self.meshes, inner, self.root_device)  # hetero_dp_batch_sizes="auto"
        layout = RankLayout(
            config=p, meshes=self.meshes, device=self.root_device, hetero_groups=self._hetero_groups,
            param_dtype=None if precision.param_dtype == torch.float32 else precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
        )  # fmt: skip
        result = parallelize(module, inner, layout)
        stages = getattr(result.pipeline, "stage_modules", None) or [inner]
        install_emulated_slowdown(stages, rank_device_type(self._hetero_groups), self.root_device)
        self._pipeline = result.pipeline
        self._fsdp_roots = result.fsdp_roots
        self._expert_grad_scale = result.expert_grad_scale
        if p.zero_stage < 3:
            self.model = precision.convert_module(self.model)
        self.model_to_device()
        result.tag_parameters(module.model if self._pipeline is not None else inner, p.ep_enabled)
        precision.grad_norm_fn = partial(
            clip_grad_norm_, pp_size=p.pipeline_parallel_size,
            stage_ranks=self.meshes.size(MeshDim.STAGE) if self._hetero_groups is not None else None,
        )  # fmt: skip
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

        self._moe_layers = [layer for _, layer in moe_layers(module)]

    @override
    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for dopt in self._dist_optimizers.values():
            dopt.close()  # the old optimizers' gradient hooks
        self._dist_optimizers = {}
        if self._pipeline is not None:
            defer_zero_grad(self.optimizers)
        if self.parallel.zero_stage == 3:  # flat ZeRO-3's checkpoint/step interface; FSDP2 needs none
            self._dist_optimizers = flat_zero3_optimizers(self.optimizers, self.lightning_module)
            return
        self._dist_optimizers = distributed_optimizers(
            self.optimizers, self.lightning_module, self.meshes, self.parallel,
            master_weights=self.precision_plugin.master_weights, bucket_numel=self._grad_bucket_numel,
            # Under PP the schedule's weight-gradient passes may bypass autograd's accumulation (and tied embeddings
            # are summed across stages first): buckets are filled and reduced at the step, not by hooks.
            overlap=self._overlap_grad_reduce, hooks=self._pipeline is None,
            overlap_param_gather=self._overlap_param_gather,
        )  # fmt: skip

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
            count_tokens=uses_global_token_loss(module), dp_speeds=self._dp_speeds,
        )  # fmt: skip

    # ------------------------------------------------------------------ step
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # The window's label count, all-reduced while the step before ran (Lightning fetches a batch ahead): an int
        # again before any hook of this step sees the batch.
        resolve_token_count(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        self._mark("training_step: forward/backward (TP/SP, CP, EP, pipeline collectives)")
        args = self._shard_for_cp(args)
        scaler = self.precision_plugin.scaler
        scales = step_scales(
            args, dp_cp=self.meshes.size(MeshDim.DP_CP), accumulate=self.lightning_module.trainer.accumulate_grad_batches,
            loss_scale=scaler.scale if scaler is not None else 1.0,
            microbatches=self._pipeline.runner.count_microbatches(batch_size_of(args)) if self._pipeline else 1,
        )  # fmt: skip
        for layer in self._moe_layers:
            layer.aux_loss_scale = scales.aux_loss_scale
        if self._pipeline is not None:
            if self._pp_zero_grad_pending:  # the schedule runs backward here, before Lightning's loop zeroes
                zero_grad_now(self.optimizers, self.lightning_module)
                self._pp_zero_grad_pending = False
            self._pipeline.grad_scale = scales.pipeline_grad_scale
        output = super().training_step(*args, **kwargs)
        output = scale_loss(output, scales.loss_factor) if scales.loss_factor != 1 else output
        self._guard.observe(output)
        module = self.lightning_module
        if module.automatic_optimization and not self._accumulating:  # the window's last loss: exchange it under
            self._guard.launch(module.trainer.accumulate_grad_batches, self.root_device)  # its backward
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        self._mark("validation_step: forward (TP/SP, CP, EP, pipeline collectives)")
        args = self._shard_for_cp(args)
        return super().validation_step(*args, **kwargs)

    def _shard_for_cp(self, args: tuple) -> tuple:
        return shard_for_cp(args, self._batch_model, self.meshes["cp"]) if self.parallel.cp_enabled else args

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
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
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
        self._mark("optimizer_step: loss exchange wait, non-finite check, global grad norm (all_reduce), step")
        if self._apply_step_guard(params, replicated_grads=dopt is not None and self._grads_replicated()):
            skip = precision.unscale_and_check(params, self.lightning_module.trainer.global_step)
            precision._after_closure(model, opt)  # on_before_optimizer_step hooks, then clipping by the global norm
            if not skip:
                opt.step(**kwargs)
        if dopt is not None:
            self._mark("optimizer_step: ZeRO parameter all-gather")
            dopt.sync_params(wait=False)  # completed by the next forward under overlap_param_gather
        self._pp_zero_grad_pending = True
        self._mark("between steps: data loading, callbacks, logging (sync_dist all-reduce)")
        return closure_result

    def _grads_replicated(self) -> bool:
        """Whether the reduced gradients are the same on every rank of the world: stage 0 buckets all-reduced over
        data x context ranks that are the whole world (no TP, PP or EP shards, one mesh)."""
        return (
            self.parallel.zero_stage == 0 and self._hetero_groups is None
            and self.parallel.expert_parallel_size == 1 and self.meshes.size(MeshDim.DP_CP) == self.world_size
        )  # fmt: skip

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

    def wait_params(self) -> None:
        """Complete the ZeRO parameter all-gathers still in flight (``overlap_param_gather``): after this the model's
        parameters hold the last step's weights. Forward and ``state_dict()`` do it themselves; call it before reading
        ``module.parameters()`` by other means between an optimizer step and the next forward."""
        for dopt in self._dist_optimizers.values():
            dopt.wait_params()

    @override
    def teardown(self) -> None:
        self.wait_params()
        self.wait_for_checkpoint()
        self._stop_watchdog()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

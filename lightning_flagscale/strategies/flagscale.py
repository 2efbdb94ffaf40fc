"""``FlagScaleStrategy``: hybrid parallelism behind the unchanged Lightning ``Trainer`` and ``training_step``.

This file only sequences Lightning's hooks (its own order): ``setup_environment`` validates the layout against the
world size and the model before any process group exists, then creates the process group and this rank's meshes
(``parallel.plan.build_rank_meshes``); ``configure_model`` runs on the meta device; ``setup`` makes one call into the
plan (``parallel.plan.parallelize_rank``: profiled split, speeds, PP -> TP -> CP -> EP -> recompute -> ZeRO-3 ->
materialise, tags), then builds the optimizers and their DDP/ZeRO wrappers (``parallel.step``). ``optimizer_step``
runs the closure, reduces gradients over data x context ranks, unscales/clips by the global norm, steps, re-gathers.

Elsewhere: checkpoint hooks in ``_checkpoint.py``, launcher / watchdog / step guard in ``_resilience.py``, devices,
precision plugin and world collectives in ``_plumbing.py``, data loaders in ``_data.py``, the token-mean loss in
``_tokens.py``, and the keyword list (``ParallelConfig``'s fields) in ``_signature.py``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models.protocol import validate_layout
from lightning_flagscale.moe.balance import moe_layers
from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer, clip_grad_norm_
from lightning_flagscale.parallel.hetero_mesh.ranks import emulated_cost, emulated_slowdown
from lightning_flagscale.parallel.mesh import MeshDim
from lightning_flagscale.parallel.pipeline_parallel.model import (
    PipelinedModel,
    apply_hetero_shares,
    defer_zero_grad,
    zero_grad_now,
)
from lightning_flagscale.parallel.plan import (
    RankLayout,
    check_parallelized_layout,
    check_predict_layout,
    parallelize_rank,
)
from lightning_flagscale.parallel.step import (
    build_optimizers,
    grads_replicated,
    move_zero_buffers,
    no_grad_sync,
    prepare_step_grads,
    reduces_after_backward,
)
from lightning_flagscale.precision.flagscale import check_precision_layout
from lightning_flagscale.precision.fp32_weights import (
    gather_masters,
    keep_fp32_weights,
    masters_from_kept,
    restore_fp32_weights,
)
from lightning_flagscale.strategies._checkpoint import CheckpointHooks
from lightning_flagscale.strategies._data import distribute_loader, shard_for_cp
from lightning_flagscale.strategies._plumbing import (
    PlumbingHooks,
    live_groups,
    recording_new_groups,
    release_groups_of_other_modules,
    retire_groups,
    shared_rank_meshes,
)
from lightning_flagscale.strategies._resilience import NanPolicy, ResilienceHooks, StepGuard
from lightning_flagscale.strategies._signature import check_options, with_config_keywords
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


class FlagScaleStrategy(CheckpointHooks, ResilienceHooks, PlumbingHooks, ParallelStrategy):
    """Megatron/FlagScale-class hybrid parallelism for the Lightning ``Trainer``.

    Pass the parallel layout as keyword arguments (the fields of :class:`~lightning_flagscale.config.ParallelConfig`,
    shown in this signature) or a ready ``ParallelConfig`` as ``parallel``. ``data_parallel_size=None`` takes the
    remaining ranks.

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

    @with_config_keywords(ParallelConfig, after="parallel")
    def __init__(
        self,
        parallel: ParallelConfig | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        async_checkpoint: bool = False,
        resume: Literal["auto"] | None = None,
        nan_policy: NanPolicy = "raise",
        skip_spiky_loss: float | None = None,
        watchdog_timeout: float | None = 600.0,
        **layout: Any,
    ) -> None:
        super().__init__()
        if parallel is None:
            parallel = ParallelConfig(**layout)  # the layout keywords are ParallelConfig's fields (_signature.py)
        parallel.check_user_layout()
        check_options(resume, watchdog_timeout)
        # CPU emulation of slow devices (parallel/hetero_mesh/ranks.py): a malformed setting fails here, before the
        # ranks start, instead of in every rank when the hooks are installed.
        emulated_slowdown(None)
        emulated_cost()
        self.parallel = parallel
        # Heterogeneous meshes: the user's layout; `parallel` becomes this rank's stage-group layout in setup.
        self.hetero_parallel: ParallelConfig | None = parallel if parallel.hetero_enabled else None
        self._hetero_groups: list | None = None
        self._accumulating = False  # inside block_backward_sync: a micro-step before the window's last
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._async_checkpoint = async_checkpoint
        self._resume = resume
        self._guard = StepGuard(nan_policy, skip_spiky_loss)
        self._watchdog_timeout = watchdog_timeout
        self._meshes = None
        self._dist_optimizers: dict[int, DistributedOptimizer] = {}
        self._fsdp_roots: list[nn.Module] = []
        self._pipeline: PipelinedModel | None = None
        self._batch_model: nn.Module | None = None
        self._dp_speeds: list[float] | None = None
        self._pp_zero_grad_pending = True
        self._moe_layers: list[nn.Module] = []
        self._expert_grad_scale = 1.0
        self._created_groups: list[dist.ProcessGroup] = []  # this run's, handed to `retire_groups` in teardown
        self._offloaded = False  # teardown moved module and optimizer state from an accelerator to the CPU
        # Megatron's half layout: the module's fp32 tensors the stage's cast replaced, and whether the optimizers'
        # masters are this stage's (precision/fp32_weights.py: teardown gives the module back in fp32)
        self._kept_fp32: dict[str, Tensor] | None = None
        self._masters_current = False
        self.num_nodes = 1

    def global_tokens(self, local_tokens: int) -> int:
        """Tokens of the whole step given this rank's share (for tokens/s)."""
        return global_tokens(local_tokens, self.parallel, self.meshes)

    # ------------------------------------------------------------------ environment
    def _check_layout(self, parallel: ParallelConfig, module: Any) -> None:
        # A module an earlier stage parallelised (`validate` after `fit`) is reused with the same layout, refused with
        # another; its model (under PP the pipeline) was checked against this layout then.
        if check_parallelized_layout(module, parallel) is None:
            validate_layout(parallel, module)
        check_precision_layout(self.precision_plugin.precision, parallel)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        # Validate before any process group exists: a wrong layout fails in milliseconds, not after a rendezvous.
        # The job's layout: under hetero_meshes an earlier stage left this rank's group's layout in `parallel`.
        job = self.hetero_parallel or self.parallel
        job.resolve(self.world_size)
        self._check_layout(job, self.lightning_module)
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        release_groups_of_other_modules(self.lightning_module)  # earlier runs' groups (_plumbing.py says why here)
        if self._checkpoint_group is not None and self._checkpoint_group not in live_groups():
            self._checkpoint_group = None  # this strategy's earlier run on another module: destroyed just now
        # Heterogeneous meshes: this rank keeps its stage group's meshes and its group's layout as `parallel`.
        self.parallel, self._meshes, self._hetero_groups = shared_rank_meshes(
            self.hetero_parallel or self.parallel, self.lightning_module, self.root_device
        )
        if self._async_checkpoint:
            with recording_new_groups(self._created_groups):
                # The background writer's collectives get their own group, never interleaved with training's.
                self._checkpoint_group = dist.new_group(backend="gloo")
        self.lightning_module._device_mesh = self._meshes.world
        self._start_watchdog()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None
        if trainer.state.fn == TrainerFn.PREDICTING:
            check_predict_layout(self.hetero_parallel or self.parallel)
        self.accelerator.setup(trainer)
        self._offloaded = False  # `_place` moves the module to the device again (`validate` after `fit`)
        self._kept_fp32, self._masters_current = None, False
        p = self.parallel
        apply_accumulation(p, trainer)
        module = self.lightning_module
        precision = self.precision_plugin
        # Autocast + fp32 weights for any module, Megatron's half-precision layout for modules that declare it.
        precision.select_layout(module, self.root_device.type)
        layout = RankLayout(
            config=p, meshes=self.meshes, device=self.root_device, hetero_groups=self._hetero_groups,
            param_dtype=None if precision.param_dtype == torch.float32 else precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
        )  # fmt: skip
        with recording_new_groups(self._created_groups):
            result = parallelize_rank(module, layout, hetero=self.hetero_parallel, place=self._place)
        self._hetero_groups, self._dp_speeds = result.hetero_groups, result.dp_speeds
        self._pipeline, self._fsdp_roots = result.pipeline, result.fsdp_roots
        self._batch_model = result.model  # its batch hooks: under PP module.model became the pipeline
        self._expert_grad_scale = result.expert_grad_scale
        precision.grad_norm_fn = partial(
            clip_grad_norm_, pp_size=p.pipeline_parallel_size,
            stage_ranks=self.meshes.size(MeshDim.STAGE) if self._hetero_groups is not None else None,
        )  # fmt: skip
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._kept_fp32 is not None:  # the masters start from the fp32 weights, not from their rounding
                self._kept_fp32 = masters_from_kept(module, self._kept_fp32, self._dist_optimizers.values())
            self._masters_current = True
        self.setup_precision_plugin()
        self._moe_layers = [layer for _, layer in moe_layers(module)]

    def _place(self) -> None:
        """The precision plugin's dtype (ZeRO-3 keeps its own) and the device move, after parallelising (flat ZeRO-3's
        shards first: the module's parameters are views of them)."""
        if self.parallel.zero_stage < 3:
            if self.precision_plugin.master_weights:
                self._kept_fp32 = keep_fp32_weights(self.lightning_module)
            self.model = self.precision_plugin.convert_module(self.model)
        move_zero_buffers(self.root_device, (), self.lightning_module)
        self.model_to_device()

    @override
    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for dopt in self._dist_optimizers.values():
            dopt.close()  # the old optimizers' gradient hooks
        self._dist_optimizers = {}
        if self._pipeline is not None:
            defer_zero_grad(self.optimizers)
        self._dist_optimizers = build_optimizers(
            self.optimizers, self.lightning_module, self.meshes, self.parallel, pipelined=self._pipeline is not None,
            master_weights=self.precision_plugin.master_weights, bucket_numel=self.parallel.grad_bucket_numel,
            overlap=self.parallel.overlap_grad_reduce, overlap_param_gather=self.parallel.overlap_param_gather,
        )  # fmt: skip

    def _dist_opt(self, optimizer) -> DistributedOptimizer | None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._dist_optimizers.get(id(optimizer))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Data layouts our parallelism needs, then the step's token count on training loaders (``_data.py``)."""
        module = self.lightning_module
        loader = distribute_loader(
            dataloader, training=module.trainer.training, parallel=self.parallel, meshes=self.meshes,
            hetero_groups=self._hetero_groups, accumulate=module.trainer.accumulate_grad_batches,
            count_tokens=uses_global_token_loss(module), dp_speeds=self._dp_speeds,
        )  # fmt: skip
        if self._pipeline is not None and self._hetero_groups is None:  # "auto" shares are known from here on
            apply_hetero_shares(self._pipeline.runner, self.parallel, self.meshes.local_rank(MeshDim.DP))
        return loader

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

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        self._mark("test_step: forward (TP/SP, CP, EP, pipeline collectives)")
        args = self._shard_for_cp(args)
        return super().test_step(*args, **kwargs)

    def _shard_for_cp(self, args: tuple) -> tuple:
        return shard_for_cp(args, self._batch_model, self.meshes["cp"]) if self.parallel.cp_enabled else args

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if reduces_after_backward(self.parallel, pipelined=self._pipeline is not None):  # ZeRO-2 without PP
            for dopt in self._dist_optimizers.values():
                dopt.reduce_grads()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this around every micro-step of an accumulation window but the last one.
        self._accumulating = True
        try:
            with no_grad_sync(self._fsdp_roots, self._dist_optimizers.values()):
                yield
        finally:
            self._accumulating = False

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
        dopt = self._dist_opt(opt)
        self._mark("optimizer_step: gradient all-reduce/reduce-scatter over data x context ranks")
        params = [q for g in opt.param_groups for q in g["params"]]
        zero3_chunks = self.parallel.zero_stage == 3 and self.parallel.tp_enabled  # TP-partial weights, summed at step
        prepare_step_grads(
            self.parallel, dopt, pipeline=self._pipeline, moe=self._moe_layers, expert_scale=self._expert_grad_scale,
            tp_group=self.meshes.group(MeshDim.TP) if zero3_chunks else None, stepped=params,
        )  # fmt: skip
        self._mark("optimizer_step: loss exchange wait, non-finite check, global grad norm (all_reduce), step")
        replicated = dopt is not None and grads_replicated(
            self.parallel, self.meshes, self.world_size, hetero=self._hetero_groups is not None
        )
        if self._apply_step_guard(params, replicated_grads=replicated):
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

    def wait_params(self) -> None:
        """Complete the ZeRO parameter all-gathers still in flight (``overlap_param_gather``): after this the model's
        parameters hold the last step's weights. Forward and ``state_dict()`` do it themselves; call it before reading
        ``module.parameters()`` by other means between an optimizer step and the next forward."""
        for dopt in self._dist_optimizers.values():
            dopt.wait_params()

    @override
    def teardown(self) -> None:
        """Give the run back (issue 37 item 1), as Lightning's ``Strategy.teardown`` does, plus what only we hold: the
        ZeRO all-gathers and the checkpoint write in flight are completed, the watchdog thread stopped and joined,
        the gradient hooks removed, under Megatron's half layout the module cast back to fp32 holding the masters
        (``precision/fp32_weights.py``), module and optimizer state moved to the CPU with what our ZeRO holds besides
        (the main slices of ZeRO-1/2, flat ZeRO-3's shards; the gradient buckets freed; the pipeline schedules'
        receive buffers and caches dropped), and this run's process groups handed over to be destroyed when a run on
        another module starts (``_plumbing.py`` says why not now).
        """
        self.wait_params()
        self.wait_for_checkpoint()
        self._stop_watchdog()
        for dopt in self._dist_optimizers.values():
            dopt.close()  # its hooks on every parameter; `state_dict()` still serves a save after `fit`
        masters = self._fp32_masters()
        self._offload()
        self._restore_fp32(masters)
        group = self._checkpoint_group  # MemoryCheckpoint creates it during training (`ensure_checkpoint_group`)
        if group is not None and group not in self._created_groups and group != dist.GroupMember.WORLD:
            self._created_groups.append(group)
        retire_groups(self.lightning_module, self._created_groups)
        self._created_groups = []
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _fp32_masters(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Under Megatron's half layout, when the optimizers' masters are this stage's (``fit``, or a checkpoint it
        loaded): each parameter's, gathered on the device and moved to the CPU one bucket at a time."""
        if self._kept_fp32 is None or not self._masters_current or self.lightning_module is None:
            return []
        return gather_masters(self.lightning_module, self._dist_optimizers.values(), torch.device("cpu"))

    def _restore_fp32(self, masters: list[tuple[nn.Parameter, Tensor]]) -> None:
        """Megatron's half layout: the module back in fp32 (on the CPU, after ``_offload``), holding the masters after
        ``fit`` and its values from before the stage otherwise (``precision/fp32_weights.py``)."""
        kept, self._kept_fp32 = self._kept_fp32, None
        if kept is not None and self.lightning_module is not None:
            restore_fp32_weights(self.lightning_module, kept, masters)

    def _offload(self) -> None:
        cpu = torch.device("cpu")
        _optimizers_to_device(self.optimizers, cpu)
        if self.lightning_module is not None:
            move_zero_buffers(cpu, self._dist_optimizers.values(), self.lightning_module, release_grads=True)
            self.lightning_module.cpu()
            self._offloaded = self.root_device != cpu
        if self._pipeline is not None:  # the schedules' receive buffers and caches, rebuilt on the next step
            self._pipeline.runner.release_buffers()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # `trainer.save_checkpoint` after `fit` (the first hook it calls): the shards' collectives run on the device.
        # The main slices also when saving during a later `validate` (its set-up brings back only the module).
        move_zero_buffers(self.root_device, self._dist_optimizers.values(), self.lightning_module)
        if self._offloaded:
            self.model_to_device()
            _optimizers_to_device(self.optimizers, self.root_device)
        return super().lightning_module_state_dict()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # `validate(ckpt_path=...)` after `fit` loads into the fitted optimizers' main slices, left on the CPU.
        move_zero_buffers(self.root_device, self._dist_optimizers.values(), self.lightning_module)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self._masters_current = True  # the optimizers' masters hold the checkpoint's weights
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._offloaded:  # saved after `fit`: back to the CPU once written
            self.wait_for_checkpoint()
            self._offload()

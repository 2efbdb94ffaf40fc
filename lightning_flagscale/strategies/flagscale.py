"""``FlagScaleStrategy``: hybrid parallelism behind the unchanged Lightning ``Trainer`` and ``training_step``.

Hook order (Lightning's): ``setup_environment`` validates the layout against the world size and the model's config
before any process group exists, then creates the process group and the named meshes; ``configure_model`` runs on
the meta device; ``setup`` parallelises (TP -> CP -> EP -> ZeRO-3/FSDP2), materialises and initialises the weights,
applies precision, builds the optimizers and turns them into DDP/ZeRO-1/2 optimizers. ``optimizer_step`` runs the
closure, reduces gradients over data x context ranks, unscales/clips by the global norm, steps, and re-gathers.

Each parallelism lives in ``lightning_flagscale/parallel/``; this file only sequences them.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
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
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.checkpoint.sharded import PendingSave, load_sharded, read_meta, save_sharded
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.parallel.data import DistributedOptimizer, apply_fsdp, clip_grad_norm_
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes, build_meshes
from lightning_flagscale.precision.flagscale import FlagScalePrecision, as_flagscale_precision
from lightning_flagscale.strategies._checkpoint import optimizer_template, rng_state, set_rng_state
from lightning_flagscale.strategies._pipeline import (
    PipelinedModel,
    build_pipelined_model,
    deferred_zero_grad,
    exclude_tied_copy_from_norm,
)

__all__ = ["FlagScaleStrategy"]

_VOCAB_PAD = 64  # vocab padded to lcm(64, tp): identical padding for every TP size dividing 64, so checkpoints reshard


class FlagScaleStrategy(ParallelStrategy):
    """Megatron/FlagScale-class hybrid parallelism for the Lightning ``Trainer``.

    Pass the parallel sizes as keyword arguments (the fields of :class:`~lightning_flagscale.config.ParallelConfig`)
    or a ready ``ParallelConfig`` as ``parallel``. ``data_parallel_size=None`` takes the remaining ranks.
    """

    strategy_name = "flagscale"

    def __init__(
        self,
        parallel: ParallelConfig | None = None,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        virtual_pipeline_parallel_size: int = 1,
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
        pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"] = "1f1b",
        pipeline_layers: list[int] | None = None,
        pipeline_balance: Literal["even", "cost"] = "even",
        recompute: Literal["none", "selective", "full"] | list[Literal["none", "selective", "full"]] = "none",
        hetero_dp_batch_sizes: list[int] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        grad_bucket_numel: int = 1 << 24,
        async_checkpoint: bool = False,
    ) -> None:
        super().__init__()
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
            )
        self.parallel = parallel
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._grad_bucket_numel = grad_bucket_numel
        self._async_checkpoint = async_checkpoint
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._pending_save: PendingSave | None = None
        self._meshes: ParallelMeshes | None = None
        self._dist_optimizers: dict[int, DistributedOptimizer] = {}
        self._fsdp_roots: list[nn.Module] = []
        self._pipeline: PipelinedModel | None = None
        self._pp_zero_grad_pending = True
        self._moe_layers: list[nn.Module] = []
        self._expert_grad_scale = 1.0
        self._moe_callback = False
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
    def vocab_multiple(self) -> int:
        return int(np.lcm(_VOCAB_PAD, self.parallel.tensor_parallel_size))

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

    @property
    def moe_state_group(self) -> dist.ProcessGroup:
        """Every rank of this rank's pipeline stage: where MoE routers' load statistics are summed."""
        return self.meshes.group(MeshDim.STAGE)

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
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        # Validate before any process group exists: a wrong layout fails in milliseconds, not after a rendezvous.
        self.parallel.resolve(self.world_size)
        config = _transformer_config(self.lightning_module)
        if config is not None:
            self.parallel.validate_model(config)
        elif self._needs_model_protocol():
            raise ValueError(
                f"{type(self.lightning_module).__name__} has no `config: TransformerConfig`, so it cannot be split for"
                " tensor/pipeline/context/expert parallelism; use a model that implements the model protocol"
                " (e.g. lightning_flagscale.models.CausalLMModule) or set those sizes to 1."
            )
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._meshes = build_meshes(self.parallel, self.root_device.type)
        if self._async_checkpoint:
            # The background writer's collectives get their own group, never interleaved with training's.
            self._checkpoint_group = dist.new_group(backend="gloo")
        self.lightning_module._device_mesh = self._meshes.world

    def _needs_model_protocol(self) -> bool:
        p = self.parallel
        return p.tp_enabled or p.pp_enabled or p.cp_enabled or p.ep_enabled

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
        inner = _protocol_model(module)
        if self._needs_model_protocol() and inner is None:
            raise ValueError(
                f"{type(module).__name__} exposes no model with a `tp_plan` (the model protocol); tensor/pipeline/"
                "context/expert parallelism cannot be applied. Set those sizes to 1."
            )
        precision = self.precision_plugin
        # Autocast + fp32 weights for any module, Megatron's half-precision layout for modules that declare it.
        precision.select_layout(module, self.root_device.type)
        parts: list[nn.Module] = []  # the modules each parallelism is applied to: the model, or its pipeline stages
        if inner is not None and p.pp_enabled:
            self._pipeline = build_pipelined_model(module, inner, self.meshes, p, self.root_device)
            inner = self._pipeline
            parts = list(self._pipeline.stage_modules)
        elif inner is not None:
            parts = [inner]
        for part in parts:
            self._parallelize(part)
        if p.zero_stage == 3:
            targets = parts or [module]
            param_dtype = None if precision.param_dtype == torch.float32 else precision.param_dtype
            if p.ep_enabled:
                for target in targets:
                    self._shard_experts(target, param_dtype, precision.reduce_dtype)
            for target in targets:
                apply_fsdp(target, self.meshes.dp_cp, param_dtype=param_dtype, reduce_dtype=precision.reduce_dtype)
            self._fsdp_roots.extend(targets)
        self._materialize(module, inner)
        if p.zero_stage < 3:
            self.model = precision.convert_module(self.model)
        self.model_to_device()
        # Tags live on Parameter objects, which materialising and dtype/device moves may replace: set them last.
        if self._pipeline is not None:
            exclude_tied_copy_from_norm(self._pipeline)
        if p.ep_enabled:
            from lightning_flagscale.parallel.expert import tag_expert_params

            tag_expert_params(inner)
        precision.grad_norm_fn = partial(clip_grad_norm_, pp_size=p.pipeline_parallel_size)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if (config := _transformer_config(module)) and config.is_moe:
            from lightning_flagscale.callbacks.moe import MoETelemetry
            from lightning_flagscale.moe.balance import moe_layers

            self._moe_layers = [layer for _, layer in moe_layers(module)]
            self._moe_callback = any(isinstance(cb, MoETelemetry) and cb.update_state for cb in trainer.callbacks)

    def _parallelize(self, inner: nn.Module) -> None:
        if self.meshes.size(MeshDim.DP_CP) > 1 and hasattr(inner, "token_group"):
            inner.token_group = self.meshes.group(MeshDim.DP_CP)  # global token-mean loss (CausalLM.loss_fn)
        self._apply_parallelisms(inner)

    def _apply_parallelisms(self, inner: nn.Module) -> None:
        """Apply TP -> CP -> EP -> recompute (ZeRO-3 comes after, so FSDP2 shards the TP/EP-local DTensors and wraps
        the checkpointed blocks)."""
        p = self.parallel
        meshes = self.meshes
        if p.tp_enabled:
            from lightning_flagscale.parallel.tensor import apply_tp

            apply_tp(inner, meshes["tp"], sequence_parallel=p.sequence_parallel)
        if p.cp_enabled:
            from lightning_flagscale.parallel.context import apply_cp

            apply_cp(
                inner, meshes["cp"], mode=p.context_parallel_mode, ulysses_size=p.resolved_ulysses_size,
                tp_size=p.tensor_parallel_size,
            )  # fmt: skip
        if p.ep_enabled:
            from lightning_flagscale.parallel.expert import apply_ep

            apply_ep(inner, meshes["ep"])
        if not p.pp_enabled and p.recompute != "none":  # under PP, build_pipeline applies it per stage
            from lightning_flagscale.parallel.pipeline_recompute import apply_recompute, resolve_recompute

            apply_recompute(inner, resolve_recompute(p.recompute, 1)[0])

    def _shard_experts(self, model: nn.Module, param_dtype, reduce_dtype) -> None:
        """ZeRO-3 for expert weights: FSDP2 over the expert-data-parallel ranks of the expert mesh (the experts are
        already ``Shard(0)`` over ep on that mesh), each expert group its own FSDP unit inside its block's."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_flagscale.moe.balance import moe_layers

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for _, layer in moe_layers(model):
            self._fsdp_roots.append(fully_shard(layer.experts, mesh=self.meshes["edp"], mp_policy=mp))
        # FSDP2 averages over edp; the expert owners already summed their EP group's tokens, so the mean over all
        # dp x cp x tp token shards needs a further 1/ep (optimizer_step). Not `set_gradient_divide_factor`: it
        # reduces with PREMUL_SUM, which gloo lacks.
        self._expert_grad_scale = 1.0 / self.parallel.expert_parallel_size

    def _materialize(self, module: nn.Module, inner: nn.Module | None) -> None:
        if not any(t.is_meta for t in module.parameters()) and not any(t.is_meta for t in module.buffers()):
            return
        # Only what is on the meta device: `to_empty` on the whole LightningModule would also wipe state that was
        # built for real in `__init__` (e.g. torchmetrics accumulators). The model goes first, as a whole, so its
        # own `_apply` can keep tied weights tied.
        if inner is not None:
            inner.to_empty(device=self.root_device)
        for sub in module.modules():
            own = itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))
            if any(t.is_meta for t in own):
                sub.to_empty(device=self.root_device, recurse=False)
        target = inner if inner is not None else module
        if hasattr(module, "initialize_weights"):
            module.initialize_weights()
        elif hasattr(target, "init_weights"):
            target.init_weights(seed=int(getattr(module, "init_seed", 0)))
        else:
            raise TypeError(
                f"{type(target).__name__} was built on the meta device but has no `init_weights(seed)`; add one, or"
                " build the model in `__init__` instead of `configure_model`."
            )

    @override
    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        self._dist_optimizers = {}
        if self._pipeline is not None:
            for opt in self.optimizers:
                # Lightning zeroes grads between training_step and backward; under PP that would wipe the
                # schedule's gradients. Keep the real zero_grad for `training_step` to call at the right time.
                opt._flagscale_zero_grad = opt.zero_grad
                opt.zero_grad = deferred_zero_grad
        if self.parallel.zero_stage == 3:
            return
        p = self.parallel
        groups = {"dp_cp": self.meshes.group(MeshDim.DP_CP)}
        divisors = {"dp_cp": p.dp * p.context_parallel_size}
        if self.meshes.expert is not None:
            groups["edp"] = self.meshes.group(MeshDim.EDP)
            # An expert's owner already holds the sum over its EP group; MoE blocks run on the whole sequence on
            # every TP rank (with or without SP), so each token counts once per TP rank in that sum.
            divisors["edp"] = p.dp * p.context_parallel_size * p.tensor_parallel_size
        for opt in self.optimizers:
            self._dist_optimizers[id(opt)] = DistributedOptimizer(
                opt,
                self.lightning_module,
                groups,
                stage=self.parallel.zero_stage,
                master_weights=self.precision_plugin.master_weights,
                bucket_numel=self._grad_bucket_numel,
                divisors=divisors,
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
        """Heterogeneous DP: replace the even split of training batches by ``hetero_dp_batch_sizes`` shares."""
        from torch.utils.data import DataLoader, DistributedSampler

        sizes = self.parallel.hetero_dp_batch_sizes
        sampler = getattr(dataloader, "sampler", None)
        if sizes is None or not isinstance(dataloader, DataLoader) or not isinstance(sampler, DistributedSampler):
            return dataloader
        if not sampler.shuffle:  # evaluation loaders keep the even split
            return dataloader
        from lightning_flagscale.parallel.hetero import HeteroBatchSampler

        batches = HeteroBatchSampler(
            len(dataloader.dataset), sizes, self.meshes.local_rank(MeshDim.DP), seed=sampler.seed
        )
        return DataLoader(
            dataloader.dataset, batch_sampler=batches, collate_fn=dataloader.collate_fn,
            num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory,
        )  # fmt: skip

    # ------------------------------------------------------------------ step
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        args = self._shard_for_cp(args)
        scaler = self.precision_plugin.scaler
        loss_factor = (
            scaler.scale if scaler is not None else 1.0
        ) / self.lightning_module.trainer.accumulate_grad_batches
        for layer in self._moe_layers:
            # Aux-loss gradients are attached inside the layers: give them the factor the main loss gets.
            layer.aux_loss_scale = loss_factor
        if self._pipeline is not None:
            if self._pp_zero_grad_pending:
                # Under PP the schedule runs backward inside training_step, before the point where Lightning's loop
                # zeroes gradients; the zeroing happens here instead, at the start of each accumulation window.
                for opt in self.optimizers:
                    opt._flagscale_zero_grad(set_to_none=True)
                for param in self.lightning_module.parameters():
                    param.grad = None
                self._pp_zero_grad_pending = False
            self._pipeline.grad_scale = loss_factor
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        args = self._shard_for_cp(args)
        return super().validation_step(*args, **kwargs)

    def _shard_for_cp(self, args: tuple) -> tuple:
        if not self.parallel.cp_enabled or not args or not isinstance(args[0], Mapping):
            return args
        from lightning_flagscale.parallel.context import shard_batch_for_cp

        return (shard_batch_for_cp(dict(args[0]), self.meshes["cp"]), *args[1:])

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
        for root in self._fsdp_roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in self._fsdp_roots:
                root.set_requires_gradient_sync(True)

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
        if dopt is not None and (self.parallel.zero_stage < 2 or self._pipeline is not None):
            dopt.reduce_grads()
        params = [q for g in opt.param_groups for q in g["params"]]
        skip = precision.unscale_and_check(params)
        precision._after_closure(model, opt)  # on_before_optimizer_step hooks, then clipping by the global norm
        if not skip:
            opt.step(**kwargs)
        if dopt is not None:
            dopt.sync_params()
        self._pp_zero_grad_pending = True
        if self._moe_layers and not self._moe_callback:
            from lightning_flagscale.moe.balance import update_moe_state

            update_moe_state(self.lightning_module, self.moe_state_group)  # bias balancing, hot-expert choice
        return closure_result

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
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        # Under mixed precision the fp32 master weights are the model: save them, not the bf16 copies.
        for dopt in self._dist_optimizers.values():
            state.update(dopt.master_state_dict())
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        dopt = self._dist_opt(opt)
        if dopt is not None:
            return dopt.state_dict()
        return get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=False))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FlagScaleStrategy.save_checkpoint does not take storage_options (it writes DCP folders).")
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        rng = rng_state()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, rng)
        checkpoint["rng_states_per_rank"] = gathered
        checkpoint["parallel_config"] = vars(self.parallel).copy()
        self.wait_for_checkpoint()  # one save in flight at a time
        self._pending_save = save_sharded(path, state, checkpoint, async_group=self._checkpoint_group)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight is complete (renamed into place)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            pending.wait()

    @override
    def remove_checkpoint(self, filepath) -> None:
        import shutil

        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self.wait_for_checkpoint()
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = read_meta(path)
        model_sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        for dopt in self._dist_optimizers.values():
            model_sd.update(dopt.master_state_dict())  # fp32 templates where masters exist
        state: dict[str, Any] = {"state_dict": model_sd}
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        for i, opt in enumerate(self.optimizers):
            dopt = self._dist_opt(opt)
            if dopt is not None:
                state[f"optimizer_{i}"] = optimizer_template(dopt, path, i)
            else:
                _init_optim_state(opt)
                state[f"optimizer_{i}"] = get_optimizer_state_dict(
                    self.model, opt, options=StateDictOptions(full_state_dict=False)
                )
        load_sharded(path, state)
        strict = getattr(self.lightning_module, "strict_loading", True)
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))
        for i, opt in enumerate(self.optimizers):
            dopt = self._dist_opt(opt)
            if dopt is not None:
                dopt.load_master_state_dict(state["state_dict"])
                dopt.load_state_dict(state[f"optimizer_{i}"])
                dopt.sync_params()
            else:
                set_optimizer_state_dict(
                    self.model, opt, state[f"optimizer_{i}"], options=StateDictOptions(full_state_dict=False)
                )
        rngs = meta.pop("rng_states_per_rank", None)
        if rngs is not None and len(rngs) == self.world_size:
            set_rng_state(rngs[self.global_rank])
        elif rngs is not None:
            rank_zero_warn("Resuming under a different world size: RNG states are re-seeded, not restored per rank.")
        meta.pop("parallel_config", None)
        return meta


def _transformer_config(module: nn.Module | None) -> TransformerConfig | None:
    config = getattr(module, "config", None)
    return config if isinstance(config, TransformerConfig) else None


def _protocol_model(module: nn.Module) -> nn.Module | None:
    """The sub-module that implements the model protocol (``tp_plan``): the module itself or its ``model``."""
    if hasattr(module, "tp_plan"):
        return module
    inner = getattr(module, "model", None)
    return inner if inner is not None and hasattr(inner, "tp_plan") else None

"""The Lightning plumbing of ``FlagScaleStrategy`` that every ``ParallelStrategy`` writes alike: devices and ranks,
the precision plugin, meta-device init, and the world collectives Lightning calls (barrier, broadcast, reduce)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.precision.flagscale import FlagScalePrecision, as_flagscale_precision

__all__ = ["PlumbingHooks"]


class PlumbingHooks:
    """Mixed into ``FlagScaleStrategy`` (a ``ParallelStrategy``), which sets ``_meshes`` in ``setup_environment``."""

    _meshes: ParallelMeshes | None = None

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

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

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

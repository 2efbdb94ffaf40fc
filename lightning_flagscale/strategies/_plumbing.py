"""The Lightning plumbing of ``FlagScaleStrategy`` that every ``ParallelStrategy`` writes alike: devices and ranks,
the precision plugin, meta-device init, the world collectives Lightning calls (barrier, broadcast, reduce), and the
lifetime of the process groups a run creates (:func:`shared_rank_meshes`, :func:`recording_new_groups`,
:func:`retire_groups`, :func:`release_groups_of_other_modules`).

Process groups outlive ``teardown`` on purpose: the fitted module's DTensors, FSDP2 states, flat ZeRO-3 units and
pipeline stages run their collectives over them, and ``trainer.save_checkpoint``, ``export_hf`` or ``full_tensor()``
after ``fit`` need them (Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` keep theirs for the same reason,
forever). The groups of a run's meshes are shared by every later run with the same layout in the process and never
destroyed: torch's DTensor caches sharding and redistribution plans by mesh, and meshes compare equal by ranks and
axis names, not by process group, so a plan cached by an earlier run names the groups of *its* mesh; destroying those
and building an equal mesh anew fails the next run in a collective ("Could not resolve the process group registered
under the name 7"). Their number is bounded by the distinct layouts a process runs, not by its fits. The other groups
a run creates (the checkpoint writer's, the pipeline's and the heterogeneous meshes' tied-weight groups) are destroyed
when the next run in the process starts on another module (its ``setup_environment``, which every rank enters at the
same point, so all ranks destroy the same groups in the same order). The default (world) group is never destroyed
here: Lightning creates it once per process, destroys it at exit (with every other group) and its strategies never
destroy it in ``teardown``; a later ``Trainer`` and the user's own collectives use it (issue 37 item 1).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
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
from torch import Tensor, nn
from torch.distributed import distributed_c10d
from typing_extensions import override

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models.protocol import model_config
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.parallel.plan import build_rank_meshes
from lightning_flagscale.precision.flagscale import FlagScalePrecision, as_flagscale_precision

__all__ = [
    "PlumbingHooks",
    "live_groups",
    "mesh_groups",
    "recording_new_groups",
    "release_groups_of_other_modules",
    "retire_groups",
    "shared_rank_meshes",
]

# The groups of finished runs in this process, with (weakly) the module each run parallelised: process groups are
# process-wide state in torch, and the run that must destroy them is a later strategy object, not the one that made
# them. Oldest first.
_RETIRED: list[tuple[weakref.ref, list[dist.ProcessGroup]]] = []


def live_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank is a member of, in creation order. torch has no public listing: its registry
    ``distributed_c10d._world.pg_map`` (insertion-ordered) is read, never written."""
    return list(distributed_c10d._world.pg_map)


@contextmanager
def recording_new_groups(into: list[dist.ProcessGroup]) -> Generator[None, None, None]:
    """Append to ``into`` the groups created inside the block (the default group, reused by a mesh dimension that
    spans the world, is not new and never recorded)."""
    before = set(live_groups())
    try:
        yield
    finally:
        into.extend(pg for pg in live_groups() if pg not in before)


def retire_groups(module: nn.Module | None, groups: list[dist.ProcessGroup]) -> None:
    """A run's ``teardown``: its groups stay usable by ``module`` until a run on another module starts."""
    if groups:
        _RETIRED.append((weakref.ref(module) if module is not None else _dead, list(groups)))


def _dead() -> None:
    return None


# Meshes by layout, shared by the runs of this process (module docstring): key -> (the default group they were built
# over, ``build_rank_meshes``'s result, the groups building it created).
_MESHES: dict[tuple, tuple[dist.ProcessGroup, tuple, list[dist.ProcessGroup]]] = {}


def _mesh_key(parallel: ParallelConfig, module: nn.Module, device: torch.device) -> tuple:
    if not parallel.hetero_enabled:  # every field `parallel/mesh.py::build_meshes` reads: keep them in step
        p = parallel
        sizes = (p.pipeline_parallel_size, p.dp, p.context_parallel_size, p.tensor_parallel_size)
        return (device.type, *sizes, p.expert_parallel_size, p.expert_tensor_parallel_size)
    config = model_config(module)  # heterogeneous meshes: the whole job layout and the block count decide the split
    return (device.type, repr(parallel), None if config is None else config.num_layers)


def shared_rank_meshes(
    parallel: ParallelConfig, module: nn.Module, device: torch.device
) -> tuple[ParallelConfig, ParallelMeshes, list | None]:
    """``build_rank_meshes`` (collective), or the meshes an earlier run of this process built for the same layout
    over the same default group (collective-free, taken by every rank alike); the result's config is this run's."""
    world = dist.group.WORLD
    for key in [k for k, entry in _MESHES.items() if entry[0] is not world]:  # a world destroyed since: groups gone
        del _MESHES[key]
    key = _mesh_key(parallel, module, device)
    if key not in _MESHES:
        made: list[dist.ProcessGroup] = []
        with recording_new_groups(made):
            built = build_rank_meshes(parallel, module, device)
        _MESHES[key] = (world, built, made)
    rank_config, meshes, groups = _MESHES[key][1]
    # Homogeneous: this run's own config (same sizes, any other field may differ); heterogeneous: a private copy of
    # the stage group's layout (the run may update it, e.g. the resumed hetero DP shares).
    rank_config = copy.deepcopy(rank_config) if parallel.hetero_enabled else parallel
    return rank_config, dataclasses.replace(meshes, config=rank_config), groups


def mesh_groups() -> list[dist.ProcessGroup]:
    """The groups of the shared meshes (never destroyed before the default group)."""
    return [pg for entry in _MESHES.values() for pg in entry[2]]


def release_groups_of_other_modules(module: nn.Module | None) -> None:
    """Collectively (every rank at the same point of a run's set-up): destroy the groups of every finished run whose
    module is not ``module``, newest first (the reverse of creation, as torch destroys the world's groups: some NCCL
    versions abort a communicator collectively). A run on the same module (``validate`` after ``fit``) keeps them."""
    kept, doomed = [], []
    for entry in _RETIRED:
        (kept if entry[0]() is module and module is not None else doomed).append(entry)
    _RETIRED[:] = kept
    registered = set(live_groups())  # a group torch already forgot (the world was destroyed since) is skipped
    for _, groups in reversed(doomed):
        for pg in reversed(groups):
            if pg in registered:
                dist.destroy_process_group(pg)


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

"""Device types of heterogeneous jobs: which rank is which device, and emulated slow devices on CPU (issue 12).

**Rank mapping.** Every rank reports its device type once (:func:`local_device_type`: the ``FLAGSCALE_DEVICE_TYPE``
environment variable, else the CUDA device name, else none); one ``all_gather_object`` gives every rank the same list,
and ``config.hetero.rank_order_by_type`` turns it into the rank permutation that ``plan_stage_groups`` applies: the
ranks of a type fill the meshes declaring that ``device_type`` in rank order. A job whose ranks all report one type
keeps plain rank order.

**CPU emulation.** ``FLAGSCALE_EMULATE_SLOWDOWN="slow=2.0,fast=1.0"`` makes every rank of device type ``slow`` twice
as slow: :func:`install_emulated_slowdown` hooks the rank's stage modules (the whole local model without pipelining)
and, after each forward and each backward of them, sleeps ``(factor - 1)`` times the compute time just measured.
On CPU that compute time is the thread's CPU time (``time.thread_time``; intra-op threads are 1 under the launcher
and the benchmark, and CPU backward runs on the calling thread), not the wall time: on a machine shared with other
jobs, wall time counts the waits for a core, which would stretch the delay and the profiled speeds by the load
instead of by the factor. Accelerators use the wall time after a synchronisation.
Sleeping rather than shrinking ``torch.set_num_threads`` because (1) the slowdown is then exactly the factor whatever
the load, while thread counts only slow a rank down if it had the cores to use them (tests and benchmarks run one
thread per process on a shared 2-core machine), and (2) a sleeping rank leaves the cores to the others, as a slow
device on its own hardware would. The same hooks count each rank's busy time (compute + emulated delay), which the
benchmark plots, and the profiling pass (``parallel/hetero_mesh/profile.py``) runs under them, so it sees the slowdown.

``FLAGSCALE_EMULATE_COST=least`` makes the emulated device time of a call ``factor`` times the *least* compute time
that call (module, forward or backward, input shapes) has taken on this rank so far, instead of this call's own (the
default, ``measured``). A process's CPU time per call still varies with what shares its core (cache, memory
bandwidth: 4 processes on 2 cores), and the default stretches that noise by the factor too: a slow stage of a
heterogeneous job measured 2.3x the fast one's time per block while the same two types training alone measured 2.0x
(issue 42 item 5). Under ``least`` a call's device time is the factor times a fixed cost once the shape has run a
few times, whatever shares the core (a call that runs longer than that still takes its real time).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable

from lightning_flagscale.config.hetero import HeteroMesh, StageGroup, parse_hetero_meshes

__all__ = [
    "COST_ENV",
    "DEVICE_TYPE_ENV",
    "SLOWDOWN_ENV",
    "BusyTimer",
    "_declared_type",
    "attach_busy_timer",
    "emulated_cost",
    "emulated_slowdown",
    "gather_rank_order",
    "install_emulated_slowdown",
    "local_device_type",
    "rank_device_type",
    "rank_order_by_type",
]

DEVICE_TYPE_ENV = "FLAGSCALE_DEVICE_TYPE"
"""Names this process's device type (matched against ``hetero_meshes[i].device_type``)."""
SLOWDOWN_ENV = "FLAGSCALE_EMULATE_SLOWDOWN"
"""``type=factor`` pairs, comma-separated: compute of ranks of that device type is stretched by ``factor``."""
COST_ENV = "FLAGSCALE_EMULATE_COST"
"""What the factor stretches: ``measured`` (each call's own compute time, the default) or ``least`` (the least compute
time a call of the same module, direction and input shapes has taken on this rank)."""
_COSTS = ("measured", "least")
_log = logging.getLogger(__name__)


def local_device_type(device: torch.device | None = None) -> str | None:
    """This process's device type: ``FLAGSCALE_DEVICE_TYPE``, else the CUDA device's name, else ``None``."""
    name = os.environ.get(DEVICE_TYPE_ENV, "").strip()
    if name:
        return name
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return None


def gather_rank_order(hetero_meshes: list[Any], device: torch.device | None = None) -> list[int]:
    """Every rank's device type, gathered once, as the permutation for ``plan_stage_groups(rank_order=...)``."""
    meshes = parse_hetero_meshes(hetero_meshes)
    types: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(types, local_device_type(device))
    order = rank_order_by_type(meshes, types)
    if dist.get_rank() == 0 and order != sorted(order):
        _log.info("Ranks assigned to heterogeneous meshes by device type %s: mesh positions -> ranks %s", types, order)
    return order


def rank_device_type(groups: list[StageGroup] | None = None) -> str | None:
    """The device type emulation applies to on this rank: its reported type, else its stage group's declared one."""
    reported = local_device_type()
    if reported is not None or not groups or not dist.is_initialized():
        return reported
    return next((g.device_type for g in groups if dist.get_rank() in g.ranks), None)


def emulated_slowdown(device_type: str | None, spec: str | None = None) -> float | None:
    """The factor ``FLAGSCALE_EMULATE_SLOWDOWN`` (or ``spec``) gives ``device_type``: ``None`` when the variable is
    unset (no hooks at all), 1.0 for types it does not name. Raises ``ValueError`` on a malformed entry."""
    spec = os.environ.get(SLOWDOWN_ENV) if spec is None else spec
    if not spec:
        return None
    factors = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = -1.0
        if not sep or not name.strip() or factor < 1.0:
            raise ValueError(
                f"{SLOWDOWN_ENV}={spec!r}: each entry must be device_type=factor with factor >= 1 (e.g."
                f" 'slow=2.0'); got {item!r}."
            )
        factors[name.strip()] = factor
    return factors.get(str(device_type), 1.0)


def emulated_cost(spec: str | None = None) -> str:
    """``FLAGSCALE_EMULATE_COST`` (or ``spec``): ``"measured"`` when unset. Raises ``ValueError`` on another value."""
    spec = (os.environ.get(COST_ENV, "") if spec is None else spec).strip() or "measured"
    if spec not in _COSTS:
        raise ValueError(f"{COST_ENV}={spec!r}: give one of {', '.join(_COSTS)}.")
    return spec


class BusyTimer:
    """Forward/backward compute time of the hooked modules, stretched by ``factor`` with a sleep (module docs).

    ``cost="least"``: a call's device time is ``factor`` times the least compute time its module, direction and input
    shapes have taken so far (or its own, when longer)."""

    def __init__(self, factor: float, device: torch.device | None = None, cost: str = "measured") -> None:
        if cost not in _COSTS:
            raise ValueError(f"BusyTimer(cost={cost!r}): give one of {', '.join(_COSTS)}.")
        self.factor = factor
        self.cost = cost
        self._least: dict[tuple[Any, ...], float] = {}
        self._sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
        self._clock = time.perf_counter if device is not None and device.type != "cpu" else time.thread_time
        self.busy_s = 0.0
        """Compute + emulated delay since the last :meth:`reset`."""
        self.compute_s = 0.0
        self._fwd_start: list[float] = []

    def reset(self) -> None:
        self.busy_s = self.compute_s = 0.0

    def now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def _stretch(self, elapsed: float, key: tuple[Any, ...] = ()) -> None:
        if self.cost == "least":
            least = self._least[key] = min(self._least.get(key, elapsed), elapsed)
            delay = max(self.factor * least - elapsed, 0.0)
        else:
            delay = (self.factor - 1.0) * elapsed
        if delay > 0:
            time.sleep(delay)
        self.compute_s += elapsed
        self.busy_s += elapsed + delay

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self._fwd_start.append(self.now())

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.post_forward_with_kwargs(module, args, {}, output)

    def post_forward_with_kwargs(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        key = (id(module), _shapes((*args, *kwargs.values())))
        self._stretch(self.now() - self._fwd_start.pop(), ("F", *key))
        out = _first_grad_tensor(output)
        if out is not None and torch.is_grad_enabled():
            out.register_hook(lambda grad: self._backward_started(("B", *key)))

    def _backward_started(self, key: tuple[Any, ...]) -> None:
        # The gradient of the module's output arrived: its backward starts now and ends with this backward call
        # (one stage module per backward call under pipelining), whose end the engine callback marks.
        start = self.now()
        Variable._execution_engine.queue_callback(lambda: self._stretch(self.now() - start, key))


def _shapes(args: Any) -> tuple[Any, ...]:
    """The shapes of a call's tensor arguments (what a call's compute time depends on)."""
    return tuple(tuple(a.shape) if isinstance(a, Tensor) else None for a in args)


def _first_grad_tensor(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((t for t in values if isinstance(t, Tensor) and t.requires_grad), None)


def install_emulated_slowdown(
    modules: Iterable[nn.Module], device_type: str | None, device: torch.device | None = None
) -> BusyTimer | None:
    """Hook ``modules`` (this rank's stage modules) with a :class:`BusyTimer` of ``device_type``'s factor.

    Nothing is installed when ``FLAGSCALE_EMULATE_SLOWDOWN`` is unset; the timer is also kept as ``_fs_busy_timer``
    on every hooked module, where benchmarks read the busy time.
    """
    factor = emulated_slowdown(device_type)
    if factor is None:
        return None
    return attach_busy_timer(modules, BusyTimer(factor, device, emulated_cost()))


def attach_busy_timer(modules: Iterable[nn.Module], timer: BusyTimer) -> BusyTimer:
    """Hook ``timer`` onto every module (forward pre/post hooks; the backward through the output's gradient)."""
    for module in modules:
        module.register_forward_pre_hook(timer.pre_forward)
        module.register_forward_hook(timer.post_forward_with_kwargs, with_kwargs=True)
        module._fs_busy_timer = timer
    return timer


def rank_order_by_type(meshes: list[HeteroMesh], rank_types: list[str | None]) -> list[int]:
    """The global rank at each position of the mesh-ordered world, from every rank's reported device type.

    Ranks fill the meshes in rank order when every rank reports the same type (or none) or no mesh declares a
    ``device_type`` (one type: nothing to match). Otherwise each declared type must be reported by exactly as many
    ranks as the meshes declaring it hold, and the ranks of a type fill its meshes in rank order (stable). A rank
    reports a declared type when it names it or contains it, case-insensitively (the CUDA device name
    ``NVIDIA H100 80GB HBM3`` reports ``H100``; the longest declared type contained wins).
    """
    world = sum(m.size for m in meshes)
    if len(rank_types) != world:
        raise ValueError(f"{len(rank_types)} ranks reported a device type but hetero_meshes describe {world} ranks.")
    declared = [m.device_type for m in meshes]
    if len(set(rank_types)) <= 1 or all(t is None for t in declared):
        return list(range(world))
    if any(t is None for t in declared):
        raise ValueError(
            f"Ranks report different device types but hetero_meshes{[i for i, t in enumerate(declared) if t is None]}"
            " declare none; give every mesh a device_type."
        )
    need: dict[str, int] = {}
    for mesh in meshes:
        need[mesh.device_type] = need.get(mesh.device_type, 0) + mesh.size
    rank_types = [_declared_type(t, list(need)) for t in rank_types]
    have: dict[str, int] = {}
    for t in rank_types:
        have[str(t)] = have.get(str(t), 0) + 1
    if need != have:
        raise ValueError(
            f"The ranks' device types {dict(sorted(have.items()))} (ranks per type; FLAGSCALE_DEVICE_TYPE or the"
            f" accelerator's name) do not match the ranks hetero_meshes declare per device_type"
            f" {dict(sorted(need.items()))}; change the meshes' device_type or sizes."
        )
    queues = {t: [r for r, rt in enumerate(rank_types) if str(rt) == t] for t in need}
    return [queues[m.device_type].pop(0) for m in meshes for _ in range(m.size)]


def _declared_type(reported: str | None, declared: list[str]) -> str | None:
    """The declared type a rank's reported one names: itself, else the longest declared type it contains
    (case-insensitive), else unchanged."""
    if reported is None or reported in declared:
        return reported
    contained = [t for t in declared if t.lower() in str(reported).lower()]
    return max(contained, key=len) if contained else reported

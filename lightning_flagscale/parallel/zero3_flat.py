"""Flat-buffer ZeRO-3 (``zero3_impl="flat"``): each unit's parameters in one contiguous buffer, sharded over ``dp_cp``.

Why our own, next to FSDP2 (``apply_fsdp``): FSDP2 shards every parameter on its own (``Shard(0)`` rows) and so
copies the all-gathered bytes out into per-parameter tensors, and the gradients into a reduce-scatter buffer, at
every unit and step ("per-parameter packing"). Here, as in FSDP1 / Megatron-FSDP / the ZeRO paper:

- A **unit** (each decoder block, plus the root: embedding, final norm, head) lays its parameters (TP-local shards
  for DTensors) out back to back in one flat buffer of ``N x S`` elements (``N`` = data x context ranks). This
  rank keeps the range ``[rank * S, (rank + 1) * S)`` as its shard, in fp32 (or the parameters' dtype). The
  optimizer steps one ``nn.Parameter`` per original parameter: the rows of it that fall in this rank's range (a
  view of the shard). Every parameter starts at a multiple of its row length and ``S`` is a multiple of every row
  length, so each rank holds whole rows and the optimizer's parameters keep their number of dimensions (weight
  decay grouping by ``ndim`` keeps working); the padding this costs is below one row per parameter plus ``N x lcm``.
- **Forward**: the unit's pre-forward hook all-gathers the shards (cast to ``param_dtype``) straight into the full
  flat buffer; the module's parameters are replaced, for the forward only, by views of it (DTensor views under TP,
  so TP's collectives keep their semantics). All views come from one autograd leaf, so backward yields one flat
  gradient. After the unit's forward the full buffer's storage is freed (reshard after forward; the root stays
  gathered until its backward, as FSDP2's root does).
- **Prefetch**: before unit ``i`` computes, the all-gather of unit ``i + 1`` is launched (async handle); in backward,
  before unit ``i``'s backward, the re-gather of unit ``i - 1``. Launches follow the module order, the same on
  every rank.
- **Backward**: a hook on the unit's output re-gathers into the same storage (the saved views read it again); when
  the flat leaf's gradient is complete (post-accumulate-grad hook) it is cast to ``reduce_dtype`` and
  reduce-scattered (async) into this rank's range, the full buffer freed; at the end of backward every reduction is
  waited for and averaged into the optimizer parameters' ``.grad``.
- **Gradient accumulation**: every micro-step reduce-scatters and *adds* into ``.grad`` (the shard), so gradient
  memory stays ``4 Psi / N`` inside an accumulation window (FSDP2 without sync keeps full gradients instead); the cost
  is one reduce-scatter per micro-step. ``set_requires_gradient_sync`` is therefore not needed.

Parameters are flattened after materialisation (each rank briefly holds its TP-local model). Not supported yet,
and refused by ``ParallelConfig``: pipeline parallelism (split-backward schedules bypass the gradient hooks),
expert parallelism, heterogeneous meshes and activation recompute. Checkpoint conversion: ``zero3_flat_state.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.parallel.data import num_shards

__all__ = ["FlatUnit", "FlatZero3", "apply_flat_zero3", "find_flat_zero3", "summon_full_params"]

_ATTR = "_fs_flat_zero3"
# torch >= 2.10 names them *_single; the old names warn.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(kw_only=True)
class _Slot:
    """One original parameter inside a unit's flat buffer."""

    name: str  # FQN relative to the unit's module (first alias)
    aliases: list[tuple[nn.Module, str]]  # every (module, attribute) that holds it (tied weights: several)
    shape: torch.Size  # local (TP-local) shape
    offset: int  # start in the full flat buffer
    row: int  # elements per dim-0 row
    dtensor: DTensor | None  # the original TP DTensor (mesh, placements, global shape), None for plain tensors
    shard: nn.Parameter | None = None  # this rank's rows, a view of the flat shard: what the optimizer steps
    lo: int = 0  # this rank's part of the parameter in the flat buffer: [lo, hi)
    hi: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _row(shape: torch.Size) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


class FlatUnit:
    """One unit: flat layout, this rank's shard, the full buffer and its collectives."""

    def __init__(self, index: int, module: nn.Module, params: dict[int, list[tuple[str, nn.Module, str]]], mesh,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, spmd_mesh=None) -> None:  # fmt: skip
        self.index = index
        self.module = module
        self.mesh = mesh  # the ranks sharing the unit: dp x cp, or edp for expert units
        self.spmd_mesh = spmd_mesh  # (mesh, model-parallel dim) under TP / EP: the mesh of the checkpoint DTensors
        self.group = group = mesh.get_group()
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slots: list[_Slot] = []
        offset, lcm = 0, 1
        for uses in params.values():
            name, owner, attr = uses[0]
            p = owner._parameters[attr]
            local = p.to_local() if isinstance(p, DTensor) else p
            row = _row(local.shape)
            offset = math.ceil(offset / row) * row  # whole rows on every rank (module docstring)
            lcm = math.lcm(lcm, row)
            self.slots.append(_Slot(name=name, aliases=[(m, a) for _, m, a in uses], shape=local.shape, offset=offset,
                                    row=row, dtensor=p if isinstance(p, DTensor) else None))  # fmt: skip
            offset += local.numel()
        self.numel = offset
        self._split_sizes: list[int] = []  # padding gap, parameter, gap, parameter, ..., tail
        self._split_index: list[int] = []
        end = 0
        for slot in self.slots:
            self._split_sizes += [slot.offset - end, slot.numel]
            self._split_index.append(len(self._split_sizes) - 1)
            end = slot.offset + slot.numel
        self.shard_numel = max(1, math.ceil(offset / self.world / lcm)) * lcm
        self.padded = self.shard_numel * self.world
        self.start = self.rank * self.shard_numel
        self._split_sizes.append(self.padded - end)
        first = params[next(iter(params))][0]
        p0 = first[1]._parameters[first[2]]
        self.master_dtype = (p0.to_local() if isinstance(p0, DTensor) else p0).dtype
        self.device = (p0.to_local() if isinstance(p0, DTensor) else p0).device
        self.param_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.flat_shard = torch.zeros(self.shard_numel, dtype=self.master_dtype, device=self.device)
        self._fill_shard_from_params()
        self.full = torch.empty(self.padded, dtype=self.param_dtype, device=self.device)
        self._free_storage()
        self.gathered = False
        self._work: dist.Work | None = None
        self._src: Tensor | None = None
        self.leaf: Tensor | None = None
        self.backward_started = False
        # A recompute-wrapped block (``pipeline_recompute.py``): its forward hooks run outside the checkpointed
        # region, so the recomputation in backward reads whatever the module holds: the pre-backward hook puts
        # views of the re-gathered buffer back.
        self.recompute = getattr(module, "_recompute_mode", None) not in (None, "none")
        self.grad_acc: Tensor | None = None  # full gradient summed over micro-batches (deferred reduction, PP)

    # ---- layout ----------------------------------------------------------------------------------------------
    def _fill_shard_from_params(self) -> None:
        """Copy this rank's rows of the original parameters into the shard and register the shard parameters."""
        end = self.start + self.shard_numel
        for s in self.slots:
            p = s.aliases[0][0]._parameters[s.aliases[0][1]]
            local = (p.to_local() if isinstance(p, DTensor) else p).detach()
            s.lo, s.hi = max(s.offset, self.start), min(s.offset + s.numel, end)
            s.hi = max(s.hi, s.lo)
            rows = slice((s.lo - s.offset) // s.row, (s.hi - s.offset) // s.row)
            view = self._shard_view(s)
            with torch.no_grad():
                view.copy_(local.reshape(s.shape[0] if s.shape else 1, -1)[rows].reshape(view.shape))
            s.shard = nn.Parameter(view, requires_grad=p.requires_grad)
            # Each rank of the stage holds distinct rows (and TP shards): the global norm sums them once.
            s.shard._fs_num_shards = self.world * num_shards(p)
            s.shard._fs_norm_scale = getattr(p, "_fs_norm_scale", 1.0)
            for module, attr in s.aliases:
                module._parameters[attr] = s.shard

    def _shard_view(self, s: _Slot) -> Tensor:
        flat = self.flat_shard[s.lo - self.start : s.hi - self.start]
        rows = (s.hi - s.lo) // s.row
        return flat.view(rows, *s.shape[1:]) if s.shape else flat.view(rows)

    def _repack(self) -> None:
        """Re-point shard parameters whose storage something replaced (``p.data = ...``) back into the shard."""
        for s in self.slots:
            view = self._shard_view(s)
            if s.shard.numel() and s.shard.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(s.shard.detach())
                s.shard.data = view

    # ---- collectives -----------------------------------------------------------------------------------------
    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    def unshard_async(self, trace: list | None = None) -> None:
        """Launch the all-gather of the shards into the full buffer (no-op when gathered or in flight)."""
        if self.gathered or self._work is not None:
            return
        self._repack()
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        self._src = self.flat_shard.detach().to(self.param_dtype)
        self._work = _all_gather(self.full, self._src, group=self.group, async_op=True)
        if trace is not None:
            trace.append(("all_gather", self.index))

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work, self._src = None, None
            self.gathered = True

    def reshard(self) -> None:
        self.wait()
        if self.gathered:
            self._free_storage()
            self.gathered = False

    # ---- views -----------------------------------------------------------------------------------------------
    def use_full_views(self, as_params: bool = False, detached: bool = False) -> None:
        """Set views of the full buffer as the module's parameters (autograd leaf when grad is enabled; ``detached``:
        views of a leaf without hooks, for a recomputation in backward, whose graph is never differentiated)."""
        base = self.full
        if as_params:
            base = self.full.detach()
        elif detached:  # requires grad as in forward, so autograd saves the same tensors (checkpoint checks that)
            base = self.full.detach().requires_grad_(True)
        elif torch.is_grad_enabled() and any(s.shard.requires_grad for s in self.slots):
            # A new TensorImpl over the same storage (``.data``: own version counter, so re-gathering into
            # ``self.full`` for backward does not invalidate the views autograd saved).
            self.leaf = base = self.full.data.requires_grad_(True)
            self.leaf.register_post_accumulate_grad_hook(self._on_grad)
        # One ``split`` for the whole unit: its backward concatenates every parameter's gradient into one flat
        # gradient in a single node (slicing per parameter would build a zero-padded full-size gradient per view).
        pieces = torch.split(base, self._split_sizes)
        for s, k in zip(self.slots, self._split_index):
            t = pieces[k].view(s.shape)
            if s.dtensor is not None:
                d = s.dtensor
                t = DTensor.from_local(
                    t, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
                )
            if as_params:
                t = nn.Parameter(t, requires_grad=False)
            for module, attr in s.aliases:
                module._parameters[attr] = t

    def use_shards(self) -> None:
        for s in self.slots:
            for module, attr in s.aliases:
                module._parameters[attr] = s.shard

    # ---- gradients -------------------------------------------------------------------------------------------
    def _on_grad(self, leaf: Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        self.use_shards()  # views a recomputation set
        self.owner.reduce_scatter(self, grad)

    owner: FlatZero3


class FlatZero3:
    """The flat ZeRO-3 units of one model part, in forward order (root first, if any), and their hook logic.

    ``backward_order``: the units in the order their backward begins (the reverse of the order their forwards
    end: a nested expert unit right after its block); default: the root, then the others reversed.
    ``defer_reduce`` (pipeline stages): gradients of every micro-batch are summed in full and reduce-scattered once,
    by :meth:`reduce_deferred` after the stage's last backward (the pipeline stage calls it).
    """

    def __init__(self, units: list[FlatUnit], dp_mesh, spmd_mesh=None, *, has_root: bool = True,
                 backward_order: list[FlatUnit] | None = None, defer_reduce: bool = False) -> None:  # fmt: skip
        self.units = units
        self.dp_mesh = dp_mesh
        self.spmd_mesh = spmd_mesh  # (dp_cp, tp) under TP: the mesh of the checkpoint DTensors
        self.has_root = has_root
        self.defer_reduce = defer_reduce
        if backward_order is None:
            backward_order = units[:1] + units[:0:-1] if has_root else units[::-1]
        self.backward_order = backward_order
        self._backward_next = {id(u): n for u, n in zip(backward_order, backward_order[1:])}
        self.trace: list | None = None  # set to a list to record collective launches (tests)
        self._pending: list[tuple[FlatUnit, Tensor, dist.Work, Tensor]] = []
        self._callback_queued = False
        self._handles: list = []
        for unit in units:
            unit.owner = self
            hooks = (
                unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)),
                unit.module.register_forward_hook(self._post_forward_hook(unit)),
            )
            self._handles.extend(hooks)

    @property
    def root(self) -> FlatUnit | None:
        return self.units[0] if self.has_root else None

    def parameters(self) -> Iterator[nn.Parameter]:
        for unit in self.units:
            for s in unit.slots:
                yield s.shard

    # ---- forward ---------------------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: FlatUnit) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            # Inside backward: a recomputation (a unit nested in a checkpointed region, e.g. experts in a block).
            in_backward = torch._C._current_graph_task_id() != -1
            unit.unshard_async(self.trace)
            if not in_backward and unit.index + 1 < len(self.units):  # prefetch: overlaps this unit's compute
                self.units[unit.index + 1].unshard_async(self.trace)
            unit.wait()
            unit.use_full_views(detached=in_backward)

        return hook

    def _post_forward_hook(self, unit: FlatUnit) -> Callable:
        def hook(module: nn.Module, args: tuple, output) -> None:
            unit.use_shards()
            if torch._C._current_graph_task_id() != -1:
                return  # recomputed: stay gathered (the saved tensors read the buffer) until the gradient is reduced
            training = unit.leaf is not None and torch.is_grad_enabled()
            if not (training and unit is self.root):  # the root is needed again at once by backward (its head)
                unit.reshard()
            if training:
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward_hook(unit))

        return hook

    # ---- backward --------------------------------------------------------------------------------------------
    def _pre_backward_hook(self, unit: FlatUnit) -> Callable:
        def hook(grad: Tensor) -> None:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            unit.unshard_async(self.trace)  # a no-op when still full (the root) or prefetched
            if not unit.backward_started:
                unit.backward_started = True
                nxt = self._backward_next.get(id(unit))  # prefetch the unit whose backward runs next
                if nxt is not None:
                    nxt.unshard_async(self.trace)
            unit.wait()
            if unit.recompute:
                with torch.enable_grad():  # as in forward: views that require grad (backward runs without grad)
                    unit.use_full_views(detached=True)

        return hook

    def reduce_scatter(self, unit: FlatUnit, grad: Tensor) -> None:
        """Launch the reduce-scatter of a unit's complete flat gradient and free its full buffer (deferred: add it
        to the unit's micro-batch sum instead)."""
        grad = grad.to(unit.reduce_dtype)
        if self.defer_reduce:
            unit.grad_acc = grad if unit.grad_acc is None else unit.grad_acc.add_(grad)
            unit.reshard()
            return
        out = torch.empty(unit.shard_numel, dtype=unit.reduce_dtype, device=grad.device)
        work = _reduce_scatter(out, grad, group=unit.group, async_op=True)
        if self.trace is not None:
            self.trace.append(("reduce_scatter", unit.index))
        self._pending.append((unit, out, work, grad))
        unit.reshard()

    def reduce_deferred(self) -> None:
        """After a pipeline stage's last backward: reduce-scatter every unit's summed gradient (backward order)."""
        defer, self.defer_reduce = self.defer_reduce, False
        try:
            for unit in self.backward_order:
                grad, unit.grad_acc = unit.grad_acc, None
                if grad is not None:
                    self.reduce_scatter(unit, grad)
            self._finish_backward()
        finally:
            self.defer_reduce = defer

    def discard_grads(self) -> None:
        """Drop the gradients of a backward that was not training (the pipeline's first-step shape inference)."""
        for unit in self.units:
            unit.grad_acc = None
            for s in unit.slots:
                s.shard.grad = None
            unit.use_shards()
            unit.reshard()

    def _finish_backward(self) -> None:
        """End of backward: wait for every reduction, average it into the shard parameters' ``.grad``."""
        self._callback_queued = False
        pending, self._pending = self._pending, []
        for unit, out, work, _ in pending:
            work.wait()
            out = out.div_(unit.world).to(unit.master_dtype)
            for s in unit.slots:
                if not s.shard.requires_grad:
                    continue
                g = out[s.lo - unit.start : s.hi - unit.start].view(s.shard.shape)
                if s.shard.grad is None:
                    s.shard.grad = g
                else:
                    s.shard.grad.add_(g)
        for unit in self.units:
            unit.backward_started = False
            unit.leaf = None
            unit.use_shards()
            unit.reshard()  # the root, and any prefetch a skipped backward left in flight

    # ---- whole-model access ----------------------------------------------------------------------------------
    @contextmanager
    def full_params(self) -> Iterator[None]:
        """Collectively: every unit gathered, the modules holding full (read-only) parameters, for inspection."""
        for unit in self.units:
            unit.unshard_async()
            unit.wait()
            unit.use_full_views(as_params=True)
        try:
            yield
        finally:
            for unit in self.units:
                unit.use_shards()
                unit.reshard()


def _tensors(output) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


def _collect(module: nn.Module, exclude: set[int]) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Parameters of ``module`` not inside an excluded submodule, by identity, with every (module, attr) use."""
    found: dict[int, list[tuple[str, nn.Module, str]]] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if id(m) in exclude:
            return
        for attr, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((prefix + attr, m, attr))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return found


def apply_flat_zero3(
    model: nn.Module,
    dp_mesh,
    *,
    blocks: Sequence[nn.Module],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    spmd_mesh=None,
    experts: Sequence[nn.Module] = (),
    expert_mesh=None,
    expert_spmd_mesh=None,
    own_units: Sequence[nn.Module] = (),
    defer_reduce: bool = False,
) -> FlatZero3:
    """Flat ZeRO-3 over ``dp_mesh`` on a materialised ``model``: one unit per block and per module of ``own_units``
    (a tied pipeline weight: the same layout on both stages), then the root (the rest; absent when nothing is
    left, e.g. a middle pipeline stage). ``experts`` (expert-parallel modules inside the blocks) get units of their
    own, sharded over ``expert_mesh`` (the expert-data-parallel ranks), as FSDP2 shards them over edp."""
    if _ATTR in model.__dict__:  # already flat (``setup`` ran again on the same module): nothing left to flatten
        return model.__dict__[_ATTR]
    order = {id(m): i for i, m in enumerate(model.modules())}
    top = sorted([*blocks, *own_units], key=lambda m: order[id(m)])  # forward order = registration order
    expert_ids = {id(e) for e in experts}
    root_params = _collect(model, {id(m) for m in top} | expert_ids)
    units = [FlatUnit(0, model, root_params, dp_mesh, param_dtype, reduce_dtype, spmd_mesh)] if root_params else []
    ends: list[FlatUnit] = []  # the order forwards end in (children before their parent)
    for module in top:
        params = _collect(module, expert_ids)
        outer = FlatUnit(len(units), module, params, dp_mesh, param_dtype, reduce_dtype, spmd_mesh) if params else None
        units += [outer] if outer is not None else []
        for sub in module.modules():
            if id(sub) in expert_ids:
                units.append(FlatUnit(len(units), sub, _collect(sub, set()), expert_mesh, param_dtype, reduce_dtype,
                                      expert_spmd_mesh))  # fmt: skip
                ends.append(units[-1])
        ends += [outer] if outer is not None else []
    if not units:
        raise ValueError("flat ZeRO-3 found no parameters to shard in this model part.")
    if len(ends) + bool(root_params) != len(units):
        raise ValueError("flat ZeRO-3: every expert module must sit inside one of the blocks.")
    ends += units[:1] if root_params else []
    flat = FlatZero3(units, dp_mesh, spmd_mesh, has_root=bool(root_params), backward_order=ends[::-1],
                     defer_reduce=defer_reduce)  # fmt: skip
    setattr(model, _ATTR, flat)
    return flat


def find_flat_zero3(module: nn.Module) -> list[FlatZero3]:
    """Every flat ZeRO-3 model part inside ``module`` (pipeline stage modules included: a ``PipelinedModel`` holds
    its stages' units under the unsplit names, but not the stage modules themselves as submodules)."""
    found: dict[int, FlatZero3] = {}
    for m in module.modules():
        for sub in (m, *getattr(m, "stage_modules", ())):
            if _ATTR in sub.__dict__:
                found.setdefault(id(sub), sub.__dict__[_ATTR])
    return list(found.values())


@contextmanager
def summon_full_params(module: nn.Module) -> Iterator[None]:
    """Collectively gather flat ZeRO-3 parameters so ``named_parameters`` shows full tensors (no-op otherwise)."""
    with ExitStack() as stack:
        for part in find_flat_zero3(module):
            stack.enter_context(part.full_params())
        yield

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
  A unit with both trainable and frozen parameters (LoRA's adapters and base, issue 40) lays them out as two such
  regions, trainable first, and a rank's shard is its part of each: only region 0 is reduce-scattered, so the frozen
  base gets no gradient shard or optimizer state and the trainable elements split evenly
  (``accounting.state_bytes.expected_flat_zero3_state_bytes``).
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
  reduce-scattered (async) into this rank's range, the full buffer freed. One reduction is in flight
  (``MAX_INFLIGHT_REDUCTIONS``), as with FSDP2: launching the next unit's first waits for it and averages it into the
  optimizer parameters' ``.grad``, releasing its full gradient, so backward holds the full gradients of the unit it
  reduces and the unit it computes, not the model's (ZeRO-3's memory bound: waiting only at the end kept every
  unit's, a 1.7x larger peak than FSDP2's on a 26M model; two in flight, 1.3x; one, 1.2x). The end of backward waits
  for the last.
- **Gradient accumulation**: every micro-step reduce-scatters and *adds* into ``.grad`` (the shard), so gradient
  memory stays ``4 Psi / N`` inside an accumulation window (FSDP2 without sync keeps full gradients instead); the cost
  is one reduce-scatter per micro-step. ``set_requires_gradient_sync`` is therefore not needed.

- **Pipeline stages** (``defer_reduce``): each stage module is a part of its own (a middle stage has no root unit);
  every micro-batch's backward adds the unit's full gradient into a local sum and the pipeline stage's
  ``perform_reduce_grad`` (after the stage's last backward) reduce-scatters it once. A weight tied across stages
  (embedding / LM head) is a unit of its own on both end stages, so both copies hold the same rows and the runner
  can sum their shard gradients. Split-backward schedules (zero-bubble, ZBV, DualPipeV) are refused: their
  weight-gradient pass differentiates the modules' parameters, which are the shards outside forward.
- **Experts** (EP): each MoE layer's ``experts`` module is a unit of its own inside its block's, sharded over the
  expert-data-parallel ranks (``edp``), as FSDP2 shards them; the strategy's ``expert_grad_scale`` (1/ep) applies.
- **Recompute**: a checkpointed block's hooks run outside the checkpointed region, so the pre-backward hook sets
  views of the re-gathered buffer (a leaf without hooks: autograd must save what it saved in forward) for the
  recomputation to read; units nested in a recomputed region (experts) re-run their pre-forward hook inside
  backward and stay gathered until their gradient is reduced.

Parameters are flattened after materialisation (each rank briefly holds its TP-local model). Heterogeneous meshes
are refused by ``ParallelConfig``. Checkpoint conversion: ``zero3_flat_state.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_flagscale.distributed.collectives import reduce_scatter, release_input
from lightning_flagscale.parallel.data_parallel.zero3_flat_unit import FlatUnit

__all__ = ["FlatUnit", "FlatZero3", "apply_flat_zero3", "find_flat_zero3", "summon_full_params"]

_ATTR = "_fs_flat_zero3"
MAX_INFLIGHT_REDUCTIONS = 1
"""Reduce-scatters a flat ZeRO-3 part keeps in flight during backward; each holds its unit's full gradient."""


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
        self._backward_next = {id(u): n for u, n in itertools.pairwise(backward_order)}
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
            # Backward needs the unit again when its output requires grad, whether or not its own parameters do: a
            # frozen unit (LoRA's base weights, issue 40) still multiplies the input gradients by its weights; it is
            # resharded at the end of backward, having no gradient of its own to reduce first.
            training = torch.is_grad_enabled() and (
                unit.leaf is not None or any(t.requires_grad for t in _tensors(output))
            )
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
        # Region 0 only: a unit's trainable parameters (its frozen ones, in region 1, get no gradient shard).
        out = torch.empty(unit.grad_numel, dtype=unit.reduce_dtype, device=grad.device)
        work = reduce_scatter(out, grad[: unit.grad_numel * unit.world], group=unit.group, async_op=True)
        if self.trace is not None:
            self.trace.append(("reduce_scatter", unit.index))
        self._pending.append((unit, out, work, grad))
        unit.reshard()
        while len(self._pending) > MAX_INFLIGHT_REDUCTIONS:  # the same order on every rank of the group: no deadlock
            self._complete(*self._pending.pop(0))

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

    def _complete(self, unit: FlatUnit, out: Tensor, work: dist.Work, grad: Tensor) -> None:
        """Wait for a unit's reduce-scatter, free the full gradient it read (``collectives.release_input``) and
        average the result into the shard parameters' ``.grad``."""
        work.wait()
        release_input(grad)
        if self.trace is not None:
            self.trace.append(("reduce_done", unit.index))
        out = out.div_(unit.world).to(unit.master_dtype)
        for s in unit.slots:
            if not s.shard.requires_grad:
                continue
            g = out[s.pos : s.pos + s.hi - s.lo].view(s.shard.shape)
            if s.shard.grad is None:
                s.shard.grad = g
            else:
                s.shard.grad.add_(g)

    def _finish_backward(self) -> None:
        """End of backward: wait for every reduction, average it into the shard parameters' ``.grad``."""
        self._callback_queued = False
        pending, self._pending = self._pending, []
        for entry in pending:
            self._complete(*entry)
        for unit in self.units:
            unit.backward_started = False
            unit.leaf = None
            unit.use_shards()
            unit.reshard()  # the root, and any prefetch a skipped backward left in flight

    def to(self, device: torch.device) -> None:
        """Every unit's shard to ``device`` (:meth:`FlatUnit.to`); a reduction left in flight (a backward that raised)
        is dropped. Nothing happens where the shards already are (a checkpoint during ``fit``)."""
        if all(unit.device == device for unit in self.units):
            return
        self._pending, self._callback_queued = [], False
        for unit in self.units:
            unit.to(device)

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
    names = {id(m): name for name, m in model.named_modules()}
    for unit in units:  # for the error naming a parameter unfrozen after flattening (FlatUnit._check_frozen_slots)
        unit.prefix = names.get(id(unit.module), "")
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

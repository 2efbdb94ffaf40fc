"""One flat ZeRO-3 unit: the flat layout of its parameters, this rank's shard, the full buffer and its collectives.

The hook logic that drives the units (forward, backward, prefetch, reductions) is ``zero3_flat.py``'s
:class:`FlatZero3`; the module docstring there describes the design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.distributed.collectives import all_gather
from lightning_flagscale.distributed.dtensor import num_shards

if TYPE_CHECKING:
    from lightning_flagscale.parallel.data_parallel.zero3_flat import FlatZero3

__all__ = ["FlatUnit"]


@dataclass(kw_only=True)
class _Slot:
    """One original parameter inside a unit's flat buffer."""

    name: str  # FQN relative to the unit's module (first alias)
    aliases: list[tuple[nn.Module, str]]  # every (module, attribute) that holds it (tied weights: several)
    shape: torch.Size  # local (TP-local) shape
    offset: int  # start in the full flat buffer
    row: int  # elements per dim-0 row
    dtensor: DTensor | None  # the original TP DTensor's layout (mesh, placements, global shape) over a meta tensor
    region: int = 0  # the unit's region holding it (0: trainable, 1: frozen, when a unit has both)
    shard: nn.Parameter | None = None  # this rank's rows, a view of the flat shard: what the optimizer steps
    lo: int = 0  # this rank's part of the parameter in the flat buffer: [lo, hi)
    hi: int = 0
    pos: int = 0  # where ``lo`` sits in this rank's flat shard

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _param(uses: list[tuple[str, nn.Module, str]]) -> nn.Parameter:
    return uses[0][1]._parameters[uses[0][2]]


def _layout(p: DTensor) -> DTensor:
    """``p``'s layout (mesh, placements, global shape and stride) over a meta local tensor: the slot keeps no reference
    to the original parameter, whose storage (the whole TP-local weight) is freed once the shard holds its rows."""
    local = torch.empty(p.to_local().shape, dtype=p.dtype, device="meta")
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


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
        # Trainable parameters first, frozen ones (LoRA's base, issue 40) after, each group a region of its own
        # sharded evenly over the ranks: a rank's shard is its part of each region, back to back, so the gradient
        # (region 0 only) and the optimizer state cover the trainable elements alone.
        uses_of = list(params.values())
        groups = [[u for u in uses_of if _param(u).requires_grad], [u for u in uses_of if not _param(u).requires_grad]]
        groups = [g for g in groups if g] if all(groups) else [uses_of]
        self.regions: list[tuple[int, int, int]] = []  # (start in the full buffer, shard elements, start in shard)
        base = shard_base = 0
        for region, group in enumerate(groups):
            offset, lcm = 0, 1
            for name, owner, attr in (g[0] for g in group):
                p = owner._parameters[attr]
                local = p.to_local() if isinstance(p, DTensor) else p
                row = _row(local.shape)
                offset = math.ceil(offset / row) * row  # whole rows on every rank (module docstring)
                lcm = math.lcm(lcm, row)
                uses = params[id(p)]
                self.slots.append(_Slot(name=name, aliases=[(m, a) for _, m, a in uses], shape=local.shape,
                                        offset=base + offset, row=row, region=region,
                                        dtensor=_layout(p) if isinstance(p, DTensor) else None))  # fmt: skip
                offset += local.numel()
            shard = max(1, math.ceil(offset / self.world / lcm)) * lcm
            self.regions.append((base, shard, shard_base))
            base, shard_base = base + shard * self.world, shard_base + shard
        self.numel = sum(s.numel for s in self.slots)
        self.prefix = ""  # the unit module's FQN in the model (``apply_flat_zero3``), for error messages
        # Frozen when flattened, in a unit that also trains: laid out with no gradient shard or optimizer state.
        self._frozen_slots = [s for s in self.slots if s.region == 1]
        self._split_sizes: list[int] = []  # padding gap, parameter, gap, parameter, ..., tail
        self._split_index: list[int] = []
        end = 0
        for slot in self.slots:
            self._split_sizes += [slot.offset - end, slot.numel]
            self._split_index.append(len(self._split_sizes) - 1)
            end = slot.offset + slot.numel
        self.shard_numel = shard_base
        self.padded = self.shard_numel * self.world
        self.grad_numel = self.regions[0][1]  # the reduce-scatter's output: region 0 (the trainable one when split)
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
        self._work: list[dist.Work] | None = None
        self._src: Tensor | None = None
        self.leaf: Tensor | None = None
        self.backward_started = False
        # A recompute-wrapped block (``pipeline_parallel/recompute.py``): its forward hooks run outside the checkpointed
        # region, so the recomputation in backward reads whatever the module holds: the pre-backward hook puts
        # views of the re-gathered buffer back.
        self.recompute = getattr(module, "_recompute_mode", None) not in (None, "none")
        self.grad_acc: Tensor | None = None  # full gradient summed over micro-batches (deferred reduction, PP)

    # ---- layout ----------------------------------------------------------------------------------------------
    def _fill_shard_from_params(self) -> None:
        """Copy this rank's rows of the original parameters into the shard and register the shard parameters."""
        for s in self.slots:
            p = s.aliases[0][0]._parameters[s.aliases[0][1]]
            local = (p.to_local() if isinstance(p, DTensor) else p).detach()
            base, size, shard_base = self.regions[s.region]
            start = base + self.rank * size
            s.lo, s.hi = max(s.offset, start), min(s.offset + s.numel, start + size)
            s.hi = max(s.hi, s.lo)
            s.pos = shard_base + s.lo - start
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

    def _shard_view(self, s: _Slot, flat_shard: Tensor | None = None) -> Tensor:
        flat = (self.flat_shard if flat_shard is None else flat_shard)[s.pos : s.pos + s.hi - s.lo]
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

    def to(self, device: torch.device) -> None:
        """Move this rank's shard to ``device``, the shard parameters (views of it, the module's parameters outside
        forward) and their gradients with it, and drop what only a step in progress holds (the gathered buffer, the
        flat leaf, a deferred gradient sum): the CPU in the strategy's teardown after ``fit`` (issue 37 item 1), the
        compute device again in its ``setup`` and before a checkpoint. The parameters stay the same objects (the
        optimizer's state is keyed by them). Nothing happens where the shard already is (a checkpoint during ``fit``).
        """
        if device == self.device:
            return
        self.reshard()
        self.leaf, self.grad_acc, self._src = None, None, None
        flat = self.flat_shard.to(device)
        for s in self.slots:
            shard = s.shard
            view = self._shard_view(s, flat)
            if shard.numel() and shard.data_ptr() != self._shard_view(s).data_ptr():  # replaced (``p.data = ...``)
                with torch.no_grad():
                    view.copy_(shard.detach())
            grad, shard.grad = shard.grad, None  # a parameter and its gradient never on two devices
            shard.data = view
            shard.grad = None if grad is None else grad.to(device)
        self.flat_shard, self.device = flat, device
        self.full = torch.empty(self.padded, dtype=self.param_dtype, device=device)
        self._free_storage()

    # ---- collectives -----------------------------------------------------------------------------------------
    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _regions(self, shard: Tensor, full: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
        """(full-buffer range, shard range) of each region."""
        full = self.full if full is None else full
        return [(full[b : b + n * self.world], shard[sb : sb + n]) for b, n, sb in self.regions]

    def gather(self, shard: Tensor) -> Tensor:
        """Collectively: the full flat buffer (padded layout) of a shard vector laid out like ``flat_shard``."""
        full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)
        for dst, src in self._regions(shard.contiguous(), full):
            all_gather(dst, src.contiguous(), group=self.group)
        return full

    def local_part(self, full: Tensor) -> Tensor:
        """This rank's shard vector of a full flat buffer (the inverse of :meth:`gather`)."""
        return torch.cat([full[b + self.rank * n : b + (self.rank + 1) * n] for b, n, _ in self.regions])

    def unshard_async(self, trace: list | None = None) -> None:
        """Launch the all-gather of the shards into the full buffer (no-op when gathered or in flight)."""
        if self.gathered or self._work is not None:
            return
        self._repack()
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        self._src = self.flat_shard.detach().to(self.param_dtype)
        self._work = [all_gather(dst, src, group=self.group, async_op=True) for dst, src in self._regions(self._src)]
        if trace is not None:
            trace.append(("all_gather", self.index))

    def wait(self) -> None:
        if self._work is not None:
            for work in self._work:
                work.wait()
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
            self._check_frozen_slots()
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

    def _check_frozen_slots(self) -> None:
        """Refuse a parameter unfrozen after flattening (issue 40): its unit laid it out in the frozen region, whose
        gradient is never reduced, so it would not train (or fail obscurely when its gradient is read)."""
        for s in self._frozen_slots:
            if s.shard.requires_grad:
                name = f"{self.prefix}.{s.name}" if self.prefix else s.name
                raise RuntimeError(
                    f"flat ZeRO-3: parameter '{name}' was frozen (requires_grad=False) when the strategy flattened"
                    " the model and requires grad now; its unit holds it in the frozen region, which gets no"
                    " gradient or optimizer state, so it would not train. Freeze and unfreeze parameters before the"
                    " strategy's setup (a module flattened once keeps its layout across fits), or use"
                    " zero3_impl='fsdp2'."
                )

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

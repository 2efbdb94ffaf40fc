"""Checkpoints and the optimizer interface of flat ZeRO-3 (``zero3_flat.py``).

A flat shard holds whole rows of each parameter, but not torch's ``chunk`` rows: which rows a rank holds depends on
the unit's other parameters. DCP's layout-independent format wants each parameter as a ``Shard(0)`` DTensor (what
FSDP2 writes), so saving gathers one unit's flat buffer at a time (the forward's all-gather, transient memory of one
unit) and keeps this rank's ``Shard(0)`` rows of each parameter; loading does the reverse (an all-gather of the
``Shard(0)`` rows, then this rank's range). The checkpoint is therefore sharded, keyed by FQN and byte-for-byte the
layout FSDP2 (``zero3_impl="fsdp2"``) writes: flat ZeRO-3 <-> FSDP2 <-> ZeRO-1/2 <-> DDP resume into each other.
Under TP a parameter's DTensor lives on the (dp_cp, tp) mesh with FSDP2's placements (``_StridedShard`` when TP
also splits dim 0).

:class:`FlatZero3Optimizer` gives the strategy the interface of ``DistributedOptimizer`` (checkpoint state,
``reduce_grads`` / ``sync_params`` / ``require_sync``), so the strategy treats both alike.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_flagscale.distributed.collectives import all_gather
from lightning_flagscale.parallel.data_parallel.zero3_flat import FlatZero3, find_flat_zero3
from lightning_flagscale.parallel.data_parallel.zero3_flat_unit import FlatUnit, _Slot

__all__ = ["FlatZero3Optimizer", "flat_zero3_optimizers"]


def _chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk's (and DTensor ``Shard(0)``'s) rows of ``rank``."""
    size = math.ceil(rows / world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def _size(s: _Slot, world: int, rank: int) -> int:
    """Elements of ``s`` in ``rank``'s ``Shard(0)`` rows."""
    lo, hi = _chunk(_rows(s), world, rank)
    return (hi - lo) * s.row


def _rows(s: _Slot) -> int:
    return s.shape[0] if s.shape else 1


def _contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


class _Converter:
    """Flat shard vectors <-> per-parameter ``Shard(0)`` DTensors for one flat ZeRO-3 part."""

    def __init__(self, part: FlatZero3) -> None:
        self.part = part

    def _dtensor(self, unit: FlatUnit, s: _Slot, chunk: Tensor) -> Tensor:
        # The unit's own meshes: dp x cp (and tp), or edp (and ep) for expert units, as FSDP2 shards them.
        if not s.shape:
            return DTensor.from_local(chunk.reshape(()), unit.mesh, [Replicate()], run_check=False)
        if s.dtensor is None:
            return DTensor.from_local(chunk, unit.mesh, [Shard(0)], run_check=False, shape=s.shape,
                                      stride=_contiguous_stride(s.shape))  # fmt: skip
        (tp,) = s.dtensor.placements
        dp = _StridedShard(0, split_factor=s.dtensor.device_mesh.size()) if tp == Shard(0) else Shard(0)
        mesh = unit.spmd_mesh
        return DTensor.from_local(chunk, mesh, [dp, tp], run_check=False, shape=s.dtensor.shape,
                                  stride=_contiguous_stride(s.dtensor.shape))  # fmt: skip

    def to_params(self, unit: FlatUnit, shard: Tensor) -> Iterator[tuple[_Slot, Tensor]]:
        """Collectively: each parameter's ``Shard(0)`` DTensor from the unit's flat shard vector ``shard``."""
        full = unit.gather(shard)
        for s in unit.slots:
            value = full[s.offset : s.offset + s.numel].view(_rows(s), -1)
            lo, hi = _chunk(_rows(s), unit.world, unit.rank)
            chunk = value[lo:hi].reshape(hi - lo, *s.shape[1:]).clone()
            yield s, self._dtensor(unit, s, chunk)

    def from_params(self, unit: FlatUnit, values: list[Tensor | None], dtype: torch.dtype) -> Tensor:
        """Collectively: the unit's flat shard vector from each parameter's ``Shard(0)`` value (None: zeros)."""
        per_rank = [[_size(s, unit.world, r) for s in unit.slots] for r in range(unit.world)]
        width = max(1, max(sum(row) for row in per_rank))
        local = torch.zeros(width, dtype=dtype, device=unit.device)
        offset = 0
        for value, n in zip(values, per_rank[unit.rank]):
            if value is not None and n:
                v = value.to_local() if isinstance(value, DTensor) else value
                local[offset : offset + n] = v.reshape(-1).to(dtype)
            offset += n
        gathered = torch.empty(width * unit.world, dtype=dtype, device=unit.device)
        all_gather(gathered, local, group=unit.group)
        full = torch.zeros(unit.padded, dtype=dtype, device=unit.device)
        starts = [0] * unit.world
        for i, s in enumerate(unit.slots):
            pieces = []
            for r in range(unit.world):
                n = per_rank[r][i]
                pieces.append(gathered[r * width + starts[r] : r * width + starts[r] + n])
                starts[r] += n
            full[s.offset : s.offset + s.numel] = torch.cat(pieces)
        return unit.local_part(full).clone()


class FlatZero3Optimizer:
    """The checkpoint / step interface of ``DistributedOptimizer`` for an optimizer over flat ZeRO-3 parameters.

    The optimizer itself is untouched: it already steps the shard parameters (views of the flat shards), so
    ``reduce_grads`` and ``sync_params`` have nothing to do (the end of backward waited for the reductions, the
    next forward gathers the new weights). ``require_sync`` is accepted and ignored: flat ZeRO-3 reduces every
    micro-step into the shard gradients (see ``zero3_flat.py``), which is what an accumulation window needs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, parts: list[FlatZero3]) -> None:
        self.optimizer = optimizer
        self.parts = parts
        self.converters = [_Converter(part) for part in parts]
        self.names: dict[nn.Parameter, str] = {}
        self.aliases: dict[nn.Parameter, list[str]] = defaultdict(list)
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(p, name)
            self.aliases[p].append(name)
        self.require_sync = True

    @property
    def main_params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def close(self) -> None:
        pass

    def reduce_grads(self) -> None:
        pass

    def sync_params(self, wait: bool = True) -> None:
        pass

    def wait_params(self) -> None:
        pass

    def _units(self) -> Iterator[tuple[_Converter, FlatUnit]]:
        for conv, part in zip(self.converters, self.parts):
            for unit in part.units:
                yield conv, unit

    # ---- model weights -------------------------------------------------------------------------------------------
    def master_state_dict(self) -> dict[str, Tensor]:
        """Collectively: every flat parameter (all its FQNs) as a ``Shard(0)`` DTensor of its shard dtype."""
        out: dict[str, Tensor] = {}
        for conv, unit in self._units():
            for s, value in conv.to_params(unit, unit.flat_shard.detach()):
                for name in self.aliases[s.shard]:
                    out[name] = value
        return out

    def load_model_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Collectively: set the flat shards from the ``Shard(0)`` values DCP loaded into ``state_dict``; returns
        ``state_dict`` with those entries replaced by the shard parameters themselves (for ``set_model_state_dict``)."""
        state_dict = dict(state_dict)
        for conv, unit in self._units():
            values = [state_dict.get(self.names[s.shard]) for s in unit.slots]
            flat = conv.from_params(unit, values, unit.master_dtype)
            with torch.no_grad():
                unit.flat_shard.copy_(flat)
            unit._repack()
            for s in unit.slots:
                for name in self.aliases[s.shard]:
                    state_dict[name] = s.shard.detach()
        return state_dict

    def load_master_state_dict(self, masters: dict[str, Tensor]) -> None:
        pass  # ``load_model_state`` already set the shards (before ``set_model_state_dict``)

    # ---- optimizer state -----------------------------------------------------------------------------------------
    def _flat_state(self, unit: FlatUnit, key: str) -> Tensor:
        flat = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
        for s in unit.slots:
            value = self.optimizer.state.get(s.shard, {}).get(key)
            if isinstance(value, Tensor) and value.numel() == s.shard.numel() and value.dim() > 0:
                flat[s.pos : s.pos + s.hi - s.lo] = value.reshape(-1)
        return flat

    def state_dict(self) -> dict:
        """Collectively: optimizer state keyed by FQN, each tensor a ``Shard(0)`` DTensor shaped like its parameter."""
        opt = self.optimizer
        state: dict[str, dict[str, Any]] = defaultdict(dict)
        keys = sorted({k for s in opt.state.values() for k, v in s.items() if isinstance(v, Tensor) and v.dim() > 0})
        keys = _agree(keys)
        for conv, unit in self._units():
            for key in keys:
                for s, value in conv.to_params(unit, self._flat_state(unit, key)):
                    if s.shard.requires_grad:  # frozen parameters (LoRA's base) have no optimizer state
                        state[self.names[s.shard]][key] = value
            for s in unit.slots:
                for key, value in opt.state.get(s.shard, {}).items():
                    if not (isinstance(value, Tensor) and value.dim() > 0):
                        state[self.names[s.shard]][key] = value.clone() if isinstance(value, Tensor) else value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self.names[p] for p in g["params"]]}
                  for g in opt.param_groups]  # fmt: skip
        return {"state": dict(state), "param_groups": groups}

    def state_dict_template(self, example_state_keys: Iterable[str] = ("exp_avg", "exp_avg_sq")) -> dict:
        """An empty ``state_dict``-format dict in this layout, for ``dcp.load`` to fill in place."""
        template: dict[str, dict[str, Tensor]] = defaultdict(dict)
        keys = list(example_state_keys)
        for conv, unit in self._units():
            zeros = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
            for key in keys:
                for s, value in conv.to_params(unit, zeros):
                    if s.shard.requires_grad:
                        template[self.names[s.shard]][key] = value
            for s in unit.slots:
                if s.shard.requires_grad:
                    template[self.names[s.shard]]["step"] = torch.zeros((), dtype=torch.float32)
        return {"state": dict(template)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Collectively: load a ``state_dict``-format dict (filled by DCP for this layout) into the optimizer."""
        state = state_dict["state"]
        keys = _agree(
            sorted({k for s in state.values() for k, v in s.items() if isinstance(v, Tensor) and v.dim() > 0})
        )
        for conv, unit in self._units():
            for key in keys:
                values = [state.get(self.names[s.shard], {}).get(key) for s in unit.slots]
                flat = conv.from_params(unit, values, torch.float32)
                for s in unit.slots:
                    if key in state.get(self.names[s.shard], {}):
                        view = flat[s.pos : s.pos + s.hi - s.lo].view(s.shard.shape)
                        self.optimizer.state[s.shard][key] = view.to(s.shard.dtype).clone()
            for s in unit.slots:
                for key, value in state.get(self.names[s.shard], {}).items():
                    if not (isinstance(value, Tensor) and value.dim() > 0):
                        self.optimizer.state[s.shard][key] = value.clone() if isinstance(value, Tensor) else value


def _agree(keys: list[str]) -> list[str]:
    """The union of state keys over all ranks (a rank whose shards are all empty may have none)."""
    if not dist.is_initialized():
        return keys
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    return sorted(set().union(*gathered))


def flat_zero3_optimizers(optimizers: Iterable[torch.optim.Optimizer], module: nn.Module) -> dict[int, Any]:
    """The flat ZeRO-3 interface around each optimizer (keyed by ``id``); {} when ``module`` has no flat parts."""
    parts = find_flat_zero3(module)
    if not parts:
        return {}
    return {id(opt): FlatZero3Optimizer(opt, module, parts) for opt in optimizers}

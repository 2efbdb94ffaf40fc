"""Communication accounting: calls and bytes of every collective and P2P op issued by this process.

``CommTracker`` is a context manager. Inside its window it pushes a ``TorchDispatchMode`` that sees every
``torch.ops.c10d.*`` op (what the c10d Python API -- ``dist.all_reduce``, ``all_gather_into_tensor``,
``send``/``recv``, ``batch_isend_irecv``, ... -- lowers to, and therefore also FSDP2 and
``torch.distributed.pipelining``) and every ``torch.ops._c10d_functional.*`` op (DTensor redistribution and
functional collectives). This is the mechanism of torch's own ``CommDebugMode``
(``torch/distributed/tensor/debug/_comm_mode.py``), but recording bytes and the process group instead of module
attribution. Nothing is patched, and outside a window no mode is on the dispatch stack, so there is no cost.

For each op it records, per process group:

- ``calls``;
- ``payload_bytes``: bytes of the tensor(s) this rank hands to the op as its input (all_reduce/broadcast/send:
  the tensor; all_gather: the local shard; reduce_scatter/all_to_all: the full local input; recv: the buffer
  received into; scatter: the root's whole input list, a non-root's output buffer; barrier: 0);
- ``wire_bytes``: bytes this rank moves under the standard ring/bandwidth model (Thakur et al. 2005; the model
  behind the ZeRO paper's 2Ψ and 3Ψ), with ``N`` the group size:

  ==============  =====================================================================================
  all_reduce      2(N-1)/N x size (ring reduce-scatter + all-gather)
  all_gather      (N-1)/N x output size
  reduce_scatter  (N-1)/N x input size
  all_to_all      bytes of the input sent off-rank: (N-1)/N x input size for even splits, else the sum
                  of the other ranks' input splits
  broadcast       size (pipelined broadcast: every rank receives, relays or sends the tensor once)
  reduce          size (the mirror of broadcast)
  gather          root: (N-1) x input size received; others: input size sent
  scatter         root: the other ranks' input slots sent; others: output size received
  send / recv     size
  barrier         0
  ==============  =====================================================================================

  A group of size 1 moves 0 bytes whatever the op.

Async ops (``async_op=True``, functional collectives) are counted once, when issued; ``wait`` and
``wait_tensor`` are not counted. The mode is thread-local like every dispatch mode: ops of the autograd engine
inherit it (so FSDP2's backward reduce-scatters are seen); ops issued from other Python threads are not.
Inside a window every op (not only collectives) takes a trip through Python dispatch, so time steps outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CommTracker",
    "OpStats",
    "format_table",
    "gather_summaries",
    "merge_summaries",
    "traffic_class",
]


@dataclass
class OpStats:
    """Accumulated counters of one op on one process group."""

    calls: int = 0
    """Number of times the op was issued."""
    payload_bytes: int = 0
    """Bytes of the tensors handed to the op by this rank (see module docstring)."""
    wire_bytes: float = 0.0
    """Bytes moved by this rank under the ring/bandwidth model (see module docstring)."""

    def add(self, payload: int, wire: float) -> None:
        self.calls += 1
        self.payload_bytes += payload
        self.wire_bytes += wire


@dataclass(frozen=True)
class _Group:
    """What the accounting needs to know about a process group, resolved once per group."""

    name: str
    desc: str
    ranks: tuple[int, ...]
    size: int
    rank: int


# --------------------------------------------------------------------------------------------------------------------
# Per-op byte rules: (bound arguments, group) -> (payload bytes, wire bytes)
# --------------------------------------------------------------------------------------------------------------------


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _ring(factor: int, nbytes: int, g: _Group) -> float:
    # factor * (N-1)/N * nbytes, computed in integers first so divisible sizes give exact floats.
    return factor * (g.size - 1) * nbytes / g.size


def _all_reduce(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    size = _nbytes(a.get("tensors", a.get("input", a.get("inputs"))))
    return size, _ring(2, size, g)


def _all_gather_c10d(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    out = a.get("output_tensor", a.get("output_tensors", a.get("output_lists", a.get("outputs"))))
    inp = a.get("input_tensor", a.get("input_tensors", a.get("input_list", a.get("inputs"))))
    return _nbytes(inp), _ring(1, _nbytes(out), g)


def _all_gather_functional(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    size = _nbytes(a.get("input", a.get("inputs")))
    # The output is group_size x input; (N-1)/N of it arrives from the other ranks.
    return size, float((g.size - 1) * size)


def _reduce_scatter(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    size = _nbytes(a.get("input_tensor", a.get("input_tensors", a.get("input", a.get("inputs")))))
    return size, _ring(1, size, g)


def _whole(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    """broadcast, reduce, send, recv: the tensor crosses the wire once."""
    size = _nbytes(a.get("tensors", a.get("input", a.get("tensor"))))
    return size, float(size)


def _all_to_all_single(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    inp: torch.Tensor = a.get("input")  # type: ignore[assignment]
    size = _nbytes(inp)
    splits = [int(s) for s in (a.get("input_split_sizes") or [])]
    if not splits:
        return size, _ring(1, size, g)
    row_bytes = size // inp.shape[0] if inp.dim() > 0 and inp.shape[0] > 0 else 0
    return size, float((sum(splits) - splits[g.rank]) * row_bytes)


def _all_to_all_list(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    inputs = a["input_tensors"]
    off_rank = sum(_nbytes(t) for i, t in enumerate(inputs) if i != g.rank)
    return _nbytes(inputs), float(off_rank)


def _gather(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    size = _nbytes(a["input_tensors"])
    return size, float(size * (g.size - 1) if g.rank == a["root_rank"] else size)


def _scatter(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    if g.rank == a["root_rank"]:
        slots = a["input_tensors"][0] if a["input_tensors"] else []
        size = _nbytes(slots)
        return size, float(size - (_nbytes(slots[g.rank]) if slots else 0))
    size = _nbytes(a["output_tensors"])
    return size, float(size)


def _barrier(a: dict[str, Any], g: _Group) -> tuple[int, float]:
    return 0, 0.0


_Rule = Callable[[dict[str, Any], _Group], tuple[int, float]]

# Keys are ``OpOverloadPacket``-qualified names ("namespace::name"); values are (logical op name, byte rule).
_C10D: dict[str, tuple[str, _Rule]] = {
    "allreduce_": ("all_reduce", _all_reduce),
    "allreduce_coalesced_": ("all_reduce", _all_reduce),
    "_allgather_base_": ("all_gather", _all_gather_c10d),
    "allgather_": ("all_gather", _all_gather_c10d),
    "allgather_coalesced_": ("all_gather", _all_gather_c10d),
    "allgather_into_tensor_coalesced_": ("all_gather", _all_gather_c10d),
    "_reduce_scatter_base_": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", _reduce_scatter),
    "alltoall_base_": ("all_to_all", _all_to_all_single),
    "alltoall_": ("all_to_all", _all_to_all_list),
    "broadcast_": ("broadcast", _whole),
    "reduce_": ("reduce", _whole),
    "gather_": ("gather", _gather),
    "scatter_": ("scatter", _scatter),
    "send": ("send", _whole),
    "recv_": ("recv", _whole),
    "recv_any_source_": ("recv", _whole),
    "barrier": ("barrier", _barrier),
    "monitored_barrier_": ("barrier", _barrier),
}
_FUNCTIONAL: dict[str, tuple[str, _Rule]] = {
    "all_reduce": ("all_reduce", _all_reduce),
    "all_reduce_": ("all_reduce", _all_reduce),
    "all_reduce_coalesced": ("all_reduce", _all_reduce),
    "all_reduce_coalesced_": ("all_reduce", _all_reduce),
    "all_gather_into_tensor": ("all_gather", _all_gather_functional),
    "all_gather_into_tensor_out": ("all_gather", _all_gather_functional),
    "all_gather_into_tensor_coalesced": ("all_gather", _all_gather_functional),
    "reduce_scatter_tensor": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_tensor_out": ("reduce_scatter", _reduce_scatter),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _reduce_scatter),
    "all_to_all_single": ("all_to_all", _all_to_all_single),
    "broadcast": ("broadcast", _whole),
    "broadcast_": ("broadcast", _whole),
    "isend": ("send", _whole),
    "irecv": ("recv", _whole),
    # batch_p2p_ops is split into its sends and receives in ``_CommMode._record``.
}
# Called directly, a ``_c10d_functional_autograd`` op reaches the mode as itself (its inner functional op runs
# below the mode and is not seen again), so it is counted like its ``_c10d_functional`` twin.
_FUNCTIONAL_AUTOGRAD: dict[str, tuple[str, _Rule]] = {
    name: _FUNCTIONAL[name] for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
}
_TABLES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL, "_c10d_functional_autograd": _FUNCTIONAL_AUTOGRAD}


def _bind(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in, so byte rules do not depend on positional layouts."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


# --------------------------------------------------------------------------------------------------------------------
# The dispatch mode and the tracker
# --------------------------------------------------------------------------------------------------------------------


class _CommMode(TorchDispatchMode):
    """Records c10d and functional collective ops into its tracker; runs every op unchanged."""

    def __init__(self, tracker: CommTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # A DTensor must first desugar into ops on plain tensors -- its redistribution collectives -- which then
        # come back through this mode; returning NotImplemented lets it run. Other subclasses (the fake tensors
        # DTensor's sharding propagation runs an op on the first time it sees it) run as they are, unrecorded:
        # refusing them left that propagation with no handler at all.
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        table = _TABLES.get(func.namespace)
        if table is not None:
            self._record(func, table, args, kwargs)
        return out

    def _record(
        self,
        func: torch._ops.OpOverload,
        table: dict[str, tuple[str, _Rule]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        name = func._schema.name.split("::")[1]
        bound = _bind(func, args, kwargs)
        if table is _FUNCTIONAL and name == "batch_p2p_ops":
            group = self.tracker._group(bound["group_name"])
            for kind, tensor in zip(bound["op_list"], bound["tensors"]):
                op = "send" if "send" in kind else "recv"
                self.tracker._add(group, op, _nbytes(tensor), float(_nbytes(tensor)) if group.size > 1 else 0.0)
            return
        if name not in table:
            return  # wait_tensor, _wrap_tensor_autograd, check_for_nan: not communication
        op, rule = table[name]
        group = self.tracker._group(bound.get("process_group", bound.get("group_name")))
        payload, wire = rule(bound, group)
        self.tracker._add(group, op, payload, wire if group.size > 1 else 0.0)


class CommTracker:
    """Counts calls, payload bytes and wire bytes of every collective and P2P op issued inside its window.

    Example::

        with CommTracker() as comm:
            loss = model(batch).sum()
            loss.backward()
        print(comm.table())
        dp_bytes = comm.total_wire_bytes(mesh["dp"].get_group())

    A tracker can be entered several times; counts accumulate until ``reset()``.
    """

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._stats: dict[str, dict[str, OpStats]] = {}
        self._modes: list[_CommMode] = []

    # ---- window ----
    def __enter__(self) -> CommTracker:
        mode = _CommMode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        self._modes.pop().__exit__(*exc)

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._stats.clear()

    # ---- recording (called by the mode) ----
    def _group(self, pg: Any) -> _Group:
        if isinstance(pg, torch.ScriptObject):
            pg = dist.ProcessGroup.unbox(pg)
        if isinstance(pg, str):
            name = pg
            if name in self._groups:
                return self._groups[name]
            pg = dist.distributed_c10d._resolve_process_group(name)
        name = _group_key(pg)
        if name not in self._groups:
            self._groups[name] = _resolve_group(pg)
        return self._groups[name]

    def _add(self, group: _Group, op: str, payload: int, wire: float) -> None:
        self._stats.setdefault(group.name, {}).setdefault(op, OpStats()).add(payload, wire)

    # ---- reading ----
    def summary(self) -> dict[str, dict[str, Any]]:
        """``{group name: {"desc", "ranks", "size", "ops": {op: {"calls", "payload_bytes", "wire_bytes"}}}}``.

        Plain, picklable data (for ``gather_summaries``/``merge_summaries`` and JSON reports).
        """
        out: dict[str, dict[str, Any]] = {}
        for name, ops in self._stats.items():
            g = self._groups[name]
            out[name] = {
                "desc": g.desc,
                "ranks": list(g.ranks),
                "size": g.size,
                "ops": {op: asdict(stats) for op, stats in sorted(ops.items())},
            }
        return out

    def stats(self, op: str, group: dist.ProcessGroup | str | None = None) -> OpStats:
        """Counters of ``op`` (e.g. ``"all_gather"``) summed over the matching groups (see ``total_wire_bytes``)."""
        total = OpStats()
        for name in self._matching(group):
            s = self._stats[name].get(op)
            if s is not None:
                total.calls += s.calls
                total.payload_bytes += s.payload_bytes
                total.wire_bytes += s.wire_bytes
        return total

    def total_wire_bytes(self, group: dist.ProcessGroup | str | None = None) -> float:
        """Wire bytes of all ops on ``group``: a ``ProcessGroup``, a group name or description (e.g.
        ``"mesh_dp"``, summing every group that matches), or ``None`` for every group."""
        return sum(s.wire_bytes for name in self._matching(group) for s in self._stats[name].values())

    def table(self) -> str:
        """Human-readable table of ``summary()``."""
        return format_table(self.summary())

    def _matching(self, group: dist.ProcessGroup | str | None) -> list[str]:
        if group is None:
            return list(self._stats)
        if isinstance(group, str):
            return [n for n in self._stats if group in (n, self._groups[n].desc)]
        return [n for n in self._stats if n == _group_key(group)]


def traffic_class(desc: str, op: str) -> str:
    """``"dp"``, ``"tp"`` or ``"pp"``: which parallelism a group's traffic belongs to, from its description (the mesh
    dim name, ours or Lightning's); point-to-point ops are pipeline traffic on any group."""
    d = desc.lower()
    if op in ("send", "recv") or "pp" in d.split("_") or "pipe" in d:
        return "pp"
    if "tp" in d.split("_") or "tensor" in d:
        return "tp"
    return "dp"


def _group_key(pg: dist.ProcessGroup) -> str:
    # Groups built outside ``dist.new_group`` (a bare backend object) may be unnamed: key them by size.
    return pg.group_name or f"unnamed(size={pg.size()})"


def _resolve_group(pg: dist.ProcessGroup) -> _Group:
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError, KeyError):
        # A group unknown to the Python world registry (created in C++): its global ranks are not known.
        ranks = ()
    return _Group(
        name=_group_key(pg),
        desc=getattr(pg, "group_desc", ""),
        ranks=ranks,
        size=pg.size(),
        rank=pg.rank(),
    )


# --------------------------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------------------------


def gather_summaries(
    tracker: CommTracker | dict[str, Any], group: dist.ProcessGroup | None = None
) -> list[dict[str, Any]]:
    """Every rank's summary, indexed by rank in ``group`` (``all_gather_object``, a collective: call it on every
    rank, OUTSIDE the tracker's window or it counts itself)."""
    summary = tracker.summary() if isinstance(tracker, CommTracker) else tracker
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, summary, group=group)
    return out


def merge_summaries(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge per-rank summaries: per group and op, ``calls``/``payload_bytes``/``wire_bytes`` summed over the
    ranks that reported, plus ``max_rank_wire_bytes`` (the busiest rank: the time-relevant figure) and, per group,
    ``reporting`` (how many ranks reported it). Groups are matched by name and ranks."""
    merged: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for name, g in summary.items():
            key = name
            if key in merged and merged[key]["ranks"] != g["ranks"]:
                key = f"{name}{g['ranks']}"
            entry = merged.setdefault(
                key, {"desc": g["desc"], "ranks": list(g["ranks"]), "size": g["size"], "reporting": 0, "ops": {}}
            )
            entry["reporting"] += 1
            for op, s in g["ops"].items():
                m = entry["ops"].setdefault(
                    op, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0, "max_rank_wire_bytes": 0.0}
                )
                m["calls"] += s["calls"]
                m["payload_bytes"] += s["payload_bytes"]
                m["wire_bytes"] += s["wire_bytes"]
                m["max_rank_wire_bytes"] = max(m["max_rank_wire_bytes"], s["wire_bytes"])
    return merged


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Render a ``summary()`` or ``merge_summaries()`` result as an aligned text table."""
    merged = any("max_rank_wire_bytes" in s for g in summary.values() for s in g["ops"].values())
    header = ["group", "ranks", "op", "calls", "payload", "wire"] + (["wire (busiest rank)"] if merged else [])
    rows: list[list[str]] = []
    for name, g in summary.items():
        label = f"{g['desc'] or 'group'}#{name}"
        ranks = _ranks_str(g["ranks"])
        for op, s in g["ops"].items():
            row = [label, ranks, op, str(s["calls"]), _human(s["payload_bytes"]), _human(s["wire_bytes"])]
            rows.append(row + ([_human(s["max_rank_wire_bytes"])] if merged else []))
    if not rows:
        return "(no communication)"
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    total = sum(s["wire_bytes"] for g in summary.values() for s in g["ops"].values())
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"total wire: {_human(total)}")
    return "\n".join(lines)


def _ranks_str(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if ranks else "?"

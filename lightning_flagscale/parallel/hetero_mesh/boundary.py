"""Crossing a heterogeneous mesh boundary: which rank sends which slice to whom, and the P2P that does it.

Each pipeline stage group (``config/hetero.py``) lays its ranks out ``(dp, cp, tp)`` with tp fastest. A rank holds
one block of every activation tensor ``[batch, sequence, ...]`` that crosses a boundary:

* **batch rows**: data-parallel rank ``i`` of ``dp`` holds rows ``[i b/dp, (i+1) b/dp)`` of the micro-batch;
* **context shard**: context-parallel rank ``c`` holds chunks ``c`` and ``2 cp - 1 - c`` of the sequence (the
  load-balanced zigzag of ``parallel/context_parallel/attention.py``). CP is equal on every mesh and every mesh uses the same zigzag,
  so a token's CP rank is the same on both sides and CP rank ``c`` only ever talks to CP rank ``c``;
* **sequence-parallel shard**: with sequence parallelism and ``tp > 1`` the activations between blocks are split
  along the (CP-local) sequence over TP: TP rank ``t`` holds ``[t L/tp, (t+1) L/tp)``; otherwise every TP rank holds
  the whole CP-local sequence (a replica).

A receiver gets every piece it needs exactly once: the intersection of its rows with each overlapping sender's
rows, times the intersection of its sequence range with the sender's (a replicated sender side is served round
robin over the receiving ranks). Gradients flow back with the roles swapped, so the same
function plans both directions.

::

    send: TP=2, SP, DP=1 (ranks 0, 1)              recv: TP=1, DP=2 (ranks 2, 3)
             seq [0, L/2)   seq [L/2, L)
    rows [0, b)  rank 0        rank 1      ---->   rank 2: rows [0, b/2) x seq [0, L) = 2 pieces (from 0 and 1)
                                                   rank 3: rows [b/2, b) x seq [0, L) = 2 pieces (from 0 and 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flagscale.config.hetero import StageGroup

__all__ = ["BoundaryComm", "Transfer", "boundary_transfers", "coords", "gradient_transfers", "rank_at"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 10  # dtype, ndim, shape (up to 8 dims)


def coords(group: StageGroup, rank: int) -> tuple[int, int, int]:
    """(dp, cp, tp) indices of a global rank inside its group (layout dp, cp, tp with tp fastest)."""
    local = group.local_index(rank)  # ranks may be permuted by device type (hetero_ranks.py)
    tp, cp = group.tensor_parallel_size, group.context_parallel_size
    return local // (tp * cp), (local // tp) % cp, local % tp


def rank_at(group: StageGroup, dp: int, cp: int, tp: int) -> int:
    return group.ranks[(dp * group.context_parallel_size + cp) * group.tensor_parallel_size + tp]


@dataclass(frozen=True)
class Transfer:
    """Rows ``[src_lo, src_hi)`` of the source's slice go to rows from ``dst_lo`` of the destination's; along the
    sequence, units ``[seq_lo, seq_hi)`` of ``seq_den`` units of the CP-local sequence (all of it when
    ``seq_den == 1``); the source's own shard is units ``[src_seq, src_seq + src_span)``."""

    src: int
    dst: int
    src_lo: int
    src_hi: int
    dst_lo: int
    seq_lo: int = 0
    seq_hi: int = 1
    seq_den: int = 1
    src_seq: int = 0
    src_span: int = 1


def _seq_shards(group: StageGroup) -> int:
    """How many sequence shards the group's TP ranks hold (1: every TP rank holds the whole CP-local sequence)."""
    return group.tensor_parallel_size if group.sequence_parallel else 1


def _plan(src: StageGroup, dst: StageGroup, rows: int) -> list[Transfer]:
    """Pieces moving from ``src``'s ranks to ``dst``'s so that every ``dst`` rank gets its block exactly once."""
    if rows % src.data_parallel_size or rows % dst.data_parallel_size:
        raise ValueError(
            f"A micro-batch of {rows} samples cannot be split over data-parallel sizes {src.data_parallel_size} and"
            f" {dst.data_parallel_size}; make the samples per micro-batch a multiple of both."
        )
    if src.context_parallel_size != dst.context_parallel_size:
        raise ValueError("context_parallel_size must be equal on every heterogeneous mesh.")
    ss, sd = _seq_shards(src), _seq_shards(dst)
    den = math.lcm(ss, sd) if (ss > 1 or sd > 1) else 1
    cs, cd = rows // src.data_parallel_size, rows // dst.data_parallel_size
    out = []
    for dst_rank in dst.ranks:
        j, c, u = coords(dst, dst_rank)
        d_lo, d_hi = (u * den // sd, (u + 1) * den // sd) if sd > 1 else (0, den)
        for i in range(src.data_parallel_size):
            lo, hi = max(i * cs, j * cd), min((i + 1) * cs, (j + 1) * cd)
            if lo >= hi:
                continue
            if ss > 1:  # sequence shards: every source TP rank whose range overlaps
                sources = [(t, t * den // ss, (t + 1) * den // ss) for t in range(ss)]
            else:  # replicas: one of them, round robin over the destination ranks (spreads the sends)
                sources = [(dst.local_index(dst_rank) % src.tensor_parallel_size, 0, den)]
            for t, s_lo, s_hi in sources:
                q_lo, q_hi = max(s_lo, d_lo), min(s_hi, d_hi)
                if q_lo >= q_hi:
                    continue
                src_rank = rank_at(src, i, c, t)
                out.append(
                    Transfer(
                        src_rank, dst_rank, lo - i * cs, hi - i * cs, lo - j * cd, q_lo, q_hi, den, s_lo, s_hi - s_lo
                    )
                )
    return out


def boundary_transfers(send: StageGroup, recv: StageGroup, rows: int) -> list[Transfer]:
    """Forward transfers of one micro-batch of ``rows`` samples from group ``send`` to group ``recv``."""
    return _plan(send, recv, rows)


def gradient_transfers(send: StageGroup, recv: StageGroup, rows: int) -> list[Transfer]:
    """Backward transfers: input gradients from ``recv``'s ranks back to every rank of ``send`` that needs them.

    Without sequence parallelism each TP rank of ``recv`` holds the whole input gradient (the TP region's input
    all-reduces it), so a replica serves; with it, each holds its sequence shard's.
    """
    return _plan(recv, send, rows)


class BoundaryComm:
    """Asynchronous sends, blocking receives, pieces cut and reassembled along batch and sequence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[dist.Work] = []
        self._keep: list[Tensor] = []  # send buffers, alive until their sends complete

    def send(self, tensor: Tensor, transfers: list[Transfer], tag: int) -> None:
        me = dist.get_rank()
        for tr in transfers:
            if tr.src != me:
                continue
            part = tensor[tr.src_lo : tr.src_hi]
            if tr.seq_den > 1:
                unit = tensor.shape[1] // tr.src_span
                part = part[:, (tr.seq_lo - tr.src_seq) * unit : (tr.seq_hi - tr.src_seq) * unit]
            part = part.contiguous()
            header = torch.tensor([_DTYPES.index(part.dtype), part.dim(), *part.shape], dtype=torch.int64)
            header = torch.nn.functional.pad(header, (0, _HEADER - header.numel()))
            self._pending.append(dist.isend(header, tr.dst, tag=tag))
            self._pending.append(dist.isend(part, tr.dst, tag=tag))
            self._keep += [header, part]

    def recv(self, transfers: list[Transfer], tag: int) -> Tensor:
        me = dist.get_rank()
        parts = []
        for tr in transfers:
            if tr.dst != me:
                continue
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, tr.src, tag=tag)
            dtype, ndim = _DTYPES[int(header[0])], int(header[1])
            buf = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=dtype, device=self.device)
            dist.recv(buf, tr.src, tag=tag)
            parts.append((tr.dst_lo, tr.seq_lo, buf))
        parts.sort(key=lambda p: (p[0], p[1]))
        blocks: dict[int, list[Tensor]] = {}
        for row, _, buf in parts:  # a grid: the same sequence pieces for every block of rows
            blocks.setdefault(row, []).append(buf)
        rows = [torch.cat(bufs, dim=1) if len(bufs) > 1 else bufs[0] for bufs in blocks.values()]
        return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]

    def wait(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending, self._keep = [], []

"""How one of our tensors is made of Hugging Face tensors, readable box by box and invertible for export.

A converter family maps every parameter FQN of our ``CausalLM`` to a *spec* over checkpoint tensor names:

- ``Direct(name)``: the same tensor; with ``pad_rows`` our dim 0 may be longer (TP vocab padding, zero rows).
- ``Stack(parts)``: our dim 0 indexes a list of equally shaped specs (grouped experts, one HF tensor each or a
  ``Concat`` of gate and up).
- ``Concat(names, dim)``: HF tensors concatenated along ``dim`` (fused projections).

Import asks a spec for a *box* (global offset + size per dim, the local shard of a DTensor) and the spec reads
only the HF slices that intersect it, so a rank's I/O and peak memory follow its shard (issue 6). Export runs
the inverse on full tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Box", "Concat", "Direct", "ReadFn", "Spec", "Stack", "full_box", "hf_names"]

Box = tuple[tuple[int, int], ...]
"""Per dimension ``(start, stop)`` of a region of our global tensor."""

ReadFn = Callable[[str, Box], torch.Tensor]
"""``read(hf_name, box)`` returns ``hf_tensor[box]`` reading only that region."""

ShapeFn = Callable[[str], tuple[int, ...]]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


@dataclass(frozen=True)
class Direct:
    """Our tensor is HF tensor ``name``; with ``pad_rows`` rows past the HF row count are zero (vocab padding)."""

    name: str
    pad_rows: bool = False

    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def global_shape(self, hf_shape: ShapeFn, our_shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(hf_shape(self.name))
        if self.pad_rows and len(our_shape) == len(shape) and our_shape[0] >= shape[0]:
            return (int(our_shape[0]), *shape[1:])
        return shape

    def read(self, read: ReadFn, hf_shape: ShapeFn, box: Box, dtype: torch.dtype) -> torch.Tensor:
        rows = hf_shape(self.name)[0]
        (start, stop), rest = box[0], box[1:]
        if not self.pad_rows or stop <= rows:
            return read(self.name, box).to(dtype)
        out = torch.zeros([stop - start, *(b - a for a, b in rest)], dtype=dtype)
        if start < rows:
            out[: rows - start] = read(self.name, ((start, rows), *rest)).to(dtype)
        return out

    def split(self, full: torch.Tensor, hf_rows: int | None) -> dict[str, torch.Tensor]:
        if self.pad_rows and hf_rows is not None:
            full = full[:hf_rows]
        return {self.name: full}


@dataclass(frozen=True)
class Stack:
    """Our dim 0 indexes ``parts``: part ``e`` (a spec, e.g. one expert's tensor) is our slice ``[e]``.

    Under expert parallelism a rank's box covers only its experts' range of dim 0, so only their files are read.
    """

    parts: tuple[Spec, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(n for part in self.parts for n in part.names())

    def global_shape(self, hf_shape: ShapeFn, our_shape: Sequence[int]) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].global_shape(hf_shape, tuple(our_shape[1:])))

    def read(self, read: ReadFn, hf_shape: ShapeFn, box: Box, dtype: torch.dtype) -> torch.Tensor:
        (start, stop), rest = box[0], box[1:]
        return torch.stack([self.parts[i].read(read, hf_shape, rest, dtype) for i in range(start, stop)])

    def split(self, full: torch.Tensor, hf_rows: int | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part, piece in zip(self.parts, full.unbind(0)):
            out.update(part.split(piece, hf_rows))
        return out


@dataclass(frozen=True)
class Concat:
    """HF tensors ``names`` concatenated along ``dim`` (fused projections such as gate/up)."""

    names_: tuple[str, ...]
    sizes: tuple[int, ...]
    """Extent of each part along ``dim`` (from the config), used to split on export."""
    dim: int = 0

    def names(self) -> tuple[str, ...]:
        return self.names_

    def global_shape(self, hf_shape: ShapeFn, our_shape: Sequence[int]) -> tuple[int, ...]:
        shapes = [list(hf_shape(n)) for n in self.names_]
        out = shapes[0]
        out[self.dim] = sum(s[self.dim] for s in shapes)
        return tuple(out)

    def read(self, read: ReadFn, hf_shape: ShapeFn, box: Box, dtype: torch.dtype) -> torch.Tensor:
        start, stop = box[self.dim]
        parts, offset = [], 0
        for name in self.names_:
            size = hf_shape(name)[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:  # only the parts this shard intersects are read
                sub = list(box)
                sub[self.dim] = (lo - offset, hi - offset)
                parts.append(read(name, tuple(sub)).to(dtype))
            offset += size
        return torch.cat(parts, dim=self.dim)

    def split(self, full: torch.Tensor, hf_rows: int | None) -> dict[str, torch.Tensor]:
        return dict(zip(self.names_, full.split(list(self.sizes), dim=self.dim)))


Spec = Direct | Stack | Concat


def hf_names(specs: dict[str, Spec]) -> list[str]:
    """Every HF tensor name the specs consume, in a stable order."""
    seen: dict[str, None] = {}
    for spec in specs.values():
        for name in spec.names():
            seen.setdefault(name)
    return list(seen)

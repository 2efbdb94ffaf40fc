"""Measured memory, to check the memory model against: an allocator counter and a saved-activation counter.

* :class:`AllocationPeak` counts every CPU (and CUDA) allocation and free the PyTorch allocator reports to
  ``torch.profiler`` (``profile_memory=True``): ``peak_bytes`` is the highest number of bytes allocated *above the
  level at entry* while the block ran; ``net_bytes`` what was still allocated at exit. It sees temporaries,
  gradients, communication buffers and saved activations alike, whatever allocated them (autograd, collectives,
  the optimizer), on the thread that entered the block: the profiler's memory events are per thread, so what
  another thread allocates or frees is not seen (measured: an 8 MiB tensor allocated on a second thread is missing,
  and a 4 MiB tensor of this thread freed on a second thread stays counted in ``net_bytes``). Under gloo this
  matters when a collective's worker thread drops the last reference to a buffer. Such a free is recovered when the
  address comes back: two blocks cannot be alive at one address, so a block never seen freed whose address is
  allocated again on this thread was freed before that reuse, and is taken off there (:func:`allocation_levels`).
  A block freed elsewhere whose address is never reused stays counted: ``net_bytes`` > 0 after a steady-state step
  bounds how much the peak may still be overstated.
* :class:`SavedActivations` counts the bytes autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  each storage once and parameters excluded: the quantity the activation formulas of ``tune.activations`` predict.
  It sees what ``torch.compile``d regions keep too: AOTAutograd's compiled function saves its forward graph's outputs
  for backward through ``ctx.save_for_backward``, which the hooks pack (``tests/test_tune_compile.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocationPeak", "SavedActivations", "allocation_levels"]


class AllocationPeak:
    """``with AllocationPeak() as m: ...`` then ``m.peak_bytes`` / ``m.net_bytes`` (allocator events, see module doc)."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.net_bytes = 0
        self._prof: profile | None = None

    def __enter__(self) -> AllocationPeak:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            fields = e.extra_fields
            if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
                events.append((e.start_time_ns, (str(fields.device), fields.ptr), fields.alloc_size))
        self.peak_bytes, self.net_bytes = allocation_levels(events)
        self._prof = None


def allocation_levels(events: Iterable[tuple[int, object, int]]) -> tuple[int, int]:
    """(peak, final) bytes above the starting level of allocator events ``(time, address, +bytes | -bytes)``.

    A free of a block allocated before the events started lowers the level by its size. An allocation at an address
    whose block is still alive (its free was made where the events do not see it) first frees that block.
    """
    alive: dict[object, int] = {}
    current = peak = 0
    for _, address, nbytes in sorted(events, key=lambda e: (e[0], e[2] >= 0)):  # a free first at one instant
        if nbytes >= 0:
            current += nbytes - alive.pop(address, 0)
            alive[address] = nbytes
        else:
            current -= alive.pop(address, -nbytes)
        peak = max(peak, current)
    return peak, current


class SavedActivations:
    """Bytes of tensors autograd saves for backward while the block runs (unique storages, parameters excluded).

    ``peak_bytes`` is the largest total alive at once, ``total_bytes`` all storages ever saved (a forward without
    backward inside the block: the two agree).
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._params = {_key(p) for p in params}
        self._alive: dict[tuple[str, int], int] = {}
        self.peak_bytes = 0
        self.total_bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @classmethod
    def of_module(cls, module: nn.Module) -> SavedActivations:
        return cls(module.parameters())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self._params and key not in self._alive and t.device.type != "meta":
            # a DTensor's own storage has its global size: count its shard, what this rank holds
            storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            self._alive[key] = storage.nbytes()
            self.total_bytes += storage.nbytes()
            weakref.finalize(storage, self._alive.pop, key, None)
            self.peak_bytes = max(self.peak_bytes, sum(self._alive.values()))
        return t

    def __enter__(self) -> SavedActivations:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _key(t: torch.Tensor) -> tuple[str, int]:
    t = t.to_local() if hasattr(t, "to_local") else t
    return (str(t.device), t.untyped_storage().data_ptr())

"""The tensor-parallel part of the model protocol (``models/protocol.py`` lists every part).

It lives here, not in ``models/``, because the models sit above this package (they use its vocab-parallel loss and
replicated style): ``apply_tp`` checks these types without importing the models.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["TensorParallelConstraints", "TensorParallelHook", "TensorParallelModel"]


@runtime_checkable
class TensorParallelModel(Protocol):
    """TP (+SP): which module gets which DTensor style."""

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]: ...


@runtime_checkable
class TensorParallelConstraints(Protocol):
    """Optional: raise ``ValueError`` naming the size (heads, widths, padded vocab) that ``tp`` does not divide."""

    def check_tensor_parallel(self, tp: int) -> None: ...


@runtime_checkable
class TensorParallelHook(Protocol):
    """Optional: record what the loss and logits need after sharding (the TP mesh, the vocab shard, re-tied weights)."""

    def on_tensor_parallel(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None: ...

"""What the cost model knows about a device and its links."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware"]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the cost model needs to know about one device and its links."""

    memory_bytes: float = 80e9
    """Usable device memory."""
    flops: float = 400e12
    """Sustained bf16 FLOP/s of one device (about 40% of an H100's dense peak)."""
    intra_node_bandwidth: float = 150e9
    """Bytes/s per device inside a node (TP, CP, small DP groups)."""
    inter_node_bandwidth: float = 25e9
    """Bytes/s per device across nodes (DP, PP)."""
    devices_per_node: int = 8
    """Devices that share the fast links."""

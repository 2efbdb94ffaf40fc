"""Cost model: predicted step time of one layout on given hardware."""

from __future__ import annotations

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.parallel.memory import comm_theory_bytes
from lightning_flagscale.tune.hardware import Hardware
from lightning_flagscale.tune.memory import stage_params

__all__ = ["estimate_step_seconds"]


def estimate_step_seconds(
    model: TransformerConfig, c: ParallelConfig, seq_len: int, global_batch: int, hw: Hardware
) -> float:
    """Compute (with the pipeline bubble) plus communication that is not hidden."""
    tp, pp, cp, dp = c.tensor_parallel_size, c.pipeline_parallel_size, c.context_parallel_size, c.dp
    world = tp * pp * cp * dp
    tokens = global_batch * seq_len
    m = global_batch // (dp * c.micro_batch_size)
    compute = 6 * model.num_params(active=True) * tokens / (world * hw.flops)  # MoE: only routed experts run
    compute *= 1 + (pp - 1) / m  # bubble: (p-1)/(m+p-1) of the time is idle
    fast = hw.intra_node_bandwidth
    dp_link = fast if tp * cp * dp <= hw.devices_per_node else hw.inter_node_bandwidth
    psi = stage_params(model, pp) / tp
    # ZeRO shards over data x context; bf16 parameters are gathered, gradients are reduced in fp32.
    dp_traffic = comm_theory_bytes(2 * psi, dp * cp, c.zero_stage, grad_bytes=4 * psi).total
    s, b, h = seq_len / cp, c.micro_batch_size, model.hidden_size
    layers = -(-model.num_layers // pp)
    tp_traffic = 4 * layers * m * 2 * s * b * h * 2 * (tp - 1) / tp if tp > 1 else 0.0
    kv = 2 * s * b * model.num_key_value_heads * model.head_dim * 2 / tp
    cp_traffic = 3 * layers * m * kv * (cp - 1) if cp > 1 else 0.0  # K/V forward + K/V and dK/dV backward
    pp_traffic = 2 * m * s * b * h * 2 if pp > 1 else 0.0
    tp_link = fast if tp <= hw.devices_per_node else hw.inter_node_bandwidth
    return (
        compute + dp_traffic / dp_link + tp_traffic / tp_link + cp_traffic / fast + pp_traffic / hw.inter_node_bandwidth
    )

"""Model FLOPs per token, accelerator peaks and MFU (model FLOPs utilisation).

Formula (PaLM, Chowdhery et al. 2022, appendix B; the convention of Megatron-LM and torchtitan), per trained token:

    flops_per_token = 6 * N_matmul + 12 * L * (n_heads * head_dim) * seq_len

- ``N_matmul``: weights that one token multiplies through, i.e. every parameter except the input embedding (a
  lookup) with, for MoE layers, only the ``num_experts_per_tok`` routed experts (plus shared experts and the
  router). The LM head counts even when tied to the embedding: its matmul runs either way. Norm weights are
  included (as in PaLM's N); they are a negligible share. 6 = 2 (multiply-add) x 3 (forward, input gradient,
  weight gradient).
- ``12 * L * (n_heads * head_dim) * seq_len``: the attention scores ``Q K^T`` and ``P V`` (2 x 2 x s x h_attn per
  token and layer in forward, x 3 for training). The causal mask is *not* discounted (PaLM's convention, so numbers
  compare with published MFU); kernels that skip the masked half do about half of this term. Under multi-head
  latent attention the ``P V`` half runs over ``v_head_dim``: ``6 * L * n_heads * (head_dim + v_head_dim) * seq_len``.
- Multi-token prediction (DeepSeek-V3, ``num_nextn_predict_layers = D``): each module is one more block (its
  attention term too), its ``eh_proj`` (2h -> h) and one more pass through the shared LM head; its parameters are
  in ``num_params`` already, the head's matmul is added once per module (the embedding it shares is a lookup).
- Recomputation is not counted (MFU, not hardware FLOPs utilisation).

``mfu = tokens_per_s * flops_per_token / (num_devices * peak_flops_per_device)``, with the peak from
:data:`PEAK_FLOPS` (dense bf16/fp16 tensor-core peaks from the vendors' datasheets, no sparsity) for a known
accelerator, or on CPU a measured float32 matmul rate of this process (:func:`measured_matmul_flops`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

__all__ = [
    "PEAK_FLOPS",
    "device_peak_flops",
    "flops_per_token",
    "measured_matmul_flops",
    "model_flops_utilization",
    "peak_flops_from_name",
]

# Dense bf16 (fp16 for V100) peak FLOP/s per device. Matched in order against the device name: the first key
# whose every word occurs in the name wins, so specific variants (H100 PCIe, L40S) come before generic ones.
PEAK_FLOPS: dict[str, float] = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 989e12,
    "GH200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of a decoder described by ``config`` (a ``TransformerConfig``) at ``seq_len``.

    See the module docstring for the formula and its conventions.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    h = config.hidden_size
    mtp = getattr(config, "num_nextn_predict_layers", 0)
    # + the LM head, once for the main model and once per MTP module
    matmul = config.num_params(include_embedding=False, active=True) + (1 + mtp) * config.vocab_size * h
    # Q K^T runs over the query/key head width, P V over the value width (they differ under MLA); 6 = 2 x 3.
    v_dim = getattr(config, "v_head_dim", None) or config.head_dim
    blocks = config.num_layers + mtp
    attention = 6 * blocks * config.num_attention_heads * (config.head_dim + v_dim) * seq_len
    return float(6 * matmul + attention)


@functools.cache
def measured_matmul_flops(size: int = 1024, dtype: torch.dtype = torch.float32, seconds: float = 0.25) -> float:
    """FLOP/s of this process's CPU on square float32 matmuls (with its current torch thread count): the CPU peak."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up (allocations, thread pool)
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and runs >= 3:
            return 2 * size**3 * runs / elapsed


def device_peak_flops(device: torch.device | str) -> float | None:
    """Peak FLOP/s of one ``device``: the table for a known accelerator, a measurement on CPU, else None."""
    device = torch.device(device)
    if device.type == "cpu":
        return measured_matmul_flops()
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops_from_name(name)


def peak_flops_from_name(name: str) -> float | None:
    """The :data:`PEAK_FLOPS` entry whose words all occur in ``name`` (e.g. ``"NVIDIA H100 80GB HBM3"``)."""
    for key, value in PEAK_FLOPS.items():
        if all(word in name for word in key.split()):
            return value
    return None


def model_flops_utilization(tokens_per_s: float, flops: float, num_devices: int, peak_per_device: float) -> float:
    """Achieved model FLOP/s (``tokens_per_s * flops`` per token) over the peak of ``num_devices`` devices."""
    if num_devices < 1 or peak_per_device <= 0:
        raise ValueError(f"Need num_devices >= 1 and a positive peak, got {num_devices} and {peak_per_device}.")
    return tokens_per_s * flops / (num_devices * peak_per_device)

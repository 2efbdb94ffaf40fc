"""Auto-tuning of parallel layouts: enumerate, prune by memory, rank by a cost model (SEEDS.md 4-5 "Auto Search").

    lightning-flagscale tune --preset llama3-8b --devices 64 --memory-gb 80 --seq-len 8192 --global-batch 512

The search space is every ``ParallelConfig`` (tp, pp, cp, dp, ZeRO stage, micro-batch size) that validates for the
model and the world size. Each candidate gets

- a memory estimate per rank: model states as this package holds them under ``bf16-mixed`` at the backward peak
  (``parallel.memory.expected_state_bytes``: bf16 params, full bf16 gradients until the reduction below ZeRO-3,
  fp32 main gradients, masters and Adam states, divided as each ZeRO stage divides them) for the parameters of the
  busiest pipeline stage (embedding and head counted on the end stages) plus activations (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models": ``s*b*h*(34 + 5*a*s/h)`` bytes per layer per
  micro-batch, with the TP/SP and CP divisions, times the micro-batches a 1F1B stage keeps alive, or without PP
  all micro-batches of the per-rank batch, which run as one);
- a step-time estimate: compute ``6 * active params * tokens / (devices * flops)`` (MoE: routed top-k experts
  only) inflated by the pipeline bubble ``(p-1)/(m+p-1)``, plus data-parallel traffic
  (``parallel.memory.comm_theory_bytes``: bf16 parameters gathered, fp32 gradients reduced), tensor-parallel
  all-reduces (4 per layer per micro-batch of ``s*b*h`` activations) and ring-CP K/V traffic, each over its link.

Candidates over the memory budget are pruned; the rest are ranked by predicted tokens per second. The model is
deliberately simple and documented: it orders layouts, it does not promise absolute numbers. Measured profiles
(``bench/``) are the way to calibrate ``flops`` and the bandwidths.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.parallel.memory import comm_theory_bytes, expected_state_bytes

__all__ = ["Candidate", "Hardware", "search", "tune_main"]


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


@dataclass(frozen=True)
class Candidate:
    """One layout with its predictions."""

    config: ParallelConfig
    memory_bytes: float
    step_seconds: float
    tokens_per_second: float

    def describe(self) -> str:
        c = self.config
        return (
            f"tp={c.tensor_parallel_size} pp={c.pipeline_parallel_size} cp={c.context_parallel_size} dp={c.dp}"
            f" zero={c.zero_stage} sp={int(c.sequence_parallel)} mbs={c.micro_batch_size}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stage_params(model: TransformerConfig, pp: int) -> float:
    """Parameters of the busiest pipeline stage (layers split evenly; embedding/head on the end stages)."""
    per_layer = (model.num_params(include_embedding=False) - model.hidden_size) / model.num_layers
    layers = -(-model.num_layers // pp)
    embed = model.vocab_size * model.hidden_size
    ends = embed if (pp > 1 or model.tie_word_embeddings) else 2 * embed
    return layers * per_layer + ends


def estimate_memory(model: TransformerConfig, c: ParallelConfig, seq_len: int, num_microbatches: int) -> float:
    """Bytes per rank at the backward peak: model states as this package holds them under ``bf16-mixed``
    (``expected_state_bytes``) + live activations (a 1F1B stage's in-flight micro-batches, or without PP the
    whole per-rank batch of one accumulation step)."""
    tp, pp, cp, dp = c.tensor_parallel_size, c.pipeline_parallel_size, c.context_parallel_size, c.dp
    psi = _stage_params(model, pp) / tp
    # ZeRO shards over data x context ranks; during backward stages 1 and 2 both hold the full bf16 gradients.
    states = expected_state_bytes(psi, dp * cp, c.zero_stage, "bf16-mixed", when="backward_peak").total
    s, b, h, a = seq_len / cp, c.micro_batch_size, model.hidden_size, model.num_attention_heads
    if c.sequence_parallel:  # everything is split over TP
        per_layer = s * b * h * (34 + 5 * a * s / h) / tp
    else:  # TP splits attention/MLP insides only; norms and dropouts stay whole (the "10" term)
        per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    if pp > 1:
        live = min(pp, num_microbatches)  # 1F1B keeps at most p micro-batches alive on stage 0
    else:  # no schedule: one forward/backward over the whole per-rank batch of an accumulation step
        live = max(1, num_microbatches // c.gradient_accumulation_steps)
    activations = per_layer * -(-model.num_layers // pp) * live
    return states + activations


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
    psi = _stage_params(model, pp) / tp
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


def search(
    model: TransformerConfig,
    devices: int,
    *,
    seq_len: int,
    global_batch: int,
    hardware: Hardware | None = None,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4),
    top_k: int = 10,
) -> tuple[list[Candidate], int]:
    """The ``top_k`` fastest layouts that fit in memory, and how many valid layouts were considered."""
    hw = hardware or Hardware()
    found: list[Candidate] = []
    considered = 0
    for tp, pp, cp in itertools.product(_divisors(devices), repeat=3):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for zero, sp, mbs in itertools.product((0, 1, 2, 3), (False, True), micro_batch_sizes):
            if (sp and tp == 1) or global_batch % (dp * mbs):
                continue
            try:
                c = ParallelConfig(
                    tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, zero_stage=zero,
                    sequence_parallel=sp, micro_batch_size=mbs, data_parallel_size=dp,
                ).resolve(devices)  # fmt: skip
                c.validate_model(model)
            except ValueError:
                continue
            if seq_len % (2 * cp) or (sp and seq_len % tp):
                continue
            m = global_batch // (dp * mbs)
            if pp > 1 and m < pp:
                continue
            considered += 1
            memory = estimate_memory(model, c, seq_len, m)
            if memory > hw.memory_bytes:
                continue
            seconds = estimate_step_seconds(model, c, seq_len, global_batch, hw)
            found.append(Candidate(c, memory, seconds, global_batch * seq_len / seconds))
    found.sort(key=lambda cand: (cand.step_seconds, cand.memory_bytes))  # equal speed: the leaner layout first
    return found[:top_k], considered


def tune_main(argv: list[str]) -> None:
    """``lightning-flagscale tune``: print the best layouts for a model on a cluster."""
    parser = argparse.ArgumentParser(prog="lightning-flagscale tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", help="TransformerConfig preset name")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    parser.add_argument("--memory-gb", type=float, default=80.0)
    parser.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per device")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=10)
    args = parser.parse_args(argv)
    model = TransformerConfig.from_preset(args.preset)
    hw = Hardware(memory_bytes=args.memory_gb * 1e9, flops=args.tflops * 1e12, devices_per_node=args.devices_per_node)
    best, considered = search(
        model, args.devices, seq_len=args.seq_len, global_batch=args.global_batch, hardware=hw, top_k=args.top_k
    )
    print(
        f"{args.preset}: {model.num_params() / 1e9:.2f}B parameters, {args.devices} devices, {considered} valid layouts"
    )
    if not best:
        print("No layout fits in memory: add devices, shorten sequences or lower the global batch.")
        return
    print(f"{'layout':<48} {'memory/rank':>12} {'step':>9} {'tokens/s':>12}")
    for cand in best:
        print(f"{cand.describe():<48} {cand.memory_bytes / 1e9:10.1f}GB {cand.step_seconds:8.2f}s"
              f" {cand.tokens_per_second:12.0f}")  # fmt: skip

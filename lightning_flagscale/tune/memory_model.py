"""Memory model: bytes per rank at the step's peak for one layout, as this package's code holds them.

Per pipeline rank (the heaviest one decides, ``MemoryBreakdown.peak``):

- **model states** (``accounting.state_bytes.expected_state_bytes``, the formula ``tests/strategies/test_state_bytes.py``
  checks against a Trainer run): parameters in the model dtype, fp32 gradient buckets (DDP, ZeRO-1) or the fp32
  main-gradient shard plus at most two staging buckets during backward (ZeRO-2, ``parallel/data_parallel/grad_buckets.py``), fp32
  master weights and Adam moments, each sharded as its ZeRO stage shards it: dense parameters over data x context
  ranks, routed experts over the expert-data-parallel ranks (with the dense ones without an expert mesh), the
  TP-partial weights (norms on sequence / head shards, MoE blocks that route their own sequence chunk) over the
  stage's dp x cp x tp ranks
  (``parallel.data_parallel.optimizer.reduction_groups``); ZeRO-3 (FSDP2) fp32 shards of everything. Parameters per rank: ``tune.stage_params`` (TP/EP splits, vocab padding, uneven and
  padded pipeline splits, tied embeddings on both end stages);
- **activations** kept for backward (``tune.activations``, derived from our layers, per recompute policy) of the
  micro-batches alive at once on this rank: the per-rank batch of one accumulation step without PP (it runs as one
  forward/backward), or the (stage, micro-batch) pairs the pipeline schedule keeps alive (``tune.inflight``, read off
  torch's own schedules), each stage weighing its own layers, its boundary tensors and, on the last stage, the loss
  and the MTP modules (DeepSeek-V3; never recomputed); ``backend="gloo"`` prices torch's CPU attention kernels
  (MLA with ``v_head_dim != qk head dim`` runs the math path there); under ``torch_compile`` what the compiled
  blocks and loss keep (``tune.activations``: no fp32 norm copies, no fp32 logits or log-probabilities);
- **transients** on top of that peak: the loss's fp32 ``[tokens, vocab]`` temporaries (on the rank holding the last
  stage; compiled: the logits' gradient in the model dtype), the re-materialised layer under recompute; at the end of backward the **gradient reduction**'s buffers
  (ZeRO-1/2 reduce-scatter outputs, gloo's input copies, FSDP2's unsharded unit and its gradients under ZeRO-3)
  replace the activations when larger;
- under ZeRO-3 on FSDP2, its **gathers** (``_fsdp2_gathered_bytes``): the root unit unsharded through forward and
  backward, the last block unsharded at the end of its forward and at the start of its backward with the next
  block's prefetched all-gather (gloo: all-gather outputs and gloo's copy), the head's unsharded gradients; measured
  within 0.1% of the tests' and ``bench/lora.py``'s FSDP2 peaks (flat ZeRO-3 keeps the terms above);
- the **optimizer step** (AdamW's temporaries: two fp32 copies of one bucket's main parameters per tensor on CPU,
  one fp32 copy of all of them with foreach on GPUs), whose peak replaces the backward one when it is higher.

What is not modelled: routing imbalance (MoE activations assume every expert gets its share), expert tensor
parallelism's effect on the expert activations (priced as without ETP; its weights, gradients and optimizer states
are split), allocator fragmentation and the memory of the framework itself (CUDA context, NCCL buffers, Python
objects).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lightning_flagscale.accounting.state_bytes import expected_state_bytes
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL, ZERO2_MAX_STAGING
from lightning_flagscale.tune.activations import (
    CHECKPOINT_RNG_BYTES,
    LORA_LINEARS,
    head_bytes,
    layer_activation_bytes,
    lora_layer_activation_bytes,
    lora_linears,
    math_attention_keys,
    model_edge_bytes,
    mtp_activation_bytes,
)
from lightning_flagscale.tune.inflight import schedule_live_peak
from lightning_flagscale.tune.stage_params import RankParams, layer_params, rank_params, stage_reduced_params

__all__ = ["MemoryBreakdown", "RankMemory", "estimate_memory", "lora_rank_params", "memory_breakdown", "stage_params"]

Precision = Literal["32-true", "bf16-mixed", "16-mixed"]
_ACT_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}


def stage_params(model: TransformerConfig, pp: int) -> float:
    """Parameters of the busiest pipeline stage (layers split evenly; embedding/head on the end stages)."""
    per_layer = (model.num_params(include_embedding=False) - model.hidden_size) / model.num_layers
    layers = -(-model.num_layers // pp)
    embed = model.vocab_size * model.hidden_size
    ends = embed if (pp > 1 or model.tie_word_embeddings) else 2 * embed
    return layers * per_layer + ends


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Predicted bytes of one pipeline rank (every TP/CP/DP rank of it holds the same)."""

    pp_rank: int
    stages: tuple[int, ...]
    params: float
    grads: float
    """At the backward peak (ZeRO-2: shard + staging buckets)."""
    master_params: float
    optimizer_states: float
    activations: float
    """Saved activations of the micro-batches alive at the peak."""
    live_microbatches: int
    """(stage, micro-batch) activation sets alive at the peak (without PP: micro-batches run as one batch)."""
    transient: float
    """Temporaries on top of the activation peak (loss, recompute, ZeRO-3 gathers)."""
    optimizer_step: float
    """Peak during the optimizer step (states + AdamW temporaries)."""

    @property
    def states(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_states

    reduction: float = 0.0
    """Buffers of the gradient reduction, alive at the end of backward once the activations are gone."""
    gathered: float = 0.0
    """ZeRO-3 on FSDP2: bytes above the states at its gather peaks (the loss, the end of the last block's forward,
    the start of its backward), activations included (module docstring); 0 for other layouts."""

    @property
    def backward_peak(self) -> float:
        return self.states + max(self.activations + self.transient, self.reduction, self.gathered)

    @property
    def peak(self) -> float:
        return max(self.backward_peak, self.optimizer_step)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Per pipeline rank predictions; ``peak`` is the heaviest rank's."""

    ranks: tuple[RankMemory, ...]

    @property
    def heaviest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak(self) -> float:
        return self.heaviest.peak


def _states(
    m: TransformerConfig, p: RankParams, c: ParallelConfig, precision: str, bucket_numel: float
) -> tuple[float, ...]:
    dp_cp = c.dp * c.context_parallel_size
    edp = max(1, c.expert_data_parallel_size)
    if p.frozen:  # LoRA: the base held as parameters only, the adapters (``p.dense``) with their full state
        lora = expected_state_bytes(p.dense, dp_cp, c.zero_stage, precision, frozen_params=p.frozen)
        grads = lora.grads + (4 * min(p.dense, ZERO2_MAX_STAGING * bucket_numel) if c.zero_stage == 2 else 0.0)
        return lora.params, grads, lora.master_params, lora.optimizer_states
    # without an expert mesh the experts are reduced and sharded with the other weights; the TP-partial ones (norms
    # on sequence / head shards, chunk-routed MoE weights) over the stage's dp x cp x tp ranks (ZeRO-3: over dp x cp
    # with the rest)
    dense, expert = (p.dense, p.expert) if c.ep_enabled else (p.dense + p.expert, 0.0)
    last = c.num_stages - 1 in p.stages
    chunk = stage_reduced_params(m, c, [i for ls in p.layers for i in ls], last_stage=last) if c.zero_stage < 3 else 0.0
    groups = [(dense - chunk, dp_cp), (chunk, dp_cp * c.tensor_parallel_size), (expert, edp)]
    parts = [expected_state_bytes(psi, n, c.zero_stage, precision) for psi, n in groups]
    grads = sum(x.grads for x in parts)
    if c.zero_stage == 2:  # the reducer keeps at most two staging buckets alive across all its buckets
        grads += 4 * min(p.dense + p.expert, ZERO2_MAX_STAGING * bucket_numel)
    return (sum(x.params for x in parts), grads, sum(x.master_params for x in parts),
            sum(x.optimizer_states for x in parts))  # fmt: skip


def lora_rank_params(m: TransformerConfig, c: ParallelConfig, p: RankParams, lora: LoRAConfig) -> float:
    """Adapter parameters one rank of pipeline rank ``p`` holds (LoRA, issue 40): per targeted linear ``r (in + out)``,
    the TP-sharded factor divided by TP (column-parallel: B [out, r]; row-parallel: A [r, in]), plus DoRA's
    magnitude (split like the output rows). Dense decoders with standard attention only."""
    if m.is_moe or m.kv_lora_rank is not None:
        raise ValueError(
            f"The memory model prices LoRA on dense decoders with standard attention; {m.name!r} has "
            f"{'MoE experts' if m.is_moe else 'MLA'}. Plan it without lora=."
        )
    return sum(_lora_layer_params(m, c, layer, lora) for layers in p.layers for layer in layers)


def _lora_layer_params(m: TransformerConfig, c: ParallelConfig, layer: int, lora: LoRAConfig) -> float:
    """Adapter parameters of decoder layer ``layer`` on one rank (:func:`lora_rank_params`)."""
    tp, r, total = c.tensor_parallel_size, lora.rank, 0.0
    for name, (fan_in, fan_out, column) in lora_linears(m).items():
        if not lora.matches(f"layers.{layer}.{name}"):
            continue
        a, b = r * fan_in / (1 if column else tp), r * fan_out / (tp if column else 1)
        total += a + b + (fan_out / (tp if column else 1) if lora.use_dora else 0.0)
    return total


def _lora_stage_weight(m: TransformerConfig, c: ParallelConfig, stage: int, layers: tuple[int, ...], tokens: float,
                       e: int, recompute: str, lora: LoRAConfig, cpu: bool) -> tuple[float, float]:  # fmt: skip
    """``_stage_weight``'s layers and edge under LoRA (``tune.activations``): the model's first block (stage 0, layer
    0) has an input without gradient; RoPE's tables are kept when some q or k on the stage needs a gradient."""
    if recompute not in ("none", "full"):
        raise ValueError(
            f"The memory model prices LoRA with recompute 'none' or 'full'; recompute={recompute!r} is not priced "
            "with lora=."
        )
    tp, sp = c.tensor_parallel_size, c.sequence_parallel
    first = [stage == 0 and i == 0 for i in layers]
    qk = {LORA_LINEARS["q_proj"], LORA_LINEARS["k_proj"]}
    rope = any(not f or any(lora.matches(f"layers.{i}.{n}") for n in qk) for i, f in zip(layers, first, strict=True))
    kept = model_edge_bytes(m, tokens, act_bytes=e, frozen_embedding=True, rope=rope)
    blocks = [lora_layer_activation_bytes(m, tokens, lora, layer=i, input_grad=not f, act_bytes=e, tp=tp,
                                          sequence_parallel=sp, cpu=cpu) for i, f in zip(layers, first, strict=True)]  # fmt: skip
    if recompute == "none" or not blocks:
        return kept + sum(blocks), 0.0
    # full recompute: the block input and RNG state, and per adapted linear the 8-byte wrapped Python scalar of
    # ``update * scaling`` that non-reentrant checkpointing keeps (measured)
    block_input = (tokens / tp if sp else tokens) * e * m.hidden_size + CHECKPOINT_RNG_BYTES
    adapted = sum(lora.matches(f"layers.{i}.{n}") for i in layers for n in LORA_LINEARS.values())
    return kept + len(blocks) * block_input + 8 * adapted, max(blocks)


def _stage_weight(m: TransformerConfig, c: ParallelConfig, stage: int, layers: tuple[int, ...], num_stages: int,
                  tokens: float, e: int, recompute: str, keys: float | None, lora: LoRAConfig | None = None,
                  cpu: bool = False) -> tuple[float, float]:  # fmt: skip
    """(kept bytes of one micro-batch on ``stage``, largest recompute re-materialisation on it)."""
    tp, sp = c.tensor_parallel_size, c.sequence_parallel
    if lora is not None:
        kept, extra = _lora_stage_weight(m, c, stage, layers, tokens, e, recompute, lora, cpu)
        layers = ()
    else:
        kept, extra = model_edge_bytes(m, tokens, act_bytes=e), 0.0
    # a layer's bytes depend on its index only through its kind (dense or MoE): one call per kind (a search prices
    # ~10^5 layouts x stages x layers)
    kinds: dict[bool, tuple[int, int]] = {}  # is MoE -> (first such layer, count)
    if m.is_moe:
        for i in layers:
            moe = m.is_moe_layer(i)
            first, n = kinds.get(moe, (i, 0))
            kinds[moe] = (first, n + 1)
    elif layers:
        kinds[False] = (layers[0], len(layers))
    # under ring CP the attention's exchange breaks the compiled block's graph; a break inside a checkpointed region
    # runs the checkpoint eagerly: the block keeps what the eager one keeps (measured on 2 gloo ranks: equal bytes)
    compiled = c.torch_compile and not (c.cp_enabled and recompute in ("selective", "selective_mm"))
    for first, n in kinds.values():
        k, full = layer_activation_bytes(m, tokens, layer=first, act_bytes=e, tp=tp, sequence_parallel=sp,
                                         recompute=recompute, attention_keys=keys, compiled=compiled,
                                         expert_tensor_parallel_size=c.expert_tensor_parallel_size)  # fmt: skip
        kept, extra = kept + n * k, max(extra, full - k)
    boundary = tokens * e * m.hidden_size / (tp if sp else 1)
    if stage > 0:
        kept += boundary  # the received input, kept by the stage for its input gradient
    if stage < num_stages - 1:
        kept += boundary  # the output, kept by the stage until its backward
    return kept, extra


def _shards(c: ParallelConfig) -> int:
    """Ranks a ZeRO stage shards dense states over: data x context."""
    return c.dp * c.context_parallel_size


def _reduction_bytes(m: TransformerConfig, c: ParallelConfig, p: RankParams, e: int, bucket_numel: float, *,
                     gloo: bool) -> float:  # fmt: skip
    """Gradient-reduction buffers at the end of backward (``parallel/data_parallel/grad_buckets.py``, FSDP2).

    ZeRO-1 launches every bucket's reduce-scatter during backward and waits for them at the end: their fp32 output
    shards (``4Ψ/N``) are alive together; ZeRO-2 at most two buckets. gloo has no native reduce-scatter: torch
    reduces a copy of the whole input bucket, one fp32 copy per bucket in flight (measured in
    ``bench/tune_validation.py``). ZeRO-3 (FSDP2): the largest unit (usually the root: embedding + head) unsharded
    in the model dtype, its gradients in the model dtype and in fp32 for the reduce-scatter (+ gloo's copy), plus
    the next unit's gradients (and, under gloo, its reduce-scatter input and copy) while the first is in flight.
    """
    psi = p.dense + p.expert
    shards = c.dp * c.context_parallel_size
    if c.zero_stage == 1:
        return 4 * psi / shards + (4 * psi if gloo else 0.0)
    if c.zero_stage == 2:
        in_flight = min(psi, ZERO2_MAX_STAGING * bucket_numel)
        return 4 * in_flight / shards + (4 * in_flight if gloo else 0.0)
    if c.zero_stage == 3:
        blocks = [sum(layer_params(m, i, tp=c.tensor_parallel_size, ep=c.expert_shards))
                  for ls in p.layers for i in ls]  # fmt: skip
        g = 4 if gloo else 0
        if p.frozen:  # LoRA: the largest unit gathered, gradients of the adapters only (all of them: an upper bound)
            return e * max([p.frozen - sum(blocks), *blocks]) + (e + 4 + 2 * g) * psi
        units = sorted([psi - sum(blocks), *blocks], reverse=True)
        # FSDP2 holds a unit's reduce-scatter until the next unit's post-backward (one input buffer); gloo's async
        # copy of it lives until the work completes, while the next unit's gradients and its own reduce-scatter
        # (and copy) are allocated: the next largest unit adds its gradients and, under gloo, two fp32 copies.
        second = units[1] if len(units) > 1 else 0.0
        return (2 * e + 4 + g) * units[0] + (e + 2 * g) * second
    return 0.0


def _fsdp2_gathered_bytes(m: TransformerConfig, c: ParallelConfig, p: RankParams, e: int, lora: LoRAConfig | None, *,
                          activations: float, head_saved: float, transient: float, hidden: float, grads: float,
                          padded_vocab: int, gloo: bool) -> float:  # fmt: skip
    """Bytes above the model states at ZeRO-3 (FSDP2)'s gather peaks (issue 40; measured on CPU by ``bench/lora.py``'s
    per-rank table and ``tests/strategies/test_lora_state_bytes.py``). FSDP2's units are the blocks and the root
    (embedding, final norm, head; with LoRA their frozen base and adapters), each gathered in the model dtype; the
    root stays unsharded from the root's pre-forward to its post-forward, and again from its pre-backward to the
    end of backward. The largest of:

    - the loss: every activation and the loss's temporaries with the root unsharded;
    - the end of the last block's forward: the activations (the head's not yet), the root and the block unsharded,
      under gloo also the block's all-gather output (dropped on gloo's worker thread, the allocator's events see it
      freed only where the next all-gather reuses its address: the measured peak carries it, the true one may not),
      and the last residual add's two ``hidden`` tensors (the MLP output and the sum);
    - the start of the last block's backward: the same activations, the root and the block unsharded, the head's
      unsharded gradients (full fine-tuning), the block's output gradient (``hidden``) and the next block's
      prefetched all-gather output (under gloo with the copy gloo's ``allgather_base`` makes; under mixed precision
      with its input, the local shard cast to the model dtype); the previous step's
      gradients, part of ``grads``, were freed by ``zero_grad`` before backward (Lightning's closure), unless
      gradients accumulate over micro-steps or a pipeline schedule runs the backward.
    """
    tp, ep = c.tensor_parallel_size, c.expert_shards
    blocks = [sum(layer_params(m, i, tp=tp, ep=ep)) + (_lora_layer_params(m, c, i, lora) if lora else 0.0)
              for ls in p.layers for i in ls]  # fmt: skip
    root = p.frozen + p.dense + p.expert - sum(blocks)
    block = max(blocks, default=0.0)
    kept = activations - (head_saved if c.pipeline_parallel_size == 1 else 0.0)
    loss = activations + transient + e * root
    forward = kept + e * root + (2 if gloo else 1) * e * block + 2 * hidden
    last = c.num_stages - 1 in p.stages
    head_grads = e * min(root, padded_vocab * m.hidden_size / tp + m.hidden_size) if last and lora is None else 0.0
    zeroed = grads if c.pipeline_parallel_size == 1 and c.gradient_accumulation_steps == 1 else 0.0
    # mixed precision: the prefetch's all-gather input, the local shard cast to the model dtype, is a buffer of its own
    cast = e * block / (c.dp * c.context_parallel_size) if e != 4 else 0.0
    backward = kept - zeroed + e * root + head_grads + hidden + e * block + (2 if gloo else 1) * e * block + cast
    return max(loss, forward, backward)


def memory_breakdown(
    model: TransformerConfig,
    config: ParallelConfig,
    seq_len: int,
    num_microbatches: int,
    *,
    precision: Precision = "bf16-mixed",
    vocab_multiple: int = 64,
    bucket_numel: float = DEFAULT_BUCKET_NUMEL,
    foreach_optimizer: bool = False,
    backend: Literal["nccl", "gloo"] = "nccl",
    lora: LoRAConfig | None = None,
) -> MemoryBreakdown:
    """Per pipeline rank bytes for ``num_microbatches`` micro-batches of ``config.micro_batch_size`` sequences of
    ``seq_len`` tokens per data-parallel rank and optimizer step (module docstring). ``foreach_optimizer``: the
    optimizer steps all parameters at once (torch's default on GPUs) rather than one tensor at a time (CPU);
    ``backend="gloo"``: CPU runs, whose reduce-scatter copies its input. ``lora``: LoRA fine-tuning, the base frozen
    in the model dtype (ZeRO-3: fp32 shards) without gradients, master copies or optimizer state, the adapters
    (:func:`lora_rank_params`) with all of them; the gradient reduction and the optimizer step then see the
    adapters only, and the activations are what the frozen model keeps (``tune.activations``: the adapters' inputs,
    ``r``-wide outputs, dropout copies and DoRA's products, no input of a frozen linear; recompute ``none`` or
    ``full``; ``backend="gloo"`` prices dropout's CPU mask). ``config.torch_compile``: the blocks and the loss run
    compiled (``tune.activations``; full fine-tuning of dense decoders with standard attention; TP or ring CP)."""
    c, m = config, model
    if precision not in _ACT_BYTES:
        raise ValueError(f"precision={precision!r}: use one of {sorted(_ACT_BYTES)}.")
    if c.torch_compile and (lora is not None or m.num_nextn_predict_layers):
        raise ValueError(
            "The memory model prices torch_compile=True for full fine-tuning without MTP modules; what compiled"
            f" {'LoRA blocks' if lora is not None else 'MTP losses'} keep is not modelled. Plan it with"
            " torch_compile=False (the eager model's bytes)."
        )
    if c.torch_compile and c.resolved_ulysses_size > 1:
        raise ValueError(
            "The memory model does not price torch_compile=True with Ulysses / hybrid context parallelism"
            f" (context_parallel_mode={c.context_parallel_mode!r}): its all-to-alls split the compiled block into"
            " several graphs, which keep more than one graph does (measured on CPU: +46% a block,"
            " bench/results/compile_memory.md). Use context_parallel_mode='ring' or plan it with torch_compile=False."
        )
    if c.torch_compile and c.tp_enabled and c.cp_enabled:
        raise ValueError(
            "The memory model prices torch_compile=True under tensor parallelism (TP 2 with and without SP, measured)"
            " or under ring context parallelism, not both together (not measured: where the ring's exchange breaks"
            f" the TP block's graph). Got tensor_parallel_size={c.tensor_parallel_size} and"
            f" context_parallel_size={c.context_parallel_size}; plan it with torch_compile=False."
        )
    e = _ACT_BYTES[precision]
    tp, sp, pp = c.tensor_parallel_size, c.sequence_parallel, c.pipeline_parallel_size
    tokens = c.micro_batch_size * seq_len / c.context_parallel_size
    batch = max(1, num_microbatches // c.gradient_accumulation_steps)  # without PP: one forward/backward of it
    head = head_bytes(m, tokens, padded_vocab=m.padded_vocab_size(vocab_multiple), act_bytes=e, tp=tp, sp=sp,
                      frozen=lora is not None, compiled=c.torch_compile)  # fmt: skip
    # gloo: CPU processes, torch's CPU SDPA kernels; ring CP runs its own kernel (q, k, v, out, lse kept), Ulysses
    # the model's core attention on the gathered sequence
    keys = math_attention_keys(m, seq_len, cpu=backend == "gloo") if c.ring_size == 1 else None
    if m.num_nextn_predict_layers:  # the MTP modules run with the head on the last stage
        mtp = mtp_activation_bytes(m, tokens, padded_vocab=m.padded_vocab_size(vocab_multiple), act_bytes=e, tp=tp,
                                   sp=sp, attention_keys=keys, etp=c.expert_tensor_parallel_size)  # fmt: skip
        head = dataclasses.replace(head, saved=head.saved + mtp)
    modes = c.stage_recompute
    out = []
    for p in rank_params(m, c, vocab_multiple=vocab_multiple):
        if lora is not None:  # what trains is the adapters; the base is frozen
            p = dataclasses.replace(p, dense=lora_rank_params(m, c, p, lora), expert=0.0, frozen=p.dense + p.expert)
        n = c.num_stages
        weights, extra = {}, 0.0
        for s, layers in zip(p.stages, p.layers):
            kept, rematerialised = _stage_weight(m, c, s, layers, n, tokens, e, modes[s], keys, lora,
                                                 cpu=backend == "gloo")  # fmt: skip
            weights[s] = kept + (head.saved if s == n - 1 else 0.0)
            extra = max(extra, rematerialised)
        if pp == 1:  # one batch of ``batch`` micro-batches, all alive at the end of its forward
            activations, live = (weights[0] * batch, batch) if weights[0] > 0.0 else (0.0, 0)
        else:
            # the order the runner runs: generated for pipeline_chunk_costs / pipeline_max_activations when set
            costs = c.pipeline_chunk_costs
            costs = tuple(costs) if isinstance(costs, list) else costs
            activations, live = schedule_live_peak(c.pipeline_schedule, pp, c.virtual_pipeline_parallel_size,
                                                   num_microbatches, p.pp_rank, weights, costs,
                                                   c.pipeline_max_activations)  # fmt: skip
        scale = live if pp == 1 else 1
        if n - 1 in p.stages:
            extra = max(extra, head.forward_transient, head.backward_transient)
        transient = scale * extra
        params, grads, master, opt = _states(m, p, c, precision, bucket_numel)
        reduction = _reduction_bytes(m, c, p, e, bucket_numel, gloo=backend == "gloo")
        gathered = 0.0
        if c.zero_stage == 3 and c.resolved_zero3_impl == "fsdp2":  # flat ZeRO-3 keeps the model's old terms
            hidden = scale * tokens * e * m.hidden_size / (tp if sp else 1)
            head_saved = scale * head.saved if n - 1 in p.stages else 0.0
            gathered = _fsdp2_gathered_bytes(m, c, p, e, lora, activations=activations, head_saved=head_saved,
                                             transient=transient, hidden=hidden, grads=grads,
                                             padded_vocab=m.padded_vocab_size(vocab_multiple), gloo=backend == "gloo")  # fmt: skip
        # torch's AdamW on CPU tensors runs per tensor (no foreach): ``exp_avg_sq.sqrt() / bias_correction`` and the
        # bf16 copy for ``sync_params`` make ~3 fp32-sized temporaries of one main parameter (one bucket shard). GPU runs default to foreach: one fp32
        # temporary of all the stepped parameters at once.
        # numel of the fp32 parameters the optimizer steps (LoRA: the adapters only, never the frozen base)
        stepped = master / 4 if master else (p.dense + p.expert) / (_shards(c) if c.zero_stage == 3 else 1)
        shards = 1 if c.zero_stage == 0 else c.dp * c.context_parallel_size
        temporaries = 4 * stepped if foreach_optimizer else 12 * min(stepped, bucket_numel / shards)  # 3 measured
        staging = 4 * min(p.dense + p.expert, ZERO2_MAX_STAGING * bucket_numel) if c.zero_stage == 2 else 0.0
        grads_at_step = grads - staging
        optimizer_step = params + grads_at_step + master + opt + temporaries
        out.append(RankMemory(
            pp_rank=p.pp_rank, stages=p.stages, params=params, grads=grads, master_params=master,
            optimizer_states=opt, activations=activations, live_microbatches=live, transient=transient,
            reduction=reduction, gathered=gathered,
            optimizer_step=optimizer_step,
        ))  # fmt: skip
    return MemoryBreakdown(ranks=tuple(out))


def estimate_memory(
    model: TransformerConfig,
    config: ParallelConfig,
    seq_len: int,
    num_microbatches: int,
    *,
    precision: Precision = "bf16-mixed",
    vocab_multiple: int = 64,
    bucket_numel: float = DEFAULT_BUCKET_NUMEL,
    foreach_optimizer: bool = False,
    backend: Literal["nccl", "gloo"] = "nccl",
    lora: LoRAConfig | None = None,
) -> float:
    """Bytes at the step's peak on the heaviest rank of ``config`` (see :func:`memory_breakdown`)."""
    return memory_breakdown(
        model, config, seq_len, num_microbatches, precision=precision, vocab_multiple=vocab_multiple,
        bucket_numel=bucket_numel, foreach_optimizer=foreach_optimizer, backend=backend, lora=lora,
    ).peak  # fmt: skip

"""Activation bytes of *our* decoder, derived op by op from ``models/`` (and Korthikanti's formula to compare).

Why not Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022, Table 2:
``s*b*h*(34 + 5*a*s/h)`` per layer): that counts Megatron's GPT layer (LayerNorm, GeLU MLP of width 4h, dropout
masks, the materialised ``a*s*s`` attention matrix). Ours (``models/decoder.py``, ``layers.py``, ``attention.py``)
has RMSNorm with fp32 statistics, a SwiGLU MLP, grouped-query attention through SDPA (no ``s*s`` matrix is kept)
and no dropout. Per token, with ``E`` the bytes of the activation dtype (2 under bf16 / fp16, 4 under fp32), ``h``
the width, ``q = heads*head_dim``, ``k = kv_heads*head_dim``, ``i`` the MLP width, ``a`` the query heads, autograd
keeps (each storage once):

=======================================  ===========================  =======================================
op (file)                                saved for backward           bytes per token
=======================================  ===========================  =======================================
RMSNorm ``x.float()``, ``pow``, ``mul``  fp32 copy of the input       ``4h`` (fp32 runs: the input itself)
RMSNorm ``rsqrt``                        the per-token statistic      ``4``
RMSNorm ``weight * x_hat``               normalised input             ``E*h``
q/k/v projections                        their input (norm output)    ``E*h``
RoPE ``q*cos + rotate_half(q)*sin``      cos/sin only (per batch)     the projection outputs are *not* kept
SDPA (flash kernel for CPU / CUDA)       q, k after RoPE, v, out, lse ``E*(2q + 2k) + 4a``
o projection                             its input (SDPA output)      (same storage as ``out``: bshd layout)
second RMSNorm                           as the first                 ``4h + 4 + E*h``
gate/up projections                      their input (norm output)    ``E*h``
``silu(g) * u``, down projection         g, silu(g), u, product       ``4*E*i``
=======================================  ===========================  =======================================

i.e. ``8h + 8 + E*(4h + 2q + 2k + 4i) + 4a`` per token and layer; the residual stream is not kept (the next
norm keeps its own fp32 copy). Outside the layers: the embedding keeps only the token ids (8), RoPE's cos/sin
(``2*E*head_dim``), the final norm ``4h + 4 + 2*E*h`` and the loss: the non-TP loss keeps fp32 log-probabilities
(``4V``) and int64 targets (8); the vocab-parallel one keeps the fp32 softmax of its shard (``4V/t``) and 10 bytes
of indices/masks. The loss also has the largest transients of the step: backward holds two more fp32
``[tokens, V/t]`` tensors (``8V/t``: the gradient of the log-probabilities and of the logits); the vocab-parallel
forward holds the half-precision logits, the masked and shifted fp32 logits and the exponentials at once.

LoRA (``models/lora.py``, :func:`lora_layer_activation_bytes`): the base weights are frozen, so autograd keeps
only what the gradients of the adapters and of the activations need. A frozen linear keeps nothing (its input is
needed only for its weight's gradient), a norm keeps its fp32 statistics (``4h + 4``) but not ``x_hat`` (its weight
is frozen), and nothing is kept where no input requires a gradient: the embedding keeps no token ids and the first
block of the model (its input, the frozen embedding's output, needs no gradient) keeps nothing in its first norm.
Per adapted linear of input width ``in`` and output ``out`` (per rank):
``lora_A`` keeps its input (the base's input: shared by q/k/v and by gate/up, o_proj's is SDPA's ``out``, already
kept when attention is), ``lora_B`` the ``r``-wide output of A (``E*r``, whole under TP: A is replicated on
column-parallel layers and its row-parallel output is a partial sum of full width); with dropout, A keeps the
dropped copy (``E*in``) instead and dropout its mask where its input requires a gradient (``E*in`` on CPU, where
torch multiplies by a scaled mask; one byte a value on GPUs, whose fused kernel keeps a bool mask); DoRA keeps the
pre-scale output ``V x`` (``E*out``) and two ``[out]`` vectors per layer (the detached norm and ``m / ||V||``), and
with dropout a second ``[tokens, out]`` product and a third vector. Which tensors require a gradient follows the
block: q/k/v (or gate/up) of an unadapted projection on an input without gradient need none, SDPA keeps its
tensors when any of q/k/v does, SwiGLU keeps ``g`` / ``silu(g)`` / ``u`` as the gradients of ``g`` and ``u``
need them, the down projection's input only when it is adapted. The final norm keeps its statistics and the LM
head (frozen) nothing.

These were checked against ``tune.measure.SavedActivations`` on a one- and two-layer model (bf16 and fp32, exact to
the byte for the layer and within 3% outside it; a layer under TP 2 with and without SP to the byte on each rank);
``tests/test_tune_memory.py`` keeps the check.

Tensor parallelism (``models/decoder_plan.py``) divides q/k/v/i and the vocabulary by ``t``; without sequence
parallelism the norms run on the whole sequence on every TP rank; with it the norms run on ``s/t`` tokens but the
all-gathered inputs of the column-parallel projections (``E*h`` twice per layer) are kept whole by torch's
DTensor styles. Context parallelism divides the tokens. Recompute (``parallel/pipeline_parallel/recompute.py``): ``full``
keeps only the block input (``E*h``); ``selective`` keeps the block input and the outputs of matmuls and attention
(q, k, v, o, gate, up, down, SDPA out + lse) and recomputes norms and elementwise ops; ``selective_mm`` drops every
second matmul's output of those (k, o, up: the block runs q, k, v, o, gate, up, down); all three rebuild one layer's
activations during its backward, and keep the CPU RNG state (5056 bytes) per block. MoE blocks (``moe/layer.py``): the fp32 router input (``4h``) and scores
(``4n``), per routed copy (``k`` per token) the permuted input, fc1 output ``[2I]``, SwiGLU output and product,
fc2 output (``E*(2h + 4I)``), plus the combine buffer and routing indices (``E*h + 48k``, measured); shared
experts add a dense SwiGLU of their width (``4*E*S + E*h``). Routing is assumed balanced. Under SP with
``expert_tensor_parallel_size`` 1 the MoE block and its input are priced on the rank's ``s/t`` tokens (it routes its
own sequence chunk), otherwise on the whole sequence.

Multi-head latent attention (``LatentAttention``; ``r`` the KV latent, ``r_q`` the query latent, ``n`` heads of
``d = nope + rope`` for q/k and ``v`` for values): the latent RMSNorms as above on ``r`` and ``r_q`` (in fp32 the
KV norm's ``x.float()`` is the latent *view*, so the whole ``kv_a`` output ``4(r + rope)`` stays), the inputs of
``q_b_proj`` and ``kv_b_proj`` (``E*(r_q + r)``), RoPE keeps only cos/sin of ``qk_rope_head_dim``. The core
attention: a fused kernel keeps q and k (``E*n*d`` each), v (a view of ``kv_b``'s output, ``E*n*(nope + v)``),
the output (``E*n*v``, o_proj's input) and the lse (``4n``); torch's CPU SDPA has no fused kernel for ``v != d``
and runs the math path, which keeps fp32 ``q*scale``, ``k^T``, ``v`` and the softmax probabilities
(``4n*(2d + v + s)`` for ``s`` keys) and o_proj's input ``E*n*v`` (measured; which path runs is
:func:`math_attention_keys`; the fused-kernel sizes are what torch's kernels save for GQA, not measured on a GPU
here). Under TP the heads split; the down projections and their norms run replicated on the whole (gathered)
sequence. ``selective`` keeps the outputs of q_a, q_b (or q), kv_a, kv_b and o plus the kernel's (math path: the
two fp32 ``bmm`` outputs ``4n*(s + v)``); ``selective_mm`` every other matmul output in the order the block runs
them. The MTP modules (:func:`mtp_activation_bytes`) run on the last stage and are never recomputed.

Under ``torch_compile`` (``parallel/compile.py``: each block compiled after recompute wrapping, and the loss) what a
block keeps is what AOTAutograd's min-cut partitioner hands from the compiled forward to the compiled backward (read
off its graphs, ``TORCH_LOGS=aot_graphs``; ``SavedActivations`` sees them, ``ctx.save_for_backward``): it saves the
block input and the statistics of both norms and recomputes the cheap pointwise ops (the norms' fp32 copies and
``x_hat``, RoPE, ``silu``, the residual sum from the o projection's output) in backward. With TP ``t`` the widths
are a rank's (``q' = q/t``, ``k' = k/t``, ``i' = i/t``, ``a' = a/t``); ``c`` is 1, or ``1/t`` under SP, where the
block input, the norms and the residual stream are the rank's sequence chunk; per token of the whole local sequence:

=======================================  ===========================  ===========================================
compiled block, ``recompute``            saved for backward           bytes per token
=======================================  ===========================  ===========================================
``none``                                 block input, 2 rsqrt, norm   ``E*(2c*h + 2h + 2q' + 2k' + 3i')``
                                         outputs (SP: gathered, whole ``+ 8c + 4a'``
                                         on every rank), q/k after
                                         RoPE, v, SDPA out + lse, o
                                         output (TP: reduced), gate,
                                         up, ``silu(g)*u``
``selective``                            block input, q/k/v (before   ``E*(2c*h + 2q' + 2k' + 2i') + 4a'``;
                                         RoPE), SDPA out + lse, o     SP: ``+ 2E*h``
                                         (TP: its all-reduce / reduce-
                                         scatter), gate, up (not
                                         down: nothing in backward
                                         reads it); SP: the two
                                         all-gathered norm outputs
                                         (collectives: kept)
``selective_mm``                         block input, q, v, SDPA out  ``E*(c*h + 2q' + k' + i') + 4a'``;
                                         + lse, gate; TP: o's         TP: ``+ E*c*h``; SP: ``+ 2E*h``
                                         reduced output (a collective
                                         output); SP: the gathers
``full``                                 block input, RNG state       ``E*h`` + 5056 B per block (no TP)
=======================================  ===========================  ===========================================

(``i = intermediate_size``; no RNG state under the selective modes.) The compiled loss keeps the head's output,
padded columns included, in the model dtype (``E*V_pad``: the fp32 copy and the fp32 log-probabilities are never
written), the int64 targets, the row max and log-sum-exp (``8``) and the clamped label count (8 bytes once); its
backward writes the logits' gradient in the model dtype in one fused kernel (``E*V_pad``, the only transient). Under
TP the vocab-parallel cross-entropy is traced whole (its all-reduces as functional collectives) and the partitioner
moves its backward's ``softmax - onehot`` into the forward: it keeps that fp32 ``[tokens, V_pad/t]`` (``4V_pad/t``),
the label mask (1) and the label count (8 bytes once), not the logits; its backward writes the logits' gradient
shard in the model dtype (``E*V_pad/t``); its forward allocates per-token statistics only besides what it keeps.
Measured on CPU to the byte (bf16: ``tests/test_tune_compile.py``, TP 2 with and without SP on 2 gloo ranks; fp32
the same way, by hand, without TP). On CUDA, inductor's partitioner sees the same joint graph; the attention op is
cuDNN's or flash's instead of the CPU flash kernel, which save the same q, k, v, out and fp32 lse (plus two 8-byte
philox scalars) in the same bshd layout. Compiled blocks are priced for dense decoders with standard attention (MoE
is refused with compile by ``ParallelConfig`` / ``apply_compile``; MLA blocks are not measured compiled: refused
here). Under TP, ``full`` recompute is not measured compiled: refused (its checkpoint runs eagerly around the compiled
block body, ``parallel/compile.py``, since torch 2.13's AOTAutograd cannot trace the checkpoint over DTensor ops);
TP together with CP is not measured: refused.
Under ring context parallelism the ring's exchange breaks the block's graph: without recompute the pieces keep the
bytes above, under ``full`` too, while under the selective modes the break inside the checkpointed region makes torch
run the checkpoint eagerly and the block keeps what the eager block keeps (measured on 2 gloo ranks, equal
allocations, ``bench/results/compile_memory.md``; ``tune.memory_model`` prices it so). Ulysses' all-to-alls split it
into more graphs that kept 46% more (measured): not priced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_flagscale.config import RecomputeMode, TransformerConfig
from lightning_flagscale.config.lora import LoRAConfig

__all__ = [
    "LORA_LINEARS",
    "HeadBytes",
    "head_bytes",
    "korthikanti_layer_bytes",
    "layer_activation_bytes",
    "lora_layer_activation_bytes",
    "lora_linears",
    "math_attention_keys",
    "model_edge_bytes",
    "mtp_activation_bytes",
]

CHECKPOINT_RNG_BYTES = 5056
"""``torch.utils.checkpoint`` keeps the CPU generator's state per recomputed region (``preserve_rng_state``)."""


def _norm(h: float, tokens: float, e: int) -> float:
    """RMSNorm: fp32 input copy, per-token statistic, normalised input."""
    return tokens * (4 * h + 4 + e * h)


def _moe_bytes(m: TransformerConfig, tokens: float, e: int) -> float:
    h, n, k, inner = m.hidden_size, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size
    routed = k * e * (2 * h + 4 * inner) + 4 * h + 4 * n + e * h + 48 * k
    shared = 0.0
    if m.num_shared_experts:
        width = m.shared_expert_intermediate_size or inner * m.num_shared_experts
        shared = 4 * e * width + e * h
    return tokens * (routed + shared)


def math_attention_keys(m: TransformerConfig, seq_len: float, *, cpu: bool) -> float | None:
    """The key length of torch's math SDPA when it runs the core attention (None: a fused kernel runs): on CPU,
    torch's fused (flash) kernel needs one head width for q, k and v, so MLA with ``v_head_dim != qk head dim``
    runs the math path there (measured; the module docstring has what it keeps)."""
    math = cpu and m.attn_backend == "torch" and m.is_mla and m.v_head_dim != m.head_dim
    return seq_len if math else None


def _attention(m: TransformerConfig, tokens: float, e: int, tp: int, keys: float | None):
    """(bytes attention keeps beyond its input, bytes of each matmul output in the order they run, bytes of the core
    attention's outputs) for ``tokens`` tokens; ``keys``: the math SDPA path's key length (None: fused kernel)."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    a = n / tp
    if not m.is_mla:
        q, kv = n * d / tp, m.num_key_value_heads * d / tp
        return (
            tokens * (e * (2 * q + 2 * kv) + 4 * a),
            [tokens * e * x for x in (q, kv, kv, h)],
            tokens * (e * q + 4 * a),
        )
    r, rope, v, nope = m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim, m.qk_nope_head_dim
    # kv_a_layernorm (in fp32 its ``x.float()`` is the latent view itself: the whole kv_a output is kept) and
    # kv_b_proj's input; the down projections run on every token of the (gathered) sequence on every TP rank
    kept = _norm(r, tokens, e) + tokens * (e * r + (4 * rope if e == 4 else 0))
    widths = [n * d / tp]  # q_proj
    if m.q_lora_rank is not None:
        kept += _norm(m.q_lora_rank, tokens, e) + tokens * e * m.q_lora_rank  # q_a_layernorm, q_b_proj's input
        widths = [m.q_lora_rank, n * d / tp]  # q_a_proj, q_b_proj
    widths += [r + rope, n * (nope + v) / tp, h]  # kv_a_proj_with_mqa, kv_b_proj, o_proj
    if keys is None:  # fused kernel: q, k (concatenated), v (a view of kv_b's output), out (o_proj's input), lse
        kept += tokens * (e * (2 * d + nope + 2 * v) * n / tp + 4 * a)
        core = tokens * (e * v * n / tp + 4 * a)
    else:  # math path in fp32: q * scale, k^T, v, softmax probabilities [s, keys]; o_proj's input in the model dtype
        kept += tokens * (4 * a * (2 * d + v + keys) + e * v * n / tp)
        core = tokens * 4 * a * (keys + v)  # the two bmm outputs (scores, probs @ v), fp32
    return kept, [tokens * e * x for x in widths], core


def layer_activation_bytes(
    m: TransformerConfig,
    tokens: float,
    *,
    layer: int = 0,
    act_bytes: int = 2,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: RecomputeMode = "none",
    attention_keys: float | None = None,
    compiled: bool = False,
    expert_tensor_parallel_size: int = 1,
) -> tuple[float, float]:
    """(bytes kept until backward, bytes alive while this layer is recomputed in backward) for one decoder layer
    over ``tokens`` tokens of this rank (micro-batch x local sequence), see the module docstring. ``attention_keys``:
    the key length when torch's math SDPA runs the core attention (:func:`math_attention_keys`), None for a fused
    kernel. ``compiled``: the block runs compiled (``torch_compile``; dense blocks, standard attention).
    ``expert_tensor_parallel_size``: under SP with 1 an MoE block routes this rank's sequence chunk only."""
    if compiled:
        return _compiled_layer_bytes(m, tokens, layer=layer, act_bytes=act_bytes, tp=tp, sp=sequence_parallel,
                                     recompute=recompute)  # fmt: skip
    e, h = act_bytes, m.hidden_size
    norm_tokens = tokens / tp if sequence_parallel else tokens
    norms = 2 * _norm(h, norm_tokens, e)
    inputs = 2 * tokens * e * h  # the (all-gathered) inputs of the column-parallel projections
    attention, matmuls, core = _attention(m, tokens, e, tp, attention_keys)
    if m.is_moe_layer(layer):
        # under SP with whole experts each TP rank routes its own chunk (moe/layer.py), else the whole sequence
        moe_tokens = norm_tokens if expert_tensor_parallel_size == 1 else tokens
        inputs = (tokens + moe_tokens) * e * h  # the attention's gathered input, the MoE block's own
        mlp = _moe_bytes(m, moe_tokens, e)
        mlp_mm = [moe_tokens * m.num_experts_per_tok * e * (3 * m.moe_intermediate_size + h)]
    else:
        mlp = tokens * 4 * e * m.intermediate_size / tp
        mlp_mm = [tokens * e * x for x in (m.intermediate_size / tp, m.intermediate_size / tp, h)]  # gate, up, down
    full = norms + inputs + attention + mlp
    block_input = (norm_tokens if sequence_parallel else tokens) * e * h
    if recompute == "none":
        return full, full
    block_input += CHECKPOINT_RNG_BYTES
    if recompute == "full":
        return block_input, block_input + full
    if recompute in ("selective", "selective_mm"):
        outputs = matmuls + mlp_mm
        if recompute == "selective_mm":
            if m.is_moe_layer(layer):
                raise ValueError(
                    "recompute='selective_mm' runs on dense blocks only (parallel/pipeline_parallel/recompute.py)."
                )
            outputs = outputs[::2]  # every second matmul's output is recomputed (GQA: k, o and up)
        kept = block_input + sum(outputs) + core  # + the core attention's outputs (SDPA out and lse)
        return kept, kept + full
    raise ValueError(f"recompute={recompute!r}: use 'none', 'selective', 'selective_mm' or 'full'.")


def _compiled_layer_bytes(
    m: TransformerConfig, tokens: float, *, layer: int, act_bytes: int, tp: int, sp: bool, recompute: RecomputeMode
) -> tuple[float, float]:
    """:func:`layer_activation_bytes` of a compiled block (module docstring's second table), TP ``tp`` (SP: ``sp``)."""
    if m.is_mla or m.is_moe_layer(layer):
        raise ValueError(
            "The memory model prices torch_compile=True for dense blocks with standard attention (the layouts"
            f" torch_compile runs); {m.name!r} layer {layer} has {'MLA' if m.is_mla else 'MoE experts'}."
        )
    if tp > 1 and recompute == "full":
        raise ValueError(
            "The memory model does not price torch_compile=True with tensor parallelism under recompute='full' (not"
            " measured: there the block's checkpoint runs eagerly around its compiled body, parallel/compile.py)."
            " Plan it with torch_compile=False (the eager full-recompute bytes), or use recompute 'none', 'selective'"
            " or 'selective_mm' with TP and compile."
        )
    e, h = act_bytes, m.hidden_size
    a, q, kv, i = (x / tp for x in (m.num_attention_heads, m.num_attention_heads * m.head_dim,
                                     m.num_key_value_heads * m.head_dim, m.intermediate_size))  # fmt: skip
    chunk = tokens / tp if sp else tokens  # the norms' tokens: the block input and the residual stream
    block_input = chunk * e * h
    # the column-parallel projections' input, whole on every TP rank (the norm output; under SP its all-gather)
    gathered = 2 * tokens * e * h
    # the norms' inputs are recomputed from the block input and the o projection's (reduced) output; their
    # statistics and outputs are kept
    full = block_input + chunk * (e * h + 8) + gathered + tokens * (e * (2 * q + 2 * kv + 3 * i) + 4 * a)
    if recompute == "none":
        return full, full
    if recompute == "full":
        return block_input + CHECKPOINT_RNG_BYTES, block_input + CHECKPOINT_RNG_BYTES + full
    if recompute not in ("selective", "selective_mm"):
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective', 'selective_mm' or 'full'.")
    # the policy keeps matmul and collective outputs; SP's all-gathers are collectives. The o projection's output
    # is kept reduced (TP: its all-reduce / reduce-scatter, whole / on the chunk), the down projection's is not:
    # only the residual sum reads it, and backward does not
    kept = block_input + (gathered if sp else 0.0) + tokens * 4 * a
    if recompute == "selective":  # q, k, v, o, gate, up + SDPA out
        kept += chunk * e * h + tokens * e * (2 * q + 2 * kv + 2 * i)
    else:  # selective_mm: q, v, gate (k, o, up recomputed) + SDPA out; under TP o's collective output is still kept
        kept += (chunk * e * h if tp > 1 else 0.0) + tokens * e * (2 * q + kv + i)
    return kept, kept + full


LORA_LINEARS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}  # fmt: skip
"""The linears of a dense block LoRA adapts (short name -> name in the block)."""


def lora_linears(m: TransformerConfig, tp: int = 1) -> dict[str, tuple[float, float, bool]]:
    """A dense block's linears LoRA adapts: name -> (input width, output width, column-parallel), the widths this
    rank's shard of the layer has under TP ``tp`` (column-parallel: the output split; row-parallel: the input)."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    i = m.intermediate_size
    return {
        "self_attn.q_proj": (h, q / tp, True), "self_attn.k_proj": (h, kv / tp, True),
        "self_attn.v_proj": (h, kv / tp, True), "self_attn.o_proj": (q / tp, h, False),
        "mlp.gate_proj": (h, i / tp, True), "mlp.up_proj": (h, i / tp, True), "mlp.down_proj": (i / tp, h, False),
    }  # fmt: skip


def lora_layer_activation_bytes(
    m: TransformerConfig,
    tokens: float,
    lora: LoRAConfig,
    *,
    layer: int = 0,
    input_grad: bool = True,
    act_bytes: int = 2,
    tp: int = 1,
    sequence_parallel: bool = False,
    cpu: bool = False,
) -> float:
    """Bytes one dense block keeps until backward under LoRA ``lora`` (module docstring), over ``tokens`` tokens of
    this rank; ``input_grad``: whether the block's input requires a gradient (False for the model's first block,
    whose input is the frozen embedding's output); ``cpu``: dropout keeps a mask of the activation dtype (torch's
    CPU path) rather than a bool mask (its fused GPU kernel)."""
    e, h, r = act_bytes, m.hidden_size, lora.rank
    mask = e if cpu else 1
    norm_tokens = tokens / tp if sequence_parallel else tokens
    dims = {short: lora_linears(m, tp)[full] for short, full in LORA_LINEARS.items()}
    adapted = {short for short, full in LORA_LINEARS.items() if lora.matches(f"layers.{layer}.{full}")}
    dropout = lora.dropout > 0

    def adapters(names: tuple[str, ...], grad: bool, input_kept: bool) -> float:
        """A group of linears sharing one input (requiring a gradient: ``grad``; kept already: ``input_kept``)."""
        total, group = 0.0, [n for n in names if n in adapted]
        if group and not dropout and not input_kept:
            total += tokens * e * dims[group[0]][0]  # lora_A's input, the one tensor the group shares
        for name in group:
            fan_in, fan_out, _ = dims[name]
            total += tokens * e * r  # lora_B's input
            if dropout:
                total += tokens * (e + (mask if grad else 0)) * fan_in  # the dropped copy and the mask
            if lora.use_dora:  # the pre-scale output, the detached norm and m / norm (dropout: another product)
                total += tokens * e * fan_out * (2 if dropout else 1) + e * fan_out * (3 if dropout and grad else 2)
        return total

    heads, q, kv, inner = m.num_attention_heads / tp, dims["q_proj"][1], dims["k_proj"][1], dims["gate_proj"][1]
    total = norm_tokens * (4 * h + 4) if input_grad else 0.0  # first norm: statistics only (its weight is frozen)
    total += adapters(("q_proj", "k_proj", "v_proj"), input_grad, False)
    attention_grad = input_grad or bool(adapted & {"q_proj", "k_proj", "v_proj"})
    if attention_grad:  # SDPA: q and k after RoPE, v, out, lse
        total += tokens * (e * (2 * q + 2 * kv) + 4 * heads)
    total += adapters(("o_proj",), attention_grad, attention_grad)
    mid_grad = attention_grad or "o_proj" in adapted
    if mid_grad:
        total += norm_tokens * (4 * h + 4)  # second norm
    total += adapters(("gate_proj", "up_proj"), mid_grad, False)
    gate_grad, up_grad = mid_grad or "gate_proj" in adapted, mid_grad or "up_proj" in adapted
    # SwiGLU: silu keeps g; silu(g) * u keeps silu(g) for u's gradient and u for g's
    total += tokens * e * inner * (int(gate_grad) + int(up_grad) + int(gate_grad))
    total += adapters(("down_proj",), gate_grad or up_grad, False)
    return total


def mtp_activation_bytes(
    m: TransformerConfig,
    tokens: float,
    *,
    padded_vocab: int,
    act_bytes: int = 2,
    tp: int = 1,
    sp: bool = False,
    attention_keys: float | None = None,
    etp: int = 1,
) -> float:
    """Bytes the MTP modules keep on the last stage for one micro-batch of ``tokens`` tokens (``models/decoder.py``
    ``MTPLayer``; never recomputed: recompute applies to the main blocks). Per module: the shifted token ids (8),
    ``enorm`` of their embedding, ``hnorm`` of the incoming hidden states (in fp32 its input copy is the one the
    final norm before it already keeps), ``eh_proj``'s input ``[2h]``, one block, a head (own norm, shared LM
    head, loss) as :func:`head_bytes` and the loss's two scalars (12 bytes)."""
    e, h = act_bytes, m.hidden_size
    norm_tokens = tokens / tp if sp else tokens
    head = head_bytes(m, tokens, padded_vocab=padded_vocab, act_bytes=e, tp=tp, sp=sp).saved
    total = 0.0
    for k in range(m.num_nextn_predict_layers):
        block, _ = layer_activation_bytes(m, tokens, layer=m.num_layers + k, act_bytes=e, tp=tp, sequence_parallel=sp,
                                          attention_keys=attention_keys, expert_tensor_parallel_size=etp)  # fmt: skip
        hnorm = norm_tokens * (4 + e * h + (4 * h if e != 4 else 0))
        total += tokens * 8 + _norm(h, norm_tokens, e) + hnorm + norm_tokens * 2 * e * h + block + head
        total += 12  # the loss's scalars: cross-entropy's fp32 weight total and the int64 normaliser
    return total


@dataclass(frozen=True, kw_only=True)
class HeadBytes:
    """The loss end of the model on one micro-batch (final norm, LM head, cross-entropy)."""

    saved: float
    """Kept until backward: final norm and the loss's fp32 probabilities."""
    forward_transient: float
    """Extra bytes alive at the forward peak of the loss (beyond ``saved``)."""
    backward_transient: float
    """Extra bytes alive at the backward peak of the loss (beyond ``saved``)."""


def head_bytes(
    m: TransformerConfig,
    tokens: float,
    *,
    padded_vocab: int,
    act_bytes: int = 2,
    tp: int = 1,
    sp: bool = False,
    frozen: bool = False,
    compiled: bool = False,
) -> HeadBytes:
    """Final norm + LM head + loss on ``tokens`` tokens (module docstring); the LM head sees the whole sequence.
    ``frozen``: the norm's weight and the LM head are frozen (LoRA): the norm keeps its statistics only, the head
    nothing. ``compiled``: the loss runs compiled (``torch_compile``): without TP it keeps the logits in the model
    dtype and its backward writes their gradient in the model dtype, nothing in fp32; under TP it keeps the fp32
    gradient factor of its vocab shard (module docstring)."""
    e, h = act_bytes, m.hidden_size
    norm_tokens = tokens / tp if sp else tokens
    norm = norm_tokens * (4 * h + 4) if frozen else _norm(h, norm_tokens, e) + tokens * e * h  # + the head's input
    if compiled and tp > 1:
        # the vocab-parallel cross-entropy traced whole (its all-reduces as functional collectives): the partitioner
        # moves its backward's ``softmax - onehot`` into the forward and keeps that fp32 [tokens, V/t] (not the
        # logits), the label mask (1 byte a token) and the clamped label count (8 bytes once); the backward scales
        # it into the logits' gradient in the model dtype; the forward allocates only per-token statistics besides
        local = padded_vocab / tp
        saved = norm + tokens * (4 * local + 1) + 8
        return HeadBytes(saved=saved, forward_transient=0.0, backward_transient=tokens * e * local)
    if compiled:
        logits = tokens * e * padded_vocab  # the head's output, padded columns included
        # + int64 targets, the row max and log-sum-exp (fp32), and the clamped label count (one int64)
        return HeadBytes(saved=norm + logits + tokens * 16 + 8, forward_transient=0.0, backward_transient=logits)
    if tp > 1:  # vocab-parallel cross-entropy (parallel/tensor_parallel/apply.py): fp32 softmax of the shard is kept
        local = padded_vocab / tp
        saved = norm + tokens * (4 * local + 10)
        fwd = tokens * (e * local + 8 * local)  # half logits + masked/shifted fp32 logits next to the exponentials
    else:
        local = padded_vocab
        saved = norm + tokens * (4 * m.vocab_size + 8)
        # half logits + fp32 copy of the real columns while log_softmax writes its output
        fwd = tokens * (e * padded_vocab + (4 * m.vocab_size if e != 4 else 0))
    vocab = local if tp > 1 else m.vocab_size
    bwd = tokens * 8 * vocab  # fp32 gradient of the probabilities and of the logits
    return HeadBytes(saved=saved, forward_transient=fwd, backward_transient=bwd)


def model_edge_bytes(
    m: TransformerConfig, tokens: float, *, act_bytes: int = 2, frozen_embedding: bool = False, rope: bool = True
) -> float:
    """Kept once per micro-batch by every stage that runs layers: token ids (8; none when the embedding is frozen,
    as under LoRA) and RoPE's cos/sin tables (when some q or k on the stage requires a gradient: ``rope``)."""
    return tokens * ((0 if frozen_embedding else 8) + (2 * act_bytes * m.rope_dim if rope else 0))


def korthikanti_layer_bytes(
    seq_len: float,
    micro_batch: float,
    hidden: float,
    heads: float,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Literal["none", "selective", "full"] = "none",
) -> float:
    """Activation bytes of one Megatron GPT layer in 16-bit (Korthikanti et al. 2022, Table 2), for comparison
    with published configurations: ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with TP,
    ``sbh(34 + 5as/h)/t`` with TP+SP, ``sbh(34/t)`` with selective recompute under SP, ``2sbh`` with full."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2 * s * b * h
    attention_matrix = 5 * a * s / h
    if recompute == "selective":
        attention_matrix = 0.0
    if sequence_parallel:
        return s * b * h * (34 + attention_matrix) / t
    return s * b * h * (10 + 24 / t + attention_matrix / t)

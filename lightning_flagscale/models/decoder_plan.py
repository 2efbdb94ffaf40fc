"""The tensor-parallel plan of ``CausalLM`` (Megatron layout on DTensor parallel styles).

Layout (Shoeybi et al. 2019, Korthikanti et al. 2022), following torchtitan's llama plan:
- embedding: vocab-parallel (rows sharded, ``RowwiseParallel`` on ``nn.Embedding``); output replicated, or
  reduce-scattered along the sequence under SP;
- attention q/k/v and MLP gate/up: column-parallel (heads / inner width sharded); o/down: row-parallel;
- the attention/MLP input enters as one replicated DTensor (``PrepareModuleInput``) that the column-parallel layers
  share, so its gradient is reduced once per module in backward (Megatron's fused QKV / gate-up);
- under SP the norms run on sequence shards (``SequenceParallel``) and the attention/MLP inputs are
  all-gathered along the sequence (the same ``PrepareModuleInput``), row-parallel outputs reduce-scattered back;
- LM head: column-parallel with the *local* vocab shard as output, consumed by the vocab-parallel cross-entropy.

The plan is the model's (model protocol); ``parallel.tensor.apply_tp`` applies whatever plan a model gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_flagscale.parallel.tensor_parallel.apply import ReplicateParallel

if TYPE_CHECKING:
    from lightning_flagscale.models.decoder import CausalLM

__all__ = ["check_decoder_tp", "decoder_tp_plan"]


def check_decoder_tp(model: CausalLM, tp: int) -> None:
    """Raise ``ValueError`` naming the offending size when the decoder cannot be split ``tp`` ways."""
    cfg = model.config
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "padded vocab size": model.padded_vocab_size,
    }
    for name, value in sizes.items():
        if value % tp:
            hint = (
                " pad the vocabulary to a multiple of it (CausalLMModule(vocab_multiple=...) or"
                " CausalLM(config, vocab_multiple=...))"
                if name.startswith("padded")
                else " choose a tensor_parallel_size that divides it"
            )
            raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp};{hint}.")


def decoder_tp_plan(model: CausalLM, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The TP plan of ``CausalLM`` for the parts present (pipeline stages may lack embedding / norm / head).

    MoE ``mlp`` entries are left to the MoE package (experts are sharded by expert parallelism).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel if sequence_parallel else ReplicateParallel
    plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        plan["norm"] = norm_style()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=True)
    for name, block in model.layers.items():
        p = f"layers.{name}."
        plan[p + "self_attn.q_proj"] = ColwiseParallel()
        plan[p + "self_attn.k_proj"] = ColwiseParallel()
        plan[p + "self_attn.v_proj"] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        if block.self_attn.q_norm is not None:
            # QK-norm runs on the TP-local heads [B, S, H/tp, D]: as a head-sharded DTensor its weight gradient
            # (a partial sum over local heads) is all-reduced over TP like any replicated parameter's.
            plan[p + "self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan[p + "self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if not block.is_moe:
            plan[p + "mlp.gate_proj"] = ColwiseParallel()
            plan[p + "mlp.up_proj"] = ColwiseParallel()
            plan[p + "mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        plan[p + "input_layernorm"] = norm_style()
        plan[p + "post_attention_layernorm"] = norm_style()
        # Attention takes (x, cos, sin, segment_ids). x enters as one replicated DTensor (all-gathered from its
        # sequence shards under SP) shared by q/k/v (gate/up): their input gradients add up as partial DTensors and
        # are reduced once per module in backward, like Megatron's fused QKV and gate-up GEMMs. Left to each
        # column-parallel layer, every one of them all-reduced its own input gradient (5 per block, not 2).
        plan[p + "self_attn"] = PrepareModuleInput(
            input_layouts=(seq, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        )
        if not block.is_moe:
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        elif sequence_parallel:
            # The MoE block (router, experts, shared experts) runs on the whole sequence on every TP rank, as
            # without SP: its parameters then get identical full gradients on every TP rank. Only its output
            # is re-sharded (a local slice, no communication).
            plan[p + "mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            )  # fmt: skip
    return plan

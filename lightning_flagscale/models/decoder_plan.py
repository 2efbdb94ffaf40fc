"""The tensor-parallel plan of ``CausalLM`` (Megatron layout on DTensor parallel styles).

Layout (Shoeybi et al. 2019, Korthikanti et al. 2022), following torchtitan's llama plan:
- embedding: vocab-parallel (rows sharded, ``RowwiseParallel`` on ``nn.Embedding``); output replicated, or
  reduce-scattered along the sequence under SP;
- attention q/k/v and MLP gate/up: column-parallel (heads / inner width sharded); o/down: row-parallel;
- the attention/MLP input enters as one replicated DTensor (``PrepareModuleInput``) that the column-parallel layers
  share, so its gradient is reduced once per module in backward (Megatron's fused QKV / gate-up);
- under SP the norms run on sequence shards (``LocalSequenceParallel``: torch's ``SequenceParallel`` layouts, the
  weights plain under the strategy, their partial gradients summed over TP once per step) and the attention/MLP
  inputs are all-gathered along the sequence (the same ``PrepareModuleInput``), row-parallel outputs
  reduce-scattered back;
- LM head: column-parallel with the *local* vocab shard as output, consumed by the vocab-parallel cross-entropy.

The plan is the model's (model protocol); ``parallel.tensor.apply_tp`` applies whatever plan a model gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from lightning_flagscale.parallel.tensor_parallel.apply import ReplicateParallel, WaitedRowwiseParallel
from lightning_flagscale.parallel.tensor_parallel.partial_grads import LocalSequenceParallel

if TYPE_CHECKING:
    from lightning_flagscale.models.decoder import CausalLM

__all__ = ["GradAllReduce", "MoESequenceParallel", "check_decoder_tp", "decoder_tp_plan", "latent_attention_tp_plan"]


class MoESequenceParallel(PrepareModuleInputOutput):
    """The MoE block under sequence parallelism: this rank's sequence chunk in and out as local tensors, and the TP
    group handed to the block (``MoELayer.sequence_parallel_group``), which routes that chunk itself (ETP = 1), or
    all-gathers the sequence and returns its chunk: a slice, or a reduce-scatter of partial expert outputs when the
    experts are split over the TP ranks (``MoELayer.forward``; the DTensor redistribution could only all-reduce and
    slice)."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True,
        )  # fmt: skip

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sequence_parallel_group = device_mesh.get_group()
        return super()._apply(module, device_mesh)


class GradAllReduce(ParallelStyle):
    """Identity in forward, all-reduce of the gradient over TP in backward (Megatron's
    ``copy_to_tensor_model_parallel_region``), on a parameter-free module.

    For a replicated activation that each TP rank consumes only in part: MLA's shared rotary key, used by the
    rank's own heads, gets a partial gradient per rank. Expressed in DTensor terms: the input becomes a
    ``Replicate`` DTensor and leaves as a local tensor whose gradient is declared ``Partial``, so autograd sums it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=self._replicate, output_fn=self._partial_grad)

    @staticmethod
    def _replicate(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, Tensor) else t for t in inputs
        )

    @staticmethod
    def _partial_grad(module: nn.Module, output: Tensor, mesh: DeviceMesh) -> Tensor:
        return output.to_local(grad_placements=[Partial()]) if isinstance(output, DTensor) else output


def latent_attention_tp_plan(prefix: str, attn: nn.Module) -> dict[str, ParallelStyle]:
    """MLA under TP (``prefix`` ends with ``self_attn.``): heads split, compressed projections replicated.

    ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` are column-parallel (each rank makes its heads' queries, non-rotary keys
    and values from the full latents), ``o_proj`` row-parallel. The down projections ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` and their RMSNorms run replicated on the gathered sequence (Megatron-Core's MLA keeps them
    unsplit too; under SP it runs them on sequence shards and gathers the latents, which saves their FLOPs, not
    their weights): the column-parallel layers after them all-reduce their input gradients, so every rank gets
    the full gradient. The shared rotary key is the one activation used per rank only by its own heads; its
    gradient is all-reduced at ``k_rope_fanout``.
    """
    plan: dict[str, ParallelStyle] = {
        prefix + "kv_a_proj_with_mqa": ReplicateParallel(),
        prefix + "kv_a_layernorm": ReplicateParallel(),
        prefix + "kv_b_proj": ColwiseParallel(),
        prefix + "k_rope_fanout": GradAllReduce(),
    }
    if attn.q_proj is not None:
        plan[prefix + "q_proj"] = ColwiseParallel()
    else:
        plan[prefix + "q_a_proj"] = ReplicateParallel()
        plan[prefix + "q_a_layernorm"] = ReplicateParallel()
        plan[prefix + "q_b_proj"] = ColwiseParallel()
    return plan


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
    norm_style = LocalSequenceParallel if sequence_parallel else ReplicateParallel
    plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        # a plain tensor, not torch's AsyncCollectiveTensor, as the (compiled) first block's input: see the style
        plan["embed_tokens"] = WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        plan["norm"] = norm_style()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=True)
    blocks = [(f"layers.{name}.", block) for name, block in model.layers.items()]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        # MTP: the shared embedding's copy as the embedding; enorm / hnorm / eh_proj (2h -> h, replicated weight)
        # like the norms, on sequence shards under SP; the block as any block; its own final norm like ``norm``.
        plan["mtp.embed_tokens"] = WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        for name, block in mtp.layers.items():
            p = f"mtp.layers.{name}."
            for part in ("enorm", "hnorm", "eh_proj", "norm"):
                plan[p + part] = (
                    LocalSequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()
                )
            blocks.append((p, block))
    for p, block in blocks:
        if model.config.is_mla:
            plan.update(latent_attention_tp_plan(p + "self_attn.", block.self_attn))
        else:
            plan[p + "self_attn.q_proj"] = ColwiseParallel()
            plan[p + "self_attn.k_proj"] = ColwiseParallel()
            plan[p + "self_attn.v_proj"] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        if getattr(block.self_attn, "q_norm", None) is not None:
            # QK-norm runs on the TP-local heads [B, S, H/tp, D]: its weight gradient is a partial sum over the local
            # heads, summed over TP once per step under the strategy (in every backward when the plan is applied alone).
            plan[p + "self_attn.q_norm"] = LocalSequenceParallel(sequence_dim=2, use_local_output=True)
            plan[p + "self_attn.k_norm"] = LocalSequenceParallel(sequence_dim=2, use_local_output=True)
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
            # The MoE block takes and returns this rank's sequence chunk and handles the layout itself
            # (MoELayer.forward): with ETP = 1 it routes that chunk and sums its replicated weights' gradients over
            # TP; with experts split over ETP ranks it all-gathers the sequence and returns its chunk.
            plan[p + "mlp"] = MoESequenceParallel()
    return plan

"""Shared mapping for the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE).

Our experts are grouped tensors (``moe/__init__.py``): ``experts.gate_up_proj`` [E, 2I, H] whose rows ``[:I]``
are expert e's gate and ``[I:]`` its up projection, and ``experts.down_proj`` [E, H, I]. Hub checkpoints (and
``save_pretrained`` of transformers 4 and 5) store one tensor per expert, so each grouped tensor is a ``Stack``
over experts of (gate, up) ``Concat``s: under expert parallelism a rank reads only its own experts' tensors.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.decoder_family import DenseDecoderFamily
from lightning_flagscale.convert.registry import HFConversionError
from lightning_flagscale.convert.specs import Concat, Direct, Spec, Stack

__all__ = ["MoEDecoderFamily", "moe_layers_from_hf"]


def moe_layers_from_hf(num_layers: int, sparse_step: int, mlp_only_layers: list[int]) -> dict[str, int]:
    """Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` as our ``first_k_dense_layers`` / ``moe_layer_freq``.

    HF: layer i is MoE iff ``i not in mlp_only_layers and (i + 1) % sparse_step == 0``; ours: iff ``i >= k and
    (i - k) % freq == 0``. Layouts that are not of our form are refused rather than approximated.
    """
    wanted = [i for i in range(num_layers) if i not in set(mlp_only_layers) and (i + 1) % sparse_step == 0]
    if not wanted:
        raise HFConversionError("config.json 'decoder_sparse_step'/'mlp_only_layers' leave no MoE layer.")
    k = wanted[0]
    freq = wanted[1] - wanted[0] if len(wanted) > 1 else 1
    if wanted != list(range(k, num_layers, freq)):
        raise HFConversionError(
            f"config.json fields 'decoder_sparse_step'={sparse_step}, 'mlp_only_layers'={mlp_only_layers} give MoE "
            f"layers {wanted}, which is not 'first k dense, then every n-th' (first_k_dense_layers/moe_layer_freq)."
        )
    return {"first_k_dense_layers": k, "moe_layer_freq": freq}


class MoEDecoderFamily(DenseDecoderFamily):
    """A Llama-like attention with routed experts; subclasses give the HF expert naming."""

    is_moe_family = True
    moe_prefix: ClassVar[str] = "mlp"
    """HF module holding the router and experts in a block (``block_sparse_moe`` for Mixtral)."""
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    """HF per-expert (gate, up, down) names (``w1``, ``w3``, ``w2`` for Mixtral)."""
    has_shared_expert: ClassVar[bool] = False

    def check_ours(self, config: TransformerConfig) -> None:
        super().check_ours(config)
        problems = {
            "router_type": (config.router_type, "softmax"),
            "moe_router_scaling_factor": (config.moe_router_scaling_factor, 1.0),
            "moe_router_num_groups": (config.moe_router_num_groups, None),
            "moe_router_group_topk": (config.moe_router_group_topk, None),
            "moe_router_bias_update_rate": (config.moe_router_bias_update_rate, 0.0),
        }
        for key, (value, allowed) in problems.items():
            if value != allowed:
                raise HFConversionError(f"{self.model_type} cannot express {key}={value!r} (HF uses {allowed!r}).")
        if bool(config.num_shared_experts) != self.has_shared_expert:
            raise HFConversionError(
                f"{self.model_type} {'needs' if self.has_shared_expert else 'has no'} shared experts, got "
                f"num_shared_experts={config.num_shared_experts}."
            )

    def moe_extra_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Router settings common to the MoE families."""
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise HFConversionError("config.json has neither 'num_experts' nor 'num_local_experts'.")
        return dict(
            num_experts=int(experts),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            router_type="softmax",
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
        )

    def mlp_specs(self, config: TransformerConfig, i: int) -> dict[str, Spec]:
        if not config.is_moe_layer(i):
            return super().mlp_specs(config, i)
        p = f"model.layers.{i}.{self.moe_prefix}"
        gate, up, down = self.expert_names
        inner = config.moe_intermediate_size
        specs: dict[str, Spec] = {
            "mlp.gate.weight": Direct(f"{p}.gate.weight"),
            "mlp.experts.gate_up_proj": Stack(
                tuple(
                    Concat((f"{p}.experts.{e}.{gate}.weight", f"{p}.experts.{e}.{up}.weight"), sizes=(inner, inner))
                    for e in range(config.num_experts)
                )
            ),
            "mlp.experts.down_proj": Stack(
                tuple(Direct(f"{p}.experts.{e}.{down}.weight") for e in range(config.num_experts))
            ),
        }
        if self.has_shared_expert:
            for name in ("gate_proj", "up_proj", "down_proj"):
                specs[f"mlp.shared_expert.{name}.weight"] = Direct(f"{p}.shared_expert.{name}.weight")
            if config.shared_expert_gate:
                specs["mlp.shared_expert_gate.weight"] = Direct(f"{p}.shared_expert_gate.weight")
        return specs

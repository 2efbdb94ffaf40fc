"""DeepSeek-V3: multi-head latent attention (``models/attention.py``'s ``LatentAttention``) and DeepSeek's routing
(sigmoid scores, group-limited top-k, bias-corrected load balancing, shared experts, leading dense blocks) on the
generic decoder: presets (``presets.py``, data, with ``deepseek-v3-routing-tiny`` keeping standard attention) and the
``deepseek_v3`` HF converter (``hf.py``), registered on import."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.deepseek_v3.hf import DeepseekV3Family
from lightning_flagscale.models.deepseek_v3.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "DeepseekV3Family"]

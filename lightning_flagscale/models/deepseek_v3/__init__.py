"""DeepSeek-V3's router and expert layout (sigmoid scores, grouped top-k, bias-corrected load balancing, shared
experts, leading dense blocks) on the generic decoder with standard attention (no MLA yet, hence no HF converter):
presets (``presets.py``, data), registered on import."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.deepseek_v3.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS"]

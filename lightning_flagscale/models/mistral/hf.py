"""Mistral (``MistralForCausalLM``): Llama math; a sliding window is accepted only when it never binds."""

from __future__ import annotations

from typing import Any

from lightning_flagscale.convert.decoder_family import DenseDecoderFamily, max_seq_len_ok
from lightning_flagscale.convert.registry import HFConversionError, register_family

__all__ = ["MistralFamily"]


@register_family
class MistralFamily(DenseDecoderFamily):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    attention_bias_key = None

    def check_hf(self, hf: dict[str, Any], max_seq_len: int) -> None:
        super().check_hf(hf, max_seq_len)
        window = hf.get("sliding_window")
        if not max_seq_len_ok(window, max_seq_len):
            raise HFConversionError(
                f"config.json field 'sliding_window'={window} is shorter than max_seq_len={max_seq_len}; our "
                f"attention has no sliding window, so pass max_seq_len<={window} to train/evaluate exactly."
            )

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        return {**super().config_to_hf(config), "sliding_window": None}

"""``LoRAConfig``: which linear layers get low-rank adapters, their rank, scale, dropout and init (issue 40).

Pure data and rules: the adapter modules live in ``models/lora.py``, their tensor-parallel styles in
``parallel/tensor_parallel/lora.py`` and the ``peft`` interchange in ``convert/peft.py``. Field names follow
``peft.LoraConfig`` where the meaning is the same (``r`` is ``rank`` here), so an ``adapter_config.json`` maps onto
it field by field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_flagscale.config.fields import check_known_fields

__all__ = ["DEFAULT_TARGET_MODULES", "LoRAConfig"]

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections: the choice of the LoRA paper and of ``peft``'s Llama default (``q_proj, v_proj``) plus
k and o, as torchtune and litgpt recipes use."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters ``W x + scaling * B (A dropout(x))`` on chosen ``nn.Linear`` layers, base weights frozen."""

    rank: int = 8
    """Inner dimension ``r`` of the adapters (``A``: [r, in], ``B``: [out, r])."""
    alpha: float = 16.0
    """``lora_alpha``: the adapter output is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the base path never sees it)."""
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """A list of module names, each matching a module whose name is it or ends with ``.<it>`` (``"q_proj"``,
    ``"mlp.down_proj"``, ``"layers.0.self_attn.q_proj"``), or one regular expression matched in full against each
    module's name relative to the model (``r"layers\\.[01]\\.self_attn\\.(q|v)_proj"``); peft's semantics."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski 2023, arXiv:2312.03732): scale by ``alpha / sqrt(rank)``."""
    use_dora: bool = False
    """DoRA (weight-decomposed LoRA, Liu et al. 2024, arXiv:2402.09353): a trainable magnitude per output row,
    ``W' = m * (W + s B A) / ||W + s B A||`` with the norm detached (peft's), under every layout; on the grouped
    experts per expert and weight (m [E, out]: peft has no DoRA for target_parameters, see docs/lora.md)."""
    init_lora_weights: bool | Literal["gaussian"] = True
    """``True``: ``A`` Kaiming-uniform, ``B`` zero (the adapted model starts equal to the base, peft's default);
    ``"gaussian"``: ``A ~ N(0, 1/rank)``, ``B`` zero; ``False``: ``B`` random too (tests only: not a no-op)."""
    adapter_dir: str | None = None
    """A ``peft`` LoRA folder whose weights start the adapters instead of ``init_lora_weights`` (continued training;
    ``convert.peft.lora_config_from_peft`` fills every field from its ``adapter_config.json``)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be a positive int, got {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise ValueError(
                f"LoRAConfig.init_lora_weights must be True, False or 'gaussian', got {self.init_lora_weights!r}."
            )
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as err:
                raise ValueError(
                    f"LoRAConfig.target_modules={self.target_modules!r} is not a valid regex: {err}."
                ) from err
        else:
            self.target_modules = list(self.target_modules)
            if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
                raise ValueError(
                    f"LoRAConfig.target_modules must be a non-empty list of module names or a regex, got "
                    f"{self.target_modules!r}."
                )

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output: ``alpha / rank``, or ``alpha / sqrt(rank)`` under rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def matches(self, name: str) -> bool:
        """Whether the module called ``name`` (relative to the model, e.g. ``layers.0.self_attn.q_proj``) is a
        target (``target_modules``' docstring)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        return any(name == t or name.endswith("." + t) for t in self.target_modules)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
            "target_modules": self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules),
            "use_rslora": self.use_rslora, "use_dora": self.use_dora, "init_lora_weights": self.init_lora_weights,
            "adapter_dir": self.adapter_dir,
        }  # fmt: skip

    @classmethod
    def from_value(cls, value: LoRAConfig | dict[str, Any] | None) -> LoRAConfig | None:
        """A config from what a module argument, a YAML recipe or a checkpoint's hyper-parameters hold."""
        if value is None or isinstance(value, LoRAConfig):
            return value
        if isinstance(value, dict):
            check_known_fields(cls, value)
            return cls(**value)
        raise TypeError(f"lora must be a LoRAConfig, a dict of its fields or None, got {type(value).__name__}.")

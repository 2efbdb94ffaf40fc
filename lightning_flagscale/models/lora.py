"""LoRA adapters on the model's ``nn.Linear`` layers (Hu et al. 2021, arXiv:2106.09685; issue 40).

A targeted ``nn.Linear`` is replaced by a :class:`LoRALinear` that *is* an ``nn.Linear`` holding the very same
``weight`` / ``bias`` Parameters plus two child layers ``lora_A`` [r, in] and ``lora_B`` [out, r]:
``y = W x + b + scaling * B(A(dropout(x)))``. Keeping the base parameters where they were keeps every name the rest
of the package knows (HF import/export maps, TP plans, pipeline units, checkpoints): the adapters are new names
``<module>.lora_A.weight`` / ``<module>.lora_B.weight``, the names ``peft`` gives them.

Adapters are inserted when the module builds its model (``CausalLMModule(lora=...)``), before the parallelize plan
runs, so every later step sees them: pipeline stages carry their blocks' adapters, the tensor-parallel plan shards
them with their base layer (``parallel/tensor_parallel/lora.py``), ZeRO shards and reduces only what has a gradient.
The base weights are frozen here (``requires_grad=False``), which torch's parallel styles, FSDP2 and our buckets
keep: they get no gradient, no fp32 master copy and no optimizer state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.distributed.dtensor import local_tensor
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.models.init import canonical_fqn, copy_global_into, seed_for
from lightning_flagscale.models.weights import weight_source
from lightning_flagscale.moe.experts import GroupedExperts

__all__ = [
    "ADAPTER_KEYS",
    "EXPERT_WEIGHTS",
    "MAGNITUDE_KEY",
    "LoRAGroupedExperts",
    "LoRALinear",
    "adapter_modules",
    "apply_lora",
    "base_weights_reference",
    "check_base_weights",
    "expert_adapter_modules",
    "freeze_base",
    "hf_weights_sha256",
    "init_adapters",
    "init_magnitudes",
    "is_adapter_name",
    "merged_weight",
    "tensors_sha256",
]

ADAPTER_KEYS = ("lora_A", "lora_B")
"""The child names that hold adapter weights (peft's)."""
MAGNITUDE_KEY = "lora_magnitude_vector"
"""DoRA's trainable per-output-row magnitude ``m`` (peft's name)."""


def is_adapter_name(fqn: str) -> bool:
    """Whether the parameter (or module) name ``fqn`` belongs to an adapter."""
    return any(f".{key}." in f".{fqn}." for key in (*ADAPTER_KEYS, MAGNITUDE_KEY))


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (the base's own ``weight``/``bias`` Parameters) plus a low-rank update ``scaling * B A``.

    With ``use_dora`` (DoRA, Liu et al. 2024, arXiv:2402.09353) also a magnitude ``m`` [out]: the layer computes with
    ``m * (W + s B A) / ||W + s B A||`` (one L2 norm per output row, detached as in peft, so it acts as a constant in
    backward). Under TP the norm of a column-parallel layer is local to its rows; of a row-parallel one DTensor sums
    the squares over the TP group (``parallel/tensor_parallel/lora.py`` places ``m`` like the output rows).
    """

    def __init__(
        self, base: nn.Linear, *, rank: int, scaling: float, dropout: float = 0.0, use_dora: bool = False
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the base's Parameters are reused, nothing is allocated
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        kw = dict(bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = float(scaling)
        magnitude = nn.Parameter(torch.empty(base.out_features, device=kw["device"], dtype=kw["dtype"]))
        self.register_parameter(MAGNITUDE_KEY, magnitude if use_dora else None)

    def forward(self, x: Tensor) -> Tensor:
        # Under TP every tensor here may be a DTensor; the placements the TP style gave A and B make this the
        # Megatron LoRA layout without a line of communication code (see parallel/tensor_parallel/lora.py).
        dropped = self.lora_dropout(x)
        update = self.lora_B(self.lora_A(dropped)) * self.scaling
        if self.lora_magnitude_vector is None:
            return F.linear(x, self.weight, self.bias) + update
        scale = self.lora_magnitude_vector / self.weight_norm()  # [out]; the norm is a constant (peft's choice)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base = F.linear(x, self.weight)
            out = scale * (base + update)
            return out if self.bias is None else out + self.bias
        # peft's form with dropout: the base path sees x, the DoRA correction and the update see dropout(x)
        return F.linear(x, self.weight, self.bias) + (scale - 1) * F.linear(dropped, self.weight) + scale * update

    @torch.no_grad()
    def weight_norm(self) -> Tensor:
        """``||W + s B A||`` per output row [out], without a gradient (a DTensor under TP: summed over the group
        for a row-parallel layer)."""
        return torch.linalg.vector_norm(self.weight + self.scaling * (self.lora_B.weight @ self.lora_A.weight), dim=1)

    def extra_repr(self) -> str:
        dora = ", dora" if self.lora_magnitude_vector is not None else ""
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}{dora}"


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The stacked expert weights [E, out, in] that per-expert adapters adapt (both, when the experts are a target)."""


class _ExpertFactors(nn.Module):
    """One factor (all A, or all B) of the per-expert adapters: a [E, rows, cols] Parameter per expert weight."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))


class LoRAGroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` (the base's own stacked Parameters) plus one adapter per expert and weight:
    ``lora_A.<w>`` [E, r, in] and ``lora_B.<w>`` [E, out, r] for ``w`` in ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I]; expert ``e`` computes with ``W[e] + scaling * B[e] @ A[e]``.

    The adapted weights are formed per step from this rank's experts (``local_weights``), as peft's ``ParamWrapper``
    does for ``target_parameters``: the token-sorted grouped GEMMs, the capacity path and expert parallelism run
    unchanged, and EP shards the adapters on dim 0 with their experts (``stacked_parameters``). No adapter dropout
    (peft refuses it for stacked experts too: ``x`` cannot be factored out of ``B A dropout(x)`` per weight).

    With ``use_dora`` also a magnitude ``lora_magnitude_vector.<w>`` [E, out]: each expert's weight is the dense
    DoRA of :class:`LoRALinear` on its own, ``m[e] * V[e] / ||V[e]||`` with ``V[e] = W[e] + s B[e] A[e]`` and one
    detached L2 norm per output row of ``V[e]`` (the DoRA paper's column norm). peft has no DoRA for
    ``target_parameters`` (its ``ParamWrapper`` refuses ``use_dora``): this is the dense definition per expert."""

    def __init__(self, base: GroupedExperts, *, rank: int, scaling: float, use_dora: bool = False) -> None:
        nn.Module.__init__(self)  # not GroupedExperts.__init__: the base's Parameters are reused
        self.num_experts, self.hidden_size = base.num_experts, base.hidden_size
        self.intermediate_size, self.use_grouped_mm = base.intermediate_size, base.use_grouped_mm
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        e, kw = base.num_experts, dict(device=base.gate_up_proj.device, dtype=base.gate_up_proj.dtype)
        shapes = {w: tuple(getattr(base, w).shape) for w in EXPERT_WEIGHTS}
        self.lora_A = _ExpertFactors({w: (e, rank, s[2]) for w, s in shapes.items()}, **kw)
        self.lora_B = _ExpertFactors({w: (e, s[1], rank) for w, s in shapes.items()}, **kw)
        magnitude = _ExpertFactors({w: (e, s[1]) for w, s in shapes.items()}, **kw) if use_dora else None
        self.add_module(MAGNITUDE_KEY, magnitude)
        self.scaling = float(scaling)

    def stacked_parameters(self) -> list[tuple[nn.Module, str]]:
        factors = [self.lora_A, self.lora_B] + (
            [] if self.lora_magnitude_vector is None else [self.lora_magnitude_vector]
        )
        return [*super().stacked_parameters(), *((f, w) for f in factors for w in EXPERT_WEIGHTS)]

    def local_weights(self) -> tuple[Tensor, Tensor]:
        """This rank's experts' ``W + scaling * B @ A`` (one batched matmul per weight; gradients reach A and B),
        with DoRA each row rescaled to ``m / ||W + scaling * B @ A||`` (the norm detached)."""
        base = super().local_weights()
        adapted = []
        for w, n in zip(base, EXPERT_WEIGHTS, strict=True):
            v = w + self.scaling * torch.bmm(
                local_tensor(getattr(self.lora_B, n)), local_tensor(getattr(self.lora_A, n))
            )
            if self.lora_magnitude_vector is not None:
                norm = torch.linalg.vector_norm(v.detach(), dim=-1)  # [E, out], a constant in backward (peft's)
                v = v * (local_tensor(getattr(self.lora_magnitude_vector, n)) / norm).unsqueeze(-1)
            adapted.append(v)
        return tuple(adapted)  # type: ignore[return-value]

    @torch.no_grad()
    def weight_norms(self) -> dict[str, Tensor]:
        """``||W[e] + s B[e] A[e]||`` per expert and output row [E, out] of each weight, for this rank's part of the
        magnitudes: computed on the local shards, which hold the same experts when the weight, its factors and its
        magnitude are sharded alike on dim 0 (EP, ZeRO-3); else on the full tensors (collective)."""
        norms = {}
        for n in EXPERT_WEIGHTS:
            tensors = [getattr(self, n), getattr(self.lora_A, n), getattr(self.lora_B, n)]
            target = getattr(self.lora_magnitude_vector, n)
            alike = all(_same_dim0_layout(t, target) for t in tensors)
            w, a, b = (local_tensor(t) if alike else _full(t) for t in tensors)
            norms[n] = torch.linalg.vector_norm(w + self.scaling * torch.bmm(b, a), dim=-1)
        return norms

    def extra_repr(self) -> str:
        dora = ", dora" if self.lora_magnitude_vector is not None else ""
        return f"rank={self.lora_A.gate_up_proj.shape[1]}, scaling={self.scaling:g}{dora}"


def _same_dim0_layout(t: Tensor, target: Tensor) -> bool:
    """Whether the local shard of ``t`` holds the same dim-0 rows as ``target``'s (both plain, or both DTensors on
    one mesh with one placement list that shards dim 0 only)."""
    if not isinstance(t, DTensor) and not isinstance(target, DTensor):
        return True
    if not (isinstance(t, DTensor) and isinstance(target, DTensor)):
        return False
    return (
        t.device_mesh == target.device_mesh
        and t.placements == target.placements
        and t.shape[0] == target.shape[0]
        and all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in t.placements)
    )


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _adapted(module: nn.Module, config: LoRAConfig) -> nn.Module:
    if isinstance(module, GroupedExperts):
        return LoRAGroupedExperts(module, rank=config.rank, scaling=config.scaling, use_dora=config.use_dora)
    return LoRALinear(
        module, rank=config.rank, scaling=config.scaling, dropout=config.dropout, use_dora=config.use_dora
    )


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` that ``config`` targets by a :class:`LoRALinear` and freeze the rest.

    Works on a model built on the meta device (nothing is allocated) or a real one. Returns the adapted module names.
    Raises ``ValueError`` when nothing matches or a target is not an ``nn.Linear`` (fused MoE experts, embeddings).
    """
    targets = [(name, mod) for name, mod in model.named_modules() if name and config.matches(canonical_fqn(name))]
    adaptable = (nn.Linear, GroupedExperts)
    wrong = [
        f"{n} ({type(m).__name__})"
        for n, m in targets
        if not isinstance(m, adaptable) or isinstance(m, (LoRALinear, LoRAGroupedExperts))
    ]
    if wrong:
        raise ValueError(
            f"LoRA target_modules={config.target_modules!r} match modules that are neither nn.Linear layers nor "
            f"grouped MoE experts: {', '.join(wrong[:5])}. Adapters go on linear layers (q/k/v/o_proj, "
            "gate/up/down_proj, lm_head) and on `experts` (per-expert adapters of gate_up_proj and down_proj)."
        )
    if config.dropout > 0 and any(isinstance(m, GroupedExperts) for _, m in targets):
        raise ValueError(
            f"LoRA dropout={config.dropout} with the grouped MoE experts as a target: per-expert adapters are "
            "merged into the expert weights per step (as peft's target_parameters), which cannot drop out the "
            "adapter's input; set dropout=0 or leave `experts` out of target_modules."
        )
    if not targets:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"LoRA target_modules={config.target_modules!r} match no module of {type(model).__name__}; its linear "
            f"layers are named {', '.join(linears)}."
        )
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _adapted(linear, config))
    freeze_base(model)
    return [name for name, _ in targets]


def freeze_base(model: nn.Module) -> None:
    """Only adapter parameters train: every other parameter gets ``requires_grad=False``."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted linear layers of ``model`` (or of a pipeline stage) by canonical name."""
    return {canonical_fqn(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def expert_adapter_modules(model: nn.Module) -> dict[str, LoRAGroupedExperts]:
    """The grouped experts of ``model`` (or of a pipeline stage) that carry per-expert adapters, by canonical name."""
    return {canonical_fqn(name): m for name, m in model.named_modules() if isinstance(m, LoRAGroupedExperts)}


@torch.no_grad()
def init_adapters(model: nn.Module, config: LoRAConfig, seed: int) -> None:
    """Layout-independent adapter init (as ``CausalLM.init_weights``: one generator per parameter name, the full
    tensor drawn on the CPU and this rank's shard copied out). ``init_lora_weights`` as peft: ``True`` A
    Kaiming-uniform(a=sqrt 5), i.e. U(-1/sqrt(in), 1/sqrt(in)); ``"gaussian"`` A ~ N(0, 1/r); B zero unless ``False``
    (then B ~ U(-1/sqrt(r), 1/sqrt(r)) so that the adapter changes the model from the start). With ``adapter_dir``
    the adapters are read from that peft folder instead."""
    if config.adapter_dir:  # continued training: the weights of a peft folder (convert/peft.py registers "peft")
        weight_source("peft").load_weights(model, config.adapter_dir)
        return
    cpu = torch.device("cpu")
    params = [
        (f"{name}.{key}.weight", key, getattr(module, key).weight)
        for name, module in adapter_modules(model).items()
        for key in ADAPTER_KEYS
    ]
    params += [
        (f"{name}.{key}.{w}", key, getattr(getattr(module, key), w))
        for name, module in expert_adapter_modules(model).items()
        for key in ADAPTER_KEYS
        for w in EXPERT_WEIGHTS
    ]
    for fqn, key, param in params:
        shape = tuple(param.shape)  # the global shape of a DTensor; [E, rows, cols] for per-expert adapters
        gen = torch.Generator(device=cpu).manual_seed(seed_for(seed, fqn))
        fan_in = shape[-1]
        if key == "lora_B" and config.init_lora_weights is not False:
            full = torch.zeros(shape, device=cpu)
        elif key == "lora_A" and config.init_lora_weights == "gaussian":
            full = torch.randn(shape, generator=gen, device=cpu) / config.rank
        else:
            bound = 1.0 / math.sqrt(fan_in)
            full = torch.rand(shape, generator=gen, device=cpu) * (2 * bound) - bound
        copy_global_into(param, full)
    init_magnitudes(model)


@torch.no_grad()
def init_magnitudes(model: nn.Module) -> None:
    """DoRA: ``m = ||W + s B A||`` per output row of every DoRA layer (peft's init: the adapted model starts as
    ``W + s B A``), from this layer's current weights; under TP each rank keeps its rows of the (global) norm. Per-expert
    magnitudes likewise per expert and row (``LoRAGroupedExperts.weight_norms``), each rank its experts'."""
    for module in adapter_modules(model).values():
        if module.lora_magnitude_vector is None:
            continue
        norm = module.weight_norm()
        copy_global_into(module.lora_magnitude_vector, norm.full_tensor() if isinstance(norm, DTensor) else norm)
    for experts in expert_adapter_modules(model).values():
        if experts.lora_magnitude_vector is None:
            continue
        for n, norm in experts.weight_norms().items():
            target = getattr(experts.lora_magnitude_vector, n)
            if tuple(norm.shape) == tuple(target.shape):  # the full norms (plain, or computed on full tensors)
                copy_global_into(target, norm)
            else:  # this rank's experts' norms into its shard
                local_tensor(target).copy_(norm)


def merged_weight(
    weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float, magnitude: Tensor | None = None
) -> Tensor:
    """``W + scaling * B @ A`` (full tensors; per expert for stacked [E, ...] ones), computed in fp32 and returned in
    ``weight``'s dtype; with a DoRA ``magnitude`` [out] ([E, out] per expert), each row rescaled to it:
    ``m * V / ||V||``."""
    merged = weight.float() + scaling * (lora_b.float() @ lora_a.float())
    if magnitude is not None:
        merged = merged * (magnitude.float() / torch.linalg.vector_norm(merged, dim=-1)).unsqueeze(-1)
    return merged.to(weight.dtype)


# ---- the base a LoRA checkpoint refers to (issue 40 item 4) ------------------------------------------------------
# A LoRA run's checkpoint holds what trains (adapters, their optimizer state, buffers), not the frozen base: it names
# where the base came from and a content hash of it, and a resume rebuilds the base the same way (the module's
# ``hf_dir`` or ``init_seed``) and refuses one whose hash differs.


def hf_weights_sha256(hf_dir: str | Path) -> str:
    """SHA-256 over the ``*.safetensors`` files of an HF folder (each file's name and bytes, in name order): what
    ``from_hf`` reads as weights. One sequential read of the files, no tensor is decoded."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} holds no *.safetensors file to hash.")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def tensors_sha256(named: Iterable[tuple[str, Tensor]]) -> str:
    """SHA-256 over full CPU tensors in name order (each name, dtype, shape and bytes)."""
    digest = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_weights_reference(
    config: TransformerConfig,
    hf_dir: str | None,
    init_seed: int,
    vocab_multiple: int,
    *,
    build: Callable[[], nn.Module] | None = None,
) -> dict[str, Any]:
    """Where a module's base weights come from and their SHA-256: the HF folder's safetensors bytes, or, for a
    seeded init, the fp32 parameters of the model built and initialised once on this process's CPU (the init is
    layout-independent, so this is the base every layout starts from). ``build`` makes that model without adapters
    (default: a ``CausalLM`` of ``config``; the VLM passes its own). Computed once per module (the module caches
    it); on one rank, whose answer the strategy broadcasts."""
    if hf_dir:
        return {"source": "hf", "hf_dir": str(Path(hf_dir).resolve()), "sha256": hf_weights_sha256(hf_dir)}
    with torch.device("cpu"):
        model = build() if build is not None else CausalLM(config, vocab_multiple=vocab_multiple)
    model.init_weights(init_seed)
    return {
        "source": "init", "model": config.name, "init_seed": int(init_seed),
        "sha256": tensors_sha256(model.state_dict().items()),
    }  # fmt: skip


def _describe(ref: dict[str, Any]) -> str:
    if ref.get("source") == "hf":
        return f"the HF folder {ref.get('hf_dir')} (sha256 {ref.get('sha256')})"
    return f"model {ref.get('model')!r} initialised with init_seed={ref.get('init_seed')} (sha256 {ref.get('sha256')})"


def check_base_weights(saved: dict[str, Any] | None, current: dict[str, Any] | None, path: Any) -> None:
    """Raise unless checkpoint ``path`` (whose base reference is ``saved``; None: it holds the whole model) fits a
    module whose base reference is ``current`` (None: the module trains, and loads, all its weights)."""
    if saved is None and current is None:
        return
    if current is None:
        raise ValueError(
            f"Checkpoint {path} holds only the trainable parameters of a LoRA run (adapters and their optimizer "
            f"state) on the base {_describe(saved)}, but this module has no LoRA adapters and would need every "
            "weight from it: resume with the run's `lora=` config and the same base, or merge the adapters "
            "(`convert ckpt-to-hf`)."
        )
    if saved is None:
        raise ValueError(
            f"Checkpoint {path} holds a whole model without a base-weights reference, but this module trains LoRA "
            "adapters on a frozen base it builds itself; resume a LoRA run from its own checkpoints (start LoRA "
            "from a full checkpoint by exporting it to HF first and passing `hf_dir`)."
        )
    if saved.get("sha256") != current.get("sha256"):
        raise ValueError(
            f"Checkpoint {path} was trained on the base {_describe(saved)}, but this module's base is "
            f"{_describe(current)}: LoRA adapters resume only on the base they were trained on. Pass that base "
            "(model.hf_dir, or the same preset and init_seed)."
        )

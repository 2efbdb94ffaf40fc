"""LoRA adapters on one process (issue 40 item 1): targets, scaling, init, freezing and the optimizer's contents."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.models.lora import LoRALinear, adapter_modules, is_adapter_name
from tests.strategies._lm import tiny_config


def _module(lora: LoRAConfig | dict | None, **kw) -> CausalLMModule:
    module = CausalLMModule(tiny_config(), lora=lora, optimizer="sgd", **kw)
    module.configure_model()
    return module


def test_default_init_is_a_no_op_and_only_adapters_train():
    x = torch.randint(0, 256, (2, 8))
    base, adapted = _module(None), _module(LoRAConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert torch.equal(base(x), adapted(x))  # B = 0: the adapted model starts as the base
    names = sorted(adapter_modules(adapted.model))
    assert names == [
        f"layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")
    ]
    trainable = {n for n, p in adapted.model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{k}.weight" for m in names for k in ("lora_A", "lora_B")}
    opt = adapted.configure_optimizers()["optimizer"]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in adapted.model.named_parameters() if is_adapter_name(n)
    }
    # base weights are shared, not copied: the same names and values as the plain model
    for name, p in base.model.named_parameters():
        assert torch.equal(adapted.model.get_parameter(name), p)


def test_forward_is_base_plus_scaled_low_rank_update():
    lora = LoRAConfig(rank=4, alpha=6.0, target_modules=["o_proj"], init_lora_weights=False, use_rslora=True)
    layer = _module(lora).model.layers["0"].self_attn.o_proj
    assert isinstance(layer, LoRALinear) and layer.scaling == pytest.approx(6.0 / math.sqrt(4))
    x = torch.randn(3, layer.in_features)
    want = x @ layer.weight.T + layer.scaling * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
    torch.testing.assert_close(layer(x), want)
    assert LoRAConfig(rank=4, alpha=6.0).scaling == 1.5


def test_regex_targets_and_layout_independent_init():
    lora = LoRAConfig(rank=2, target_modules=r"layers\.1\.self_attn\.(q|k)_proj", init_lora_weights="gaussian")
    a, b = _module(lora), _module(lora)
    assert sorted(adapter_modules(a.model)) == ["layers.1.self_attn.k_proj", "layers.1.self_attn.q_proj"]
    for name, p in a.model.named_parameters():
        assert torch.equal(p, b.model.get_parameter(name)), name  # per-name seeds
    assert a.model.layers["1"].self_attn.q_proj.lora_B.weight.abs().sum() == 0


def test_module_accepts_a_dict():
    assert _module({"rank": 2, "target_modules": ["up_proj"]}).lora == LoRAConfig(rank=2, target_modules=["up_proj"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rank=0), "rank must be a positive int"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(target_modules=[]), "non-empty list"),
        (dict(target_modules="(["), "not a valid regex"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


def test_unknown_field_and_target_errors():
    with pytest.raises(TypeError, match="Did you mean 'rank'"):
        _module({"rnak": 4})
    with pytest.raises(ValueError, match=r"match no module of CausalLM; its linear layers are named .*q_proj"):
        _module(LoRAConfig(target_modules=["query"]))
    with pytest.raises(
        ValueError, match=r"neither nn\.Linear layers nor grouped MoE experts: layers\.0\.input_layernorm"
    ):
        _module(LoRAConfig(target_modules=["input_layernorm"]))


def test_base_reference_of_an_hf_folder_hashes_its_safetensors_bytes(tmp_path):
    """Item 4: the base an HF LoRA run's checkpoints refer to is the folder and the SHA-256 of its safetensors."""
    from lightning_flagscale.convert import export_hf
    from lightning_flagscale.models.lora import hf_weights_sha256

    export_hf(_module(None), tmp_path / "hf")
    module = CausalLMModule.from_hf(str(tmp_path / "hf"), lora=LoRAConfig(rank=2))
    ref = module.base_weights_reference()
    assert ref == {
        "source": "hf",
        "hf_dir": str((tmp_path / "hf").resolve()),
        "sha256": hf_weights_sha256(tmp_path / "hf"),
    }
    assert not module.checkpoint_frozen_weights and _module(None).checkpoint_frozen_weights
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert hf_weights_sha256(tmp_path / "hf") != ref["sha256"]


def test_check_base_weights_refusals():
    from lightning_flagscale.models.lora import check_base_weights

    init = {"source": "init", "model": "llama-tiny", "init_seed": 0, "sha256": "a" * 64}
    hf = {"source": "hf", "hf_dir": "/models/x", "sha256": "b" * 64}
    check_base_weights(None, None, "ck")
    check_base_weights(init, dict(init), "ck")
    with pytest.raises(ValueError, match=r"trained on the base model 'llama-tiny' initialised with init_seed=0 "
                                         r"\(sha256 a{64}\), but this module's base is the HF folder /models/x "
                                         r"\(sha256 b{64}\)"):  # fmt: skip
        check_base_weights(init, hf, "ck")
    with pytest.raises(ValueError, match="holds only the trainable parameters of a LoRA run"):
        check_base_weights(hf, None, "ck")
    with pytest.raises(ValueError, match="holds a whole model without a base-weights reference"):
        check_base_weights(None, hf, "ck")


def test_per_expert_adapters_compute_each_experts_own_update_and_only_they_train():
    """Item 2: targeting ``experts`` gives every expert its own A [r, in] / B [out, r] for gate_up_proj and
    down_proj; the grouped path equals the per-expert loop ``x W[e]^T + s (x A[e]^T) B[e]^T``; only adapters get
    gradients; dropout is refused (the update is merged into the expert weights per step)."""
    from lightning_flagscale.models.lora import LoRAGroupedExperts, expert_adapter_modules
    from lightning_flagscale.moe.experts import _swiglu
    from tests.moe._trainer import shrink

    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "experts"], init_lora_weights=False)
    module = CausalLMModule(shrink("mixtral-tiny"), lora=lora, optimizer="sgd")
    module.configure_model()
    experts = expert_adapter_modules(module.model)
    assert sorted(experts) == [f"layers.{i}.mlp.experts" for i in range(module.config.num_layers)]
    layer = next(iter(experts.values()))
    assert isinstance(layer, LoRAGroupedExperts)
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    assert layer.lora_A.gate_up_proj.shape == (e, 2, h) and layer.lora_B.gate_up_proj.shape == (e, 2 * i, 2)
    assert layer.lora_A.down_proj.shape == (e, 2, i) and layer.lora_B.down_proj.shape == (e, h, 2)
    counts = [3, 0, 2, 1][:e] + [1] * max(0, e - 4)
    x = torch.randn(sum(counts), h, generator=torch.Generator().manual_seed(0))
    want = []
    for k, seg in enumerate(x.split(counts)):
        a1, b1 = layer.lora_A.gate_up_proj[k], layer.lora_B.gate_up_proj[k]
        a2, b2 = layer.lora_A.down_proj[k], layer.lora_B.down_proj[k]
        hid = _swiglu(seg @ layer.gate_up_proj[k].T + 2.0 * (seg @ a1.T) @ b1.T)
        want.append(hid @ layer.down_proj[k].T + 2.0 * (hid @ a2.T) @ b2.T)
    torch.testing.assert_close(layer(x, counts), torch.cat(want), rtol=1e-5, atol=1e-6)
    module(torch.randint(0, 256, (2, 8))).float().pow(2).mean().backward()
    with_grad = {n for n, p in module.model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in module.model.named_parameters() if is_adapter_name(n)}
    assert {f"layers.0.mlp.experts.{k}.{w}" for k in ("lora_A", "lora_B") for w in ("gate_up_proj", "down_proj")} <= (
        with_grad
    )
    with pytest.raises(ValueError, match=r"dropout=0\.1 with the grouped MoE experts"):
        CausalLMModule(
            shrink("mixtral-tiny"), lora=LoRAConfig(target_modules=["experts"], dropout=0.1)
        ).configure_model()


def test_per_expert_dora_is_the_dense_dora_of_each_expert():
    """Item 1: per-expert DoRA (peft has none for target_parameters) is defined as dense DoRA per expert: expert ``e``
    computes with ``m[e] V[e] / ||V[e]||``, ``V[e] = W[e] + s B[e] A[e]``, one detached norm per output row. The
    grouped layer's output and the gradients of A, B and m equal a loop of dense DoRA ``LoRALinear`` layers (peft's
    DoRA, ``tests/convert/test_peft.py``), one per expert and weight; m starts at the norms (the adapted layer starts
    as plain LoRA); the merged weight is each expert's rescaled rows."""
    from lightning_flagscale.models.lora import expert_adapter_modules, merged_weight
    from lightning_flagscale.moe.experts import _swiglu
    from tests.moe._trainer import shrink

    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=["experts"], init_lora_weights=False, use_dora=True)
    module = CausalLMModule(shrink("mixtral-tiny"), lora=lora, optimizer="sgd")
    module.configure_model()
    layer = next(iter(expert_adapter_modules(module.model).values()))
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    mags = layer.lora_magnitude_vector
    assert mags.gate_up_proj.shape == (e, 2 * i) and mags.down_proj.shape == (e, h)
    assert {n for n, p in module.model.named_parameters() if p.requires_grad} >= {
        "layers.0.mlp.experts.lora_magnitude_vector.gate_up_proj", "layers.0.mlp.experts.lora_magnitude_vector.down_proj"
    }  # fmt: skip
    for w in ("gate_up_proj", "down_proj"):  # peft's init: m = ||W + s B A|| per expert and row
        v = getattr(layer, w) + 2.0 * torch.bmm(getattr(layer.lora_B, w), getattr(layer.lora_A, w))
        torch.testing.assert_close(getattr(mags, w), torch.linalg.vector_norm(v, dim=-1))
    with torch.no_grad():  # m != the norms: DoRA differs from LoRA
        for w in ("gate_up_proj", "down_proj"):
            getattr(mags, w).mul_(
                1 + 0.3 * torch.rand(getattr(mags, w).shape, generator=torch.Generator().manual_seed(1))
            )
    dense = {}
    for w in ("gate_up_proj", "down_proj"):
        for k in range(e):
            out_f, in_f = getattr(layer, w).shape[1:]
            lin = LoRALinear(torch.nn.Linear(in_f, out_f, bias=False), rank=2, scaling=2.0, use_dora=True)
            with torch.no_grad():
                lin.weight.copy_(getattr(layer, w)[k])
                lin.lora_A.weight.copy_(getattr(layer.lora_A, w)[k])
                lin.lora_B.weight.copy_(getattr(layer.lora_B, w)[k])
                lin.lora_magnitude_vector.copy_(getattr(mags, w)[k])
            dense[w, k] = lin
    counts = [3, 0, 2, 1][:e] + [1] * max(0, e - 4)
    x = torch.randn(sum(counts), h, generator=torch.Generator().manual_seed(0))
    want = torch.cat(
        [dense["down_proj", k](_swiglu(dense["gate_up_proj", k](seg))) for k, seg in enumerate(x.split(counts))]
    )
    got = layer(x, counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    for w in ("gate_up_proj", "down_proj"):
        for k in range(e):
            lin = dense[w, k]
            for ours, theirs in [(layer.lora_A, lin.lora_A.weight), (layer.lora_B, lin.lora_B.weight),
                                 (mags, lin.lora_magnitude_vector)]:  # fmt: skip
                torch.testing.assert_close(getattr(ours, w).grad[k], theirs.grad, rtol=1e-4, atol=1e-6, msg=f"{w} {k}")
        merged = merged_weight(
            getattr(layer, w), getattr(layer.lora_A, w), getattr(layer.lora_B, w), 2.0, getattr(mags, w)
        )
        for k in range(e):
            lin = dense[w, k]
            row = merged_weight(lin.weight, lin.lora_A.weight, lin.lora_B.weight, 2.0, lin.lora_magnitude_vector)
            torch.testing.assert_close(merged[k], row, rtol=1e-6, atol=1e-6)
    assert layer.gate_up_proj.grad is None and layer.down_proj.grad is None  # the base stays frozen


def test_vlm_lora_refuses_the_freeze_options():
    from lightning_flagscale.multimodal import VLMModule

    with pytest.raises(ValueError, match="lora= trains the adapters only"):
        VLMModule("qwen2.5-vl-tiny", lora=LoRAConfig(), freeze_vision=True)

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
        (dict(use_dora=True), "DoRA is not implemented"),
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
    with pytest.raises(ValueError, match=r"not plain nn\.Linear layers: layers\.0\.input_layernorm"):
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

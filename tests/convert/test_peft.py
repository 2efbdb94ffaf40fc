"""LoRA adapters and the HF ecosystem (issue 40 item 3), on one process: our adapters saved in peft's format load
with ``peft.PeftModel.from_pretrained`` on the ``transformers`` model and give our logits; a peft adapter (made by
peft) loads into our module to continue training; the merged export is a plain HF checkpoint with the adapted logits.
The same from parallel layouts is in ``tests/strategies/test_lora_layouts.py``."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.convert import (
    HFConversionError,
    export_hf,
    load_peft_adapter,
    lora_config_from_peft,
    save_peft_adapter,
)
from lightning_flagscale.models import CausalLMModule
from tests.convert._hf import hf_logits, make_hf_model, save

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.tensor([[1, 5, 7, 9, 11, 3, 2, 40], [4, 4, 8, 15, 16, 23, 42, 0]])
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save(make_hf_model("llama"), tmp_path_factory.mktemp("llama") / "hf")


def _ours(hf_dir, lora: LoRAConfig) -> CausalLMModule:
    module = CausalLMModule.from_hf(str(hf_dir), lora=lora)
    module.configure_model()
    return module.eval()


def _logits(module: CausalLMModule) -> torch.Tensor:
    with torch.no_grad():
        return module.model.logits(module(IDS))


def test_saved_adapter_loads_in_peft_and_merged_export_in_transformers(hf_dir, tmp_path):
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS, init_lora_weights=False, use_rslora=True)
    ours = _ours(hf_dir, lora)
    base = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), IDS)
    assert (_logits(ours) - base).abs().max() > 1e-3  # the adapters change the model
    save_peft_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and config["target_modules"] == TARGETS

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_logits(adapted, IDS), _logits(ours), rtol=0, atol=1e-5)

    export_hf(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(hf_logits(merged, IDS), _logits(ours), rtol=0, atol=1e-5)


def test_adapter_made_by_peft_continues_training_here(hf_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(hf, config).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    want = hf_logits(theirs, IDS)

    lora = lora_config_from_peft(tmp_path / "theirs")
    assert (lora.rank, lora.alpha, sorted(lora.target_modules)) == (2, 5.0, ["down_proj", "q_proj"])
    ours = _ours(hf_dir, lora)
    torch.testing.assert_close(_logits(ours), want, rtol=0, atol=1e-5)
    # ... and it trains: only the adapters move
    ours.train()
    opt = ours.configure_optimizers()["optimizer"]
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours._loss({"input_ids": IDS, "labels": IDS}).backward()
    opt.step()
    moved = {n for n, p in ours.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)


def test_peft_errors(hf_dir, tmp_path):
    ours = _ours(hf_dir, LoRAConfig(rank=2, target_modules=["q_proj"]))
    save_peft_adapter(ours, tmp_path / "a")
    with pytest.raises(FileExistsError):
        save_peft_adapter(ours, tmp_path / "a")
    other = _ours(hf_dir, LoRAConfig(rank=2, target_modules=["v_proj"]))
    with pytest.raises(HFConversionError, match=r"no tensor 'base_model\.model\.model\.layers\.0\.self_attn\.v_proj"):
        load_peft_adapter(other, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    with pytest.raises(HFConversionError, match="fan_in_fan_out=True is not supported"):
        lora_config_from_peft(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(HFConversionError, match=r"no tensor '.*\.lora_magnitude_vector' for the DoRA magnitude"):
        _ours(hf_dir, lora_config_from_peft(tmp_path / "a"))  # a LoRA folder claiming DoRA lacks the magnitudes


def test_per_expert_adapters_merge_into_the_hf_export_and_round_trip_through_peft(tmp_path):
    """Item 2: an HF Mixtral with per-expert adapters (random B) exports merged (each expert's W + s B A), and
    transformers on that folder gives our logits; saved in peft's target_parameters format, peft gives them too, and
    the folder read back here gives them exactly; other target_parameters are refused by name."""
    hf_dir = save(make_hf_model("mixtral"), tmp_path / "hf")
    lora = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "experts"], init_lora_weights=False)
    ours = _ours(hf_dir, lora)
    base = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), IDS)
    assert (_logits(ours) - base).abs().max() > 1e-3  # the expert adapters change the model
    export_hf(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(hf_logits(merged, IDS), _logits(ours), rtol=0, atol=1e-5)
    save_peft_adapter(ours, tmp_path / "adapter")  # peft's target_parameters layout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["q_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_logits(adapted, IDS), _logits(ours), rtol=0, atol=1e-5)
    again = _ours(tmp_path / "hf", lora_config_from_peft(tmp_path / "adapter"))  # and back here
    assert again.lora.target_modules == ["q_proj", "experts"]
    torch.testing.assert_close(_logits(again), _logits(ours), rtol=0, atol=0)
    config["target_parameters"] = ["mlp.experts.down_proj"]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match=r"only the grouped experts' .* map onto our per-expert adapters"):
        lora_config_from_peft(tmp_path / "adapter")
    # per-expert DoRA (item 1; peft has none for target_parameters): the merged export rescales each expert's rows,
    # transformers gives our logits; peft's format cannot hold it, both ways
    dora = _ours(hf_dir, LoRAConfig(**{**lora.to_dict(), "use_dora": True}))
    with torch.no_grad():  # m != ||W + s B A||: DoRA differs from LoRA
        for name, p in dora.model.named_parameters():
            if ".lora_magnitude_vector." in name:
                p.mul_(1 + 0.3 * torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))))
    assert (_logits(dora) - _logits(ours)).abs().max() > 1e-3
    export_hf(dora, tmp_path / "merged-dora")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged-dora")
    torch.testing.assert_close(hf_logits(merged, IDS), _logits(dora), rtol=0, atol=1e-5)
    with pytest.raises(HFConversionError, match=r"per-expert DoRA adapters .* peft's target_parameters wrapper"):
        save_peft_adapter(dora, tmp_path / "adapter-dora")
    config["target_parameters"], config["use_dora"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], True
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match=r"use_dora with target_parameters; peft defines no DoRA"):
        lora_config_from_peft(tmp_path / "adapter")


def test_dora_matches_peft_logits_gradients_and_round_trips(hf_dir, tmp_path):
    """Item 4: DoRA (m per output row, the row norm of W + s B A detached) on the seven projections gives peft's
    logits and gradients (A, B and m) on the transformers model; the folder holds peft's ``lora_magnitude_vector``
    keys and ``use_dora: true``, loads back here with the same logits, and the merged export gives them too."""
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS, init_lora_weights=False, use_dora=True)
    ours = _ours(hf_dir, lora).train()
    with torch.no_grad():  # m != ||W + s B A||: DoRA differs from LoRA
        for name, p in ours.model.named_parameters():
            if name.endswith("lora_magnitude_vector"):
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))))
    save_peft_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).train()
    theirs = adapted(IDS).logits
    mine = ours.model.logits(ours(IDS))
    torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
    theirs.square().mean().backward()
    mine.square().mean().backward()
    peft_grads = {
        n.removeprefix("base_model.model.model.").replace(".default", "").replace("vector.weight", "vector"): p.grad
        for n, p in adapted.named_parameters()
        if p.requires_grad
    }
    our_grads = {n: p.grad for n, p in ours.model.named_parameters() if p.requires_grad}
    assert set(peft_grads) == set(our_grads) and any(n.endswith("lora_magnitude_vector") for n in our_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], rtol=1e-4, atol=1e-7, msg=name)

    again = _ours(hf_dir, lora_config_from_peft(tmp_path / "adapter"))
    assert again.lora.use_dora
    torch.testing.assert_close(_logits(again), _logits(ours), rtol=0, atol=0)
    export_hf(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(hf_logits(merged, IDS), _logits(ours), rtol=0, atol=1e-5)

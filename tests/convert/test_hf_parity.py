"""Import/export parity against ``transformers`` for every dense family (issue 6)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_flagscale.convert import (
    causal_lm_from_hf,
    ckpt_to_hf,
    config_from_hf,
    export_hf,
    family_for,
    hf_to_ckpt,
    load_hf_weights,
)
from lightning_flagscale.models import CausalLM
from tests.convert._hf import FAMILIES, hf_logits, make_hf_model, save

pytest.importorskip("transformers")

IDS = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_case(request, tmp_path_factory):
    family = request.param
    model = make_hf_model(family)
    path = save(model, tmp_path_factory.mktemp(family) / "hf")
    return family, model, path


def test_import_logits_match_transformers(hf_case):
    _, hf_model, path = hf_case
    ours = causal_lm_from_hf(path, vocab_multiple=4)  # 50 -> 52 rows: padding must stay invisible
    assert ours.embed_tokens.weight.shape[0] == 52
    assert torch.count_nonzero(ours.embed_tokens.weight[50:]) == 0
    with torch.no_grad():
        logits = ours.logits(ours(IDS))
    torch.testing.assert_close(logits, hf_logits(hf_model, IDS), rtol=0, atol=1e-5)


def test_export_loads_in_transformers_bit_identical(hf_case, tmp_path):
    from transformers import AutoModelForCausalLM

    family, hf_model, path = hf_case
    ours = causal_lm_from_hf(path, vocab_multiple=4)
    out = export_hf(ours, tmp_path / "export", max_shard_size="24KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    torch.testing.assert_close(hf_logits(reloaded, IDS), hf_logits(hf_model, IDS), rtol=0, atol=0)


def test_config_round_trip(hf_case):
    family, _, path = hf_case
    config = config_from_hf(path)
    fam = family_for({"model_type": family})
    assert fam.config_from_hf(fam.config_to_hf(config), name=config.name, hf_source=config.hf_source) == config


def test_sharded_checkpoint_and_plain_module(tmp_path):
    hf_model = make_hf_model("llama")
    path = save(hf_model, tmp_path / "hf", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    ours = CausalLM(config_from_hf(path))
    ours.init_weights(seed=3)
    load_hf_weights(ours, path)
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(IDS)), hf_logits(hf_model, IDS), rtol=0, atol=1e-5)


def test_dcp_checkpoint_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model("qwen2")
    path = save(hf_model, tmp_path / "hf")
    (path / "tokenizer_config.json").write_text("{}")
    ckpt = hf_to_ckpt(path, tmp_path / "ckpt")
    assert any(k.startswith("state_dict.model.layers.0.") for k in _dcp_keys(ckpt))
    out = ckpt_to_hf(ckpt, tmp_path / "back", dtype="float32")
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def _dcp_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_export_from_strategy_style_checkpoint(tmp_path):
    """The strategy's layout: DCP ``state_dict.model.*`` (vocab padded to 64) + ``meta.pt`` with the hparams."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model("llama")
    path = save(hf_model, tmp_path / "hf")
    ours = causal_lm_from_hf(path, vocab_multiple=64)
    ckpt = tmp_path / "ckpt"
    dcp.save({"state_dict": {f"model.{k}": v for k, v in ours.state_dict().items()}}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"hyper_parameters": {"config": ours.config, "hf_dir": str(path)}}, ckpt / "meta.pt")
    out = export_hf(ckpt, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == hf_model.config.eos_token_id
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny", "qwen2-moe-tiny"])
def test_export_of_native_model_gives_our_logits_in_transformers(preset, tmp_path):
    """Train-from-scratch workflow: no HF origin, the family is inferred from the config's features."""
    from transformers import AutoModelForCausalLM

    from lightning_flagscale.config import TransformerConfig

    model = CausalLM(TransformerConfig.from_preset(preset, num_layers=2), vocab_multiple=3)
    model.init_weights(seed=7)
    with torch.no_grad():  # norms are ones at init: perturb them so a norm mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    out = export_hf(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, ids), model.logits(model(ids)), rtol=0, atol=1e-5)

"""Every conversion failure names the field, file or tensor at fault, and never leaves half-written output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert import (
    CheckpointFormatError,
    HFConversionError,
    causal_lm_from_hf,
    config_from_hf,
    export_hf,
    load_hf_weights,
    supported_model_types,
)
from lightning_flagscale.convert.safetensors_io import atomic_output_dir, parse_size
from lightning_flagscale.models import CausalLM
from tests.convert._hf import make_hf_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save(make_hf_model("llama", num_hidden_layers=1), tmp_path_factory.mktemp("err") / "hf")


def _copy(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_supported_families_registered():
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(supported_model_types())


def test_unsupported_architecture_lists_supported(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "gpt2", edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(HFConversionError, match=r"model_type='gpt2'.*supported model types: .*llama.*qwen3"):
        config_from_hf(bad)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
    ],
)
def test_unsupported_field_value_is_named(hf_dir, tmp_path, edit, field):
    bad = _copy(hf_dir, tmp_path / "bad", edit_config=lambda c: c.update(edit))
    with pytest.raises(HFConversionError, match=field):
        config_from_hf(bad)


def test_mistral_sliding_window_that_binds_is_refused(tmp_path):
    path = save(make_hf_model("mistral", num_hidden_layers=1, sliding_window=8), tmp_path / "hf")
    with pytest.raises(HFConversionError, match="sliding_window"):
        config_from_hf(path)
    assert config_from_hf(path, max_seq_len=8).max_seq_len == 8  # a window that never binds is exact


def test_missing_tensor_is_named(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "m", edit_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(HFConversionError, match=r"missing.*model\.layers\.0\.mlp\.up_proj\.weight"):
        causal_lm_from_hf(bad)


def test_unexpected_tensor_is_named_with_its_file(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "u", edit_tensors=lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    with pytest.raises(HFConversionError, match=r"unexpected.*model\.extra\.weight \(in model\.safetensors\)"):
        causal_lm_from_hf(bad)


def test_shape_mismatch_names_tensor_and_file(hf_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :40].clone()

    bad = _copy(hf_dir, tmp_path / "s", edit_tensors=shrink)
    with pytest.raises(
        HFConversionError, match=r"Shape mismatch for 'layers\.0\.mlp\.down_proj\.weight'.*model\.safetensors"
    ):
        causal_lm_from_hf(bad)


def test_truncated_safetensors_names_file(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "t")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointFormatError, match=r"t/model\.safetensors.*truncated or corrupt"):
        causal_lm_from_hf(bad)
    (bad / "model.safetensors").write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors"):
        causal_lm_from_hf(bad)


def test_index_naming_a_missing_shard(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "i")
    keys = list(load_file(bad / "model.safetensors"))
    index = {"weight_map": dict.fromkeys(keys, "model-00001-of-00002.safetensors")}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=r"model-00001-of-00002\.safetensors.*missing"):
        causal_lm_from_hf(bad)


def test_module_config_mismatch_is_named(hf_dir):
    config = config_from_hf(hf_dir)
    other = CausalLM(TransformerConfig(**{**config.to_dict(), "rms_norm_eps": 1e-3}))
    with pytest.raises(HFConversionError, match=r"rms_norm_eps=0\.001 \(module\)"):
        load_hf_weights(other, hf_dir)


def test_existing_output_folder_is_refused_and_failures_leave_nothing(hf_dir, tmp_path):
    model = causal_lm_from_hf(hf_dir)
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="out"):
        export_hf(model, tmp_path / "out")
    with pytest.raises(RuntimeError, match="boom"), atomic_output_dir(tmp_path / "new") as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder, no half-written "new"


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1MiB") == 2**20 and parse_size(10) == 10
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_moe_layouts_and_routers_that_do_not_map_are_refused():
    from lightning_flagscale.convert import family_for

    qwen = family_for({"model_type": "qwen2_moe"})
    hf = dict(
        model_type="qwen2_moe", vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )  # fmt: skip
    assert qwen.config_from_hf({**hf, "decoder_sparse_step": 2}).first_k_dense_layers == 1
    with pytest.raises(HFConversionError, match="mlp_only_layers"):
        qwen.config_from_hf({**hf, "mlp_only_layers": [2]})  # MoE layers 0, 1, 3: not "first k dense, every n-th"
    mixtral = family_for({"model_type": "mixtral"})
    with pytest.raises(HFConversionError, match="router_jitter_noise"):
        mixtral.config_from_hf({**hf, "model_type": "mixtral", "num_local_experts": 4, "router_jitter_noise": 0.1})
    deepseek_like = TransformerConfig.from_preset("deepseek-v3-routing-tiny")
    with pytest.raises(HFConversionError, match="router_type='sigmoid'"):
        mixtral.config_to_hf(deepseek_like)


def test_cli_round_trip_and_user_errors(hf_dir, tmp_path, capsys):
    from lightning_flagscale.convert.cli import convert_main

    assert convert_main(["hf-to-ckpt", str(hf_dir), str(tmp_path / "ck")]) == 0
    assert convert_main(["ckpt-to-hf", str(tmp_path / "ck"), str(tmp_path / "back"), "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as exc:
        convert_main(["ckpt-to-hf", str(tmp_path / "ck"), str(tmp_path / "back")])
    assert exc.value.code == 2 and "already exists" in capsys.readouterr().err


def test_exporting_a_lora_checkpoint_folder_is_refused(tmp_path):
    # The folder holds the frozen base and the adapters apart; writing the base alone would drop what was trained.
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {
        "model.norm.weight": torch.ones(8),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
    }}  # fmt: skip
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    config = TransformerConfig(hidden_size=8, intermediate_size=16, num_layers=1, num_attention_heads=2, vocab_size=64)
    with pytest.raises(HFConversionError, match=r"holds LoRA adapters .*export from the trained module"):
        export_hf(str(tmp_path / "ckpt"), tmp_path / "out", config=config)
    assert not (tmp_path / "out").exists()

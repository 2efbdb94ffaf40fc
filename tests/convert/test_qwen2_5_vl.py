"""Qwen2.5-VL import/export against ``transformers``' ``Qwen2_5_VLForConditionalGeneration`` on tiny random configs."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_flagscale.convert import HFConversionError, causal_lm_from_hf, config_from_hf, export_hf, family_for
from lightning_flagscale.multimodal import VisionLanguageModel, VLMConfig

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, START, END = 290, 291, 292, 293
PATCH_DIM = 3 * 2 * 14 * 14


def make_hf_vl(tie: bool = False):
    """Random tiny Qwen2.5-VL: 3 vision blocks (block 1 full attention), 2 decoder layers, windows of 2x2 tokens."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=None, eos_token_id=1, pad_token_id=0,
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=tie,
    )  # fmt: skip
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # perturb every weight (norms and biases too) so a mapping mix-up shows
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def make_batch():
    """Row 0: two images of different sizes; row 1: text only (right-padded); row 2: a third image."""
    gen = torch.Generator().manual_seed(7)

    def text(n: int) -> list[int]:
        return torch.randint(2, 280, (n,), generator=gen).tolist()

    def image(t: int, h: int, w: int) -> list[int]:
        return [START] + [IMAGE] * (t * h * w // 4) + [END]

    grids = [(1, 4, 6), (1, 8, 6), (1, 4, 4)]
    rows = [
        text(5) + image(*grids[0]) + text(3) + image(*grids[1]) + text(4),
        text(9),
        text(2) + image(*grids[2]) + text(6),
    ]
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    mask = torch.zeros(len(rows), seq, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    return ids, mask, pixels, grid


def hf_logits(model, ids, mask, pixels, grid):
    with torch.no_grad():
        return model(
            input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(ids == IMAGE).int(),
        ).logits  # fmt: skip


def our_logits(model: VisionLanguageModel, ids, mask, pixels, grid):
    with torch.no_grad():
        return model.logits(model(ids, None, mask, pixel_values=pixels, image_grid_thw=grid))


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    model = make_hf_vl()
    path = tmp_path_factory.mktemp("qwen2_5_vl") / "hf"
    model.save_pretrained(path)
    return model, path


def test_checkpoint_prefixes_of_installed_transformers(hf_case):
    _, path = hf_case
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    specs = family_for({"model_type": "qwen2_5_vl"}).weight_specs(config_from_hf(path))
    assert {n for spec in specs.values() for n in spec.names()} == keys
    assert "visual.patch_embed.proj.weight" in keys and "model.layers.0.self_attn.q_proj.bias" in keys


def test_import_logits_match_transformers(hf_case):
    hf_model, path = hf_case
    ours = causal_lm_from_hf(path, vocab_multiple=8)  # 300 -> 304 rows: padding must stay invisible
    assert isinstance(ours, VisionLanguageModel) and isinstance(ours.config, VLMConfig)
    batch = make_batch()
    want, got = hf_logits(hf_model, *batch), our_logits(ours, *batch)
    valid = batch[1].bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)


def test_vision_tower_matches_transformers(hf_case):
    hf_model, path = hf_case
    ours = causal_lm_from_hf(path)
    _, _, pixels, grid = make_batch()
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixels, grid).pooler_output
        got = ours.image_features(pixels, grid)
    torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=1e-5)


def test_mrope_positions_match_transformers(hf_case):
    hf_model, path = hf_case
    ours = causal_lm_from_hf(path)
    ids, mask, _, grid = make_batch()
    want, _ = hf_model.model.get_rope_index(ids, (ids == IMAGE).int(), grid, attention_mask=mask)
    got = ours.position_ids(ids, grid, mask)
    assert torch.equal(got[:, mask.bool()], want[:, mask.bool()])


@pytest.mark.parametrize("tie", [False, True])
def test_export_round_trip_bit_identical(tmp_path, tie):
    hf_model = make_hf_vl(tie=tie)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = causal_lm_from_hf(tmp_path / "hf", vocab_multiple=8)
    out = export_hf(ours, tmp_path / "export", max_shard_size="64KB")
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["model_type"] == "qwen2_5_vl" and hf_config["architectures"] == [
        "Qwen2_5_VLForConditionalGeneration"
    ]
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    batch = make_batch()
    assert torch.equal(hf_logits(reloaded, *batch), hf_logits(hf_model, *batch))
    again = causal_lm_from_hf(out, vocab_multiple=8)  # and back: our tensors bit-identical
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_export_from_our_config_without_hf_source(tmp_path):
    """A model built from our preset (no HF folder) exports as qwen2_5_vl (picked from the config type)."""
    config = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=1, vision={"depth": 2, "fullatt_block_indexes": [1]})
    model = VisionLanguageModel(config)
    model.init_weights(seed=1)
    out = export_hf(model, tmp_path / "export")
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    again = causal_lm_from_hf(out)
    assert again.config.vision == config.vision and again.config.mrope_section == config.mrope_section
    ids = torch.tensor([[1, 2, config.vision_start_token_id] + [config.image_token_id] * 4 + [3, 4]])
    pixels = torch.randn(16, PATCH_DIM)
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        want = reloaded(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(ids == config.image_token_id).int(),
        ).logits  # fmt: skip
        got = model.logits(model(ids, pixel_values=pixels, image_grid_thw=grid))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_config_errors_name_the_field(hf_case, tmp_path):
    _, path = hf_case
    hf = json.loads((path / "config.json").read_text())
    fam = family_for(hf)
    bad = json.loads(json.dumps(hf))
    bad["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(HFConversionError, match="hidden_act"):
        fam.config_from_hf(bad)
    bad = json.loads(json.dumps(hf))
    bad["text_config"]["rope_parameters"].pop("mrope_section")
    with pytest.raises(HFConversionError, match="mrope_section"):
        fam.config_from_hf(bad)


def test_flat_hub_style_config_is_read(hf_case):
    """Hub checkpoints keep the text fields at the top level and spell M-RoPE as rope_scaling type 'mrope'."""
    _, path = hf_case
    hf = json.loads((path / "config.json").read_text())
    nested = family_for(hf).config_from_hf(hf)
    flat = {k: v for k, v in hf.items() if k != "text_config"}
    text = dict(hf["text_config"])
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    flat.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    assert family_for(flat).config_from_hf(flat) == nested


def test_vlm_module_from_hf(hf_case):
    """``VLMModule.from_hf`` (attached by the converter package) streams the weights at ``configure_model``."""
    from lightning_flagscale.multimodal import VLMModule

    hf_model, path = hf_case
    module = VLMModule.from_hf(str(path))
    assert module.hf_dir == str(path) and module.config.vision.depth == 3
    module.configure_model()
    batch = make_batch()
    got = our_logits(module.model.eval(), *batch)
    valid = batch[1].bool()
    torch.testing.assert_close(got[valid], hf_logits(hf_model, *batch)[valid], rtol=0, atol=1e-5)

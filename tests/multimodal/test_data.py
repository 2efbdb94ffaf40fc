"""VLM data: chat template, image preprocessing, the JSONL loader, collation and packing, errors naming the sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_flagscale.models.qwen2_5_vl.data import (
    ConversationDataset,
    SyntheticShapesDataset,
    VLMByteTokenizer,
    VLMCollator,
    check_sample,
)
from lightning_flagscale.models.qwen2_5_vl.image import ImageProcessor
from lightning_flagscale.multimodal import VLMConfig

CFG = VLMConfig.from_preset("qwen2.5-vl-tiny")
TOK = VLMByteTokenizer()


def _write_image(path, width: int, height: int) -> None:
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)


def _records(tmp_path, records, suffix=".jsonl"):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    else:
        path.write_text(json.dumps(records))
    return path


def test_tokenizer_matches_the_preset_special_ids():
    assert TOK.special("<|image_pad|>") == CFG.image_token_id
    assert TOK.special("<|vision_start|>") == CFG.vision_start_token_id
    assert TOK.special("<|vision_end|>") == CFG.vision_end_token_id
    assert TOK.vocab_size <= CFG.vocab_size


def test_jsonl_conversations_with_images_of_several_sizes(tmp_path):
    _write_image(tmp_path / "a.png", 100, 60)
    _write_image(tmp_path / "b.png", 30, 30)
    records = [
        {"messages": [{"role": "user", "content": "<image>and<image> compare"}, {"role": "assistant", "content": "ok"}],
         "images": ["a.png", "b.png"]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]  # fmt: skip
    data = ConversationDataset(_records(tmp_path, records), CFG, max_pixels=56 * 112)
    first = data[0]
    assert first["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]  # 60x100 -> 56x112, 30x30 -> 56x56 (min)
    assert int((first["input_ids"] == CFG.image_token_id).sum()) == 8 + 4
    text = bytes(t for t in first["input_ids"].tolist() if t < 256).decode()
    assert text.startswith("system\nYou are a helpful assistant.\nuser\nand compare\nassistant\nok\n")
    supervised = [t for t, lab in zip(first["input_ids"][1:].tolist(), first["labels"][:-1].tolist()) if lab != -100]
    assert supervised == [ord("o"), ord("k"), TOK.special("<|im_end|>")]  # the answer and its end only
    assert data[1]["pixel_values"].shape == (0, CFG.vision.patch_dim)


def test_image_bounds_resize_keep_aspect_and_multiples():
    proc = ImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    for h, w in [(20, 20), (500, 300), (1000, 90), (57, 57)]:
        th, tw = proc.target_size(h, w)
        assert th % 28 == 0 and tw % 28 == 0 and th * tw <= 28 * 28 * 16
        assert th * tw >= 56 * 56 or max(th, tw) == 28 * 16


def test_errors_name_the_sample(tmp_path):
    _write_image(tmp_path / "tiny.png", 10, 40)
    _write_image(tmp_path / "ok.png", 56, 56)
    msgs = [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}]
    data = ConversationDataset(
        _records(tmp_path, [{"messages": msgs, "images": ["missing.png"]}, {"messages": msgs, "images": ["tiny.png"]},
                            {"messages": msgs, "images": ["ok.png", "ok.png"]}]), CFG,
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"data.jsonl:line 1.*missing.png"):
        data[0]
    with pytest.raises(ValueError, match=r"data.jsonl:line 2.*smaller than one 14x14 patch"):
        data[1]
    with pytest.raises(ValueError, match=r"data.jsonl:line 3: 1 '<image>' placeholders but 2 images"):
        data[2]
    sample = SyntheticShapesDataset(CFG, 2)[0]
    sample["input_ids"] = sample["input_ids"][sample["input_ids"] != CFG.image_token_id][:-1]  # drop every pad
    with pytest.raises(ValueError, match=r"synthetic\[0\]: 0 image-pad tokens but image_grid_thw"):
        check_sample(sample, CFG)
    with pytest.raises(ValueError, match=r"synthetic\[0\]"):
        VLMCollator(config=CFG)([sample])


def test_collate_pads_to_the_batch_max_and_packs_with_segments():
    data = SyntheticShapesDataset(CFG, 8, seed=1)
    samples = [data[i] for i in range(4)]
    lengths = [len(s["input_ids"]) for s in samples]
    batch = VLMCollator(config=CFG, pad_to_multiple_of=4)(samples)
    assert batch["input_ids"].shape == (4, -(-max(lengths) // 4) * 4)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples]))
    packed = VLMCollator(config=CFG, pack_len=2 * max(lengths))(samples)
    assert packed["input_ids"].shape[0] == 2 and "segment_ids" in packed
    assert [set(row.tolist()) - {0} for row in packed["segment_ids"]] == [{1, 2}, {1, 2}]
    assert int((packed["input_ids"] == CFG.image_token_id).sum()) == int(
        (batch["input_ids"] == CFG.image_token_id).sum()
    )


def test_synthetic_set_is_deterministic_and_names_colour_and_shape():
    a, b = SyntheticShapesDataset(CFG, 4, seed=3), SyntheticShapesDataset(CFG, 4, seed=3)
    for i in range(4):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(
            a[i]["pixel_values"], b[i]["pixel_values"]
        )
    answers = {
        bytes(t for t in a[i]["input_ids"].tolist() if t < 256).decode().split("assistant\n")[1] for i in range(4)
    }
    assert all(ans.startswith("a ") and ans.rstrip().endswith(".") for ans in answers)
    sizes = {tuple(SyntheticShapesDataset(CFG, 64)[i]["image_grid_thw"][0].tolist()) for i in range(64)}
    assert len(sizes) > 1

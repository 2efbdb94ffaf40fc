"""The VLM model on one process: text-only equivalence with the decoder, packing, M-RoPE, init, bad inputs."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.layers import RotaryEmbedding
from lightning_flagscale.multimodal import VisionLanguageModel, VLMConfig, mrope_position_ids

CFG = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=2, vision={"depth": 2, "fullatt_block_indexes": [1]})
IMG, START, END = CFG.image_token_id, CFG.vision_start_token_id, CFG.vision_end_token_id
PATCH_DIM = CFG.vision.patch_dim


def _model(seed: int = 0) -> VisionLanguageModel:
    model = VisionLanguageModel(CFG)
    model.init_weights(seed)
    return model.eval()


def _doc(grid: tuple[int, int, int], before: int, after: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    n = grid[0] * grid[1] * grid[2] // 4
    text = torch.randint(1, 250, (before + after,), generator=gen).tolist()
    ids = text[:before] + [START] + [IMG] * n + [END] + text[before:]
    return ids, torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen)


def test_text_only_equals_the_decoder():
    """Without images every M-RoPE row is the text position: the VLM is exactly the decoder it extends."""
    vlm = _model()
    text = CausalLM(CFG)
    text.load_state_dict({k: v for k, v in vlm.state_dict().items() if not k.startswith("visual.")})
    ids = torch.randint(0, 250, (2, 11))
    with torch.no_grad():
        assert torch.equal(vlm(ids), text(ids))


def test_mrope_rows_and_plain_rope_agree_on_text():
    rope = RotaryEmbedding(16, 10000.0, mrope_section=[2, 3, 3])
    pos = torch.arange(7).expand(2, 7)
    cos3, sin3 = rope(pos.unsqueeze(0).expand(3, -1, -1), torch.float32)
    cos, sin = rope(pos, torch.float32)
    assert torch.equal(cos3, cos) and torch.equal(sin3, sin)
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(16, 10000.0)(pos.unsqueeze(0).expand(3, -1, -1), torch.float32)


def test_init_is_deterministic_and_seeded():
    a, b, c = _model(0), _model(0), _model(1)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
        if name.endswith("proj.weight"):
            assert not torch.equal(x, z), name


def test_packed_documents_match_each_document_alone():
    """Two image-text documents packed into one row (segment ids) give each document's own logits."""
    gen = torch.Generator().manual_seed(3)
    model = _model()
    docs = [_doc((1, 4, 6), 3, 4, gen), _doc((1, 4, 4), 2, 5, gen)]
    grids = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 4, 4]])]
    alone = []
    with torch.no_grad():
        for (ids, pixels), grid in zip(docs, grids):
            alone.append(model(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid)[0])
        ids = torch.tensor([docs[0][0] + docs[1][0] + [0, 0]])
        seg = torch.tensor([[1] * len(docs[0][0]) + [2] * len(docs[1][0]) + [0, 0]])
        packed = model(
            ids, None, seg, pixel_values=torch.cat([docs[0][1], docs[1][1]]), image_grid_thw=torch.cat(grids)
        )[0]
    n0 = len(docs[0][0])
    torch.testing.assert_close(packed[:n0], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[n0 : n0 + len(docs[1][0])], alone[1], rtol=0, atol=1e-5)


def test_images_of_any_count_and_size_per_row():
    gen = torch.Generator().manual_seed(5)
    model = _model()
    (a, pa), (b, pb), (c, pc) = _doc((1, 2, 2), 1, 1, gen), _doc((1, 6, 4), 2, 0, gen), _doc((1, 8, 2), 0, 3, gen)
    ids = torch.tensor([a + b + [0] * 3, c + [0] * (len(a) + len(b) + 3 - len(c))])
    grid = torch.tensor([[1, 2, 2], [1, 6, 4], [1, 8, 2]])
    with torch.no_grad():
        out = model(ids, pixel_values=torch.cat([pa, pb, pc]), image_grid_thw=grid)
    assert out.shape == (2, ids.shape[1], model.padded_vocab_size) and torch.isfinite(out).all()


def test_mrope_positions_of_an_image():
    ids = torch.tensor([[7, START] + [IMG] * 6 + [END, 8]])
    pos = mrope_position_ids(ids, torch.tensor([[1, 4, 6]]), image_token_id=IMG, spatial_merge_size=2)
    assert pos[:, 0, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 0, 2:8].tolist() == [2] * 6  # temporal
    assert pos[1, 0, 2:8].tolist() == [2, 2, 2, 3, 3, 3]  # rows of the 2 x 3 merged grid
    assert pos[2, 0, 2:8].tolist() == [2, 3, 4, 2, 3, 4]  # columns
    assert pos[:, 0, 8:].tolist() == [[5, 6]] * 3  # text continues at start + max(h', w')


def test_pad_count_mismatch_is_an_error():
    model = _model()
    ids = torch.tensor([[7, START] + [IMG] * 5 + [END]])
    with pytest.raises(ValueError, match="image-pad"):
        model(ids, pixel_values=torch.randn(24, PATCH_DIM), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="pixel_values has shape"):
        model(ids, pixel_values=torch.randn(20, PATCH_DIM), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="multiples of"):
        model(ids, pixel_values=torch.randn(15, PATCH_DIM), image_grid_thw=torch.tensor([[1, 3, 5]]))

"""VLMModule on one process: pre-allocation, freezing, the vision LR multiplier, split recompute."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.models.qwen2_5_vl.data import SyntheticShapesDataset, VLMCollator
from lightning_flagscale.multimodal import VLMConfig, VLMModule, pad_batch_to_max

CFG = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=2, vision={"depth": 3, "fullatt_block_indexes": [2]})


def _batch(n: int = 3, pack_len: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    data = SyntheticShapesDataset(CFG, 16, seed=seed)
    batch = VLMCollator(config=CFG, pack_len=pack_len)([data[i] for i in range(n)])
    # ragged labels: drop a different share of each row's targets
    for r in range(batch["labels"].shape[0]):
        batch["labels"][r, : 3 * r] = -100
    return batch


def _grads(module: VLMModule, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    module._loss(batch).backward()
    return {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


def _module(**kwargs) -> VLMModule:
    torch.manual_seed(0)
    module = VLMModule(CFG, **kwargs)
    module.configure_model()
    return module


def _assert_same(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name].double() - b[name].double()).norm() / b[name].double().norm().clamp_min(1e-30)
        assert err <= rel, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("pack_len", [None, 160])
def test_preallocated_step_has_the_gradients_of_the_unpadded_step(pack_len):
    module = _module(preallocate=True, max_image_tokens=64, max_seq_len=224)
    batch = _batch(4, pack_len)
    padded = pad_batch_to_max(batch, CFG, max_seq_len=224, max_image_tokens=64)
    tokens = int((batch["input_ids"] == CFG.image_token_id).sum())
    assert padded["input_ids"].shape[1] == 224 and padded["padding_grid_thw"].tolist() == [[1, 2, 2 * (64 - tokens)]]
    assert padded["pixel_values"].shape[0] == 4 * 64
    _assert_same(_grads(module, padded), _grads(module, batch))


def test_prealloc_pads_the_first_step_and_new_maxima_only():
    module = _module(preallocate=True, max_image_tokens=64, max_seq_len=224)
    state = module.prealloc
    small, large = _batch(1), _batch(4)
    assert "padding_grid_thw" in state.maybe_pad(small, CFG)  # first step
    assert state.maybe_pad(small, CFG) is small  # not above the running maximum
    assert "padding_grid_thw" in state.maybe_pad(large, CFG)  # a new maximum
    assert state.padded_steps == 2
    with pytest.raises(ValueError, match="exceeds the pre-allocation maximum"):
        pad_batch_to_max(large, CFG, max_seq_len=16, max_image_tokens=64)
    with pytest.raises(ValueError, match="max_image_tokens"):
        VLMModule(CFG, preallocate=True)


def test_freeze_options_leave_frozen_parts_out_of_the_optimizer():
    module = _module(freeze_vision=True, optimizer="sgd", learning_rate=0.5, warmup_steps=0, min_lr_ratio=1.0)
    opt = module.configure_optimizers()["optimizer"]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    module._loss(_batch()).backward()
    opt.step()
    for name, p in module.model.named_parameters():
        frozen = name.startswith(("visual.patch_embed.", "visual.blocks."))
        assert (id(p) in in_opt) != frozen, name
        assert torch.equal(p, before[name]) == frozen, name  # merger and LLM train, the encoder does not
    module = _module(freeze_llm=True, freeze_merger=True)
    module.configure_optimizers()
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("visual.patch_embed.", "visual.blocks.")) for n in trainable)
    with pytest.raises(ValueError, match="nothing would train"):
        VLMModule(CFG, freeze_vision=True, freeze_merger=True, freeze_llm=True)


def test_vision_lr_multiplier_scales_the_encoder_groups_only():
    module = _module(learning_rate=1e-3, vision_lr_multiplier=0.1, weight_decay=0.1)
    opt = module.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in module.model.named_parameters()}
    for group in opt.param_groups:
        encoder = {names[id(p)].startswith(("visual.patch_embed.", "visual.blocks.")) for p in group["params"]}
        assert len(encoder) == 1
        assert group["initial_lr"] == pytest.approx(1e-4 if encoder.pop() else 1e-3)  # the scheduler scales both


def test_split_vision_recompute_keeps_gradients():
    batch = _batch()
    reference = _grads(_module(), batch)
    module = _module(vision_recompute="full", vision_recompute_step=2)
    blocks = module.model.visual.blocks
    assert [getattr(b, "_recompute_mode", None) for b in blocks] == ["full", None, "full"]
    assert not hasattr(module.model.layers["0"], "_recompute_mode")  # the LLM policy is the strategy's
    _assert_same(_grads(module, batch), reference)
    with pytest.raises(ValueError, match="vision_recompute"):
        VLMModule(CFG, vision_recompute="selective")


def test_text_only_batch_gives_zero_vision_gradients():
    module = _module()
    module.train()
    batch = _batch()
    text = {"input_ids": torch.randint(1, 250, (2, 9)), "labels": torch.randint(1, 250, (2, 9))}
    grads = _grads(module, text)
    assert all(torch.count_nonzero(grads[n]) == 0 for n in grads if n.startswith("visual."))
    assert any(n.startswith("visual.") for n in grads)  # present (zero): DP ranks reduce the same set
    assert "visual.merger.mlp.2.weight" in _grads(module, batch)

"""The VLM under FlagScaleStrategy matches the single-process fp32 run: parameters after 3 SGD steps, ragged labels,
gradients clipped at 1.0 (below every step's norm, so clipping is active) with each step's pre-clip global norm
compared: the replicated vision tower counts once in the norm under TP, CP and PP.

Layouts: DP=2 with ZeRO-3 (both towers FSDP2-sharded); TP=2 with sequence parallelism (the language model
Megatron-sharded, the vision tower replicated; images spliced before the sequence scatter); PP=2 with 1F1B and
micro-batches of one row (the tower on the first stage; images, grids and M-RoPE positions in the batch-first layout
torch splits into micro-batches); TP=2+SP x PP=2 (4 processes); CP=2 (ring attention over the LLM sequence, the
tower replicated, images spliced through the full-sequence ``image_token_index``). Batches mix rows with one image,
rows with two images of different sizes and text-only rows; labels are ragged (a different share of each answer
ignored).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_flagscale.models.qwen2_5_vl.data import SyntheticShapesDataset, VLMCollator
from lightning_flagscale.models.qwen2_5_vl.prealloc import pad_batch_to_max
from lightning_flagscale.multimodal import VLMConfig, VLMModule
from tests._oracle import global_batch_indices
from tests.strategies._lm import assert_rel_close

STEPS, GLOBAL_BATCH, NUM_SAMPLES, LR, CLIP = 3, 4, 16, 0.2, 1.0
CFG = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=2, vision={"depth": 2, "fullatt_block_indexes": [1]})


def _text_only(sample: dict) -> dict:
    keep = sample["input_ids"] != CFG.image_token_id
    pixels = sample["pixel_values"]
    return {
        **sample, "input_ids": sample["input_ids"][keep], "labels": sample["labels"][keep],
        "pixel_values": pixels.new_zeros(0, pixels.shape[1]), "image_grid_thw": sample["image_grid_thw"][:0],
    }  # fmt: skip


def _two_images(a: dict, b: dict) -> dict:
    return {
        **a, **{k: torch.cat([a[k], b[k]]) for k in ("input_ids", "labels", "pixel_values", "image_grid_thw")}
    }  # fmt: skip


class RaggedShapes(Dataset):
    """Synthetic shapes with the first ``i % 4`` answer labels of sample ``i`` ignored as well; every fifth sample
    is text-only and every fifth (shifted by two) holds two images (two conversations back to back)."""

    def __init__(self) -> None:
        self.data = SyntheticShapesDataset(CFG, NUM_SAMPLES, seed=2)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.data[i])
        if i % 5 == 0:
            sample = _text_only(sample)
        elif i % 5 == 2:
            sample = _two_images(sample, self.data[(i + 7) % len(self.data)])
        labels = sample["labels"].clone()
        kept = (labels != -100).nonzero().flatten()
        labels[kept[: i % 4]] = -100
        sample["labels"] = labels
        return sample


def _module(**kwargs) -> VLMModule:
    torch.manual_seed(0)
    return VLMModule(CFG, optimizer="sgd", learning_rate=LR, warmup_steps=0, min_lr_ratio=1.0, **kwargs)


COLLATE = VLMCollator(config=CFG, pad_to_multiple_of=4)  # 2 x CP chunks, and the TP size


def reference_run() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(parameters after ``STEPS`` steps, each step's global gradient norm before clipping)."""
    module = _module()
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    data = RaggedShapes()
    norms = []
    for step in range(STEPS):
        batch = COLLATE([data[int(i)] for i in global_batch_indices(len(data), GLOBAL_BATCH, step)])
        module._loss(batch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}, torch.stack(norms)


def trainer_run(strategy_kwargs: dict, module_kwargs: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    world = dist.get_world_size()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    module = _module(**module_kwargs)
    norms = []

    class Norms(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            norms.append(float(trainer.strategy.precision_plugin.last_grad_norm))

    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[FlagScalePrecision("32-true")],
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=CLIP, callbacks=[Norms()],
    )  # fmt: skip
    model_parallel = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
        model_parallel *= strategy_kwargs.get(key, 1)
    dp = world // model_parallel
    trainer.fit(module, DataLoader(RaggedShapes(), batch_size=GLOBAL_BATCH // dp, collate_fn=COLLATE))
    out = {}
    with summon_full_params(module.model):  # flat ZeRO-3 (the default engine) holds shards: gather them
        for name, p in module.model.named_parameters():  # under PP: this rank's stage, under the unsplit names
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name.replace("_fsdp_wrapped_module.", "")] = full.detach().float().clone()
    return out, torch.tensor(norms)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


PP = dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", micro_batch_size=1)
LAYOUTS = {
    "dp2-zero3": (2, dict(zero_stage=3)),
    "tp2-sp": (2, dict(tensor_parallel_size=2, sequence_parallel=True)),
    "pp2-1f1b": (2, PP),
    "cp2": (2, dict(context_parallel_size=2)),
    "tp2-sp-x-pp2": (4, dict(tensor_parallel_size=2, sequence_parallel=True, **PP)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(launcher, reference, layout):
    world, strategy_kwargs = LAYOUTS[layout]
    reference, ref_norms = reference
    assert (ref_norms > CLIP).all(), ref_norms  # clipping active at every step: the premise
    results = []
    for rank, (params, norms) in enumerate(launcher(world, trainer_run, strategy_kwargs, {})):
        assert_rel_close(norms, ref_norms, 1e-5, f"{layout} rank {rank} gradient norms")
        results.append(params)
    pipelined = strategy_kwargs.get("pipeline_parallel_size", 1) > 1
    # Under PP every rank holds its stage's parameters: together the stages hold exactly the model's.
    assert set().union(*results) == set(reference), f"{layout}: parameter names"
    if pipelined:
        first = [params for params in results if any(n.startswith("visual.") for n in params)]
        assert first and all("embed_tokens.weight" in params for params in first), "the tower lives on stage 0"
    for rank, params in enumerate(results):
        assert pipelined or set(params) == set(reference), f"{layout} rank {rank}: parameter names"
        for name, value in params.items():
            want = reference[name]
            if value.shape[0] > want.shape[0]:  # the strategy pads the vocabulary (rows stay zero)
                assert torch.count_nonzero(value[want.shape[0] :]) == 0, name
                value = value[: want.shape[0]]
            assert_rel_close(value, want, 1e-5, f"{layout} rank {rank} {name}")
        moved = [n for n in reference if not torch.equal(reference[n], _initial()[n])]
        assert any(n.startswith("visual.blocks.") for n in moved), "the vision tower must have trained"


_INIT: dict = {}


def _initial() -> dict[str, torch.Tensor]:
    if not _INIT:
        module = _module()
        module.configure_model()
        _INIT.update({k: v.detach().clone() for k, v in module.model.named_parameters()})
    return _INIT


# ---- single-process checks of the pieces the layouts above rely on ------------------------------------------------


def _mixed_batch() -> dict[str, torch.Tensor]:
    data = RaggedShapes()
    return COLLATE([data[i] for i in (0, 1, 2, 3)])  # text-only, one image, two images, one image


def test_batch_first_layout_gives_the_same_outputs_per_row():
    """pipeline_inputs' batch-first images and explicit positions, split row by row as torch's micro-batches are,
    give the HF-layout forward's outputs; rows own their images (0, 1, 2 and 1 of them here)."""
    module = _module()
    module.configure_model()
    model = module.model
    batch = pad_batch_to_max(_mixed_batch(), CFG, max_seq_len=128, max_image_tokens=80)  # + a padding image
    segments = batch["segment_ids"]
    ref = model(batch["input_ids"], None, segments, pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"], padding_grid_thw=batch["padding_grid_thw"])  # fmt: skip
    x, kwargs = model.pipeline_inputs(
        batch["input_ids"], None, segments, pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"], padding_grid_thw=batch["padding_grid_thw"],
    )  # fmt: skip
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    assert all(v.shape[0] == x.shape[0] for v in kwargs.values()), "every keyword is batch-first"
    assert [int((g[:, 0] > 0).sum()) for g in kwargs["image_grid_thw"]] == [0, 1, 2, 1]
    assert "position_ids" not in kwargs and kwargs["mrope_position_ids"].shape == (*x.shape, 3)
    rows = [model(x[b : b + 1], **{k: v[b : b + 1] for k, v in kwargs.items()}) for b in range(x.shape[0])]
    assert_rel_close(torch.cat(rows), ref, 1e-5, "batch-first rows vs HF layout")


def test_batch_first_layout_names_the_row_whose_images_do_not_fit():
    module = _module()
    module.configure_model()
    batch = _mixed_batch()
    ids = batch["input_ids"].clone()
    ids[1, (ids[1] == CFG.image_token_id).nonzero()[0]] = 1  # one image-pad token fewer in row 1
    with pytest.raises(ValueError, match="batch row 1"):
        module.model.pipeline_inputs(ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])


def test_prepare_batch_adds_full_sequence_keys_that_cp_shards():
    from lightning_flagscale.parallel.context_parallel.attention import load_balanced_indices, shard_batch_for_cp

    module = _module()
    module.configure_model()
    model = module.model
    batch = _mixed_batch()
    full = model.prepare_batch(batch)
    ref_pos = model.position_ids(batch["input_ids"], batch["image_grid_thw"], batch["attention_mask"].long())
    assert torch.equal(full["mrope_position_ids"], ref_pos.permute(1, 2, 0))
    assert torch.equal(full["segment_ids"], batch["attention_mask"].long())  # one choice for every CP shard
    index = load_balanced_indices(batch["input_ids"].shape[1], 2, 1)
    shard = shard_batch_for_cp(full, (1, 2), sequence_keys=model.cp_sequence_keys)
    for key in ("input_ids", "mrope_position_ids", "image_token_index", "segment_ids"):
        assert torch.equal(shard[key], full[key][:, index]), key
    assert torch.equal(shard["pixel_values"], full["pixel_values"]), "every CP rank runs the tower on all images"


def test_cost_balance_gives_the_vision_stage_fewer_llm_blocks():
    """The tower counts in pipeline_balance='cost' (FlagScale's decoder_first_pipeline_num_layers, derived): the
    first stage holds it with the embedding and takes fewer LLM blocks; without image tokens the split is even."""
    from lightning_flagscale.multimodal import VisionLanguageModel
    from lightning_flagscale.parallel.pipeline_parallel.runner import pipeline_unit_costs, plan_stages

    cfg = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=8)
    with torch.device("meta"):
        model = VisionLanguageModel(cfg, vocab_multiple=64, image_token_share=0.5)
    costs = pipeline_unit_costs(model)
    vision_params = sum(p.numel() for p in model.visual.parameters())
    assert costs["visual"] > vision_params, "patches outnumber image tokens: the tower costs more than its size"
    plan = plan_stages(model.pipeline_units(), 2, balance="cost", unit_costs=costs)
    assert plan.units[0][:2] == ("visual", "embed_tokens")
    # costs: tower 172,400 (+ embedding 20,480) vs 43,264 per block and 20,480 for the head: 2 + 6 is optimal
    assert plan.num_layers() == [2, 6], plan.num_layers()
    model.image_token_share = 0.0
    plan = plan_stages(model.pipeline_units(), 2, balance="cost", unit_costs=pipeline_unit_costs(model))
    assert plan.num_layers() == [4, 4] and plan.units[0][:2] == ("visual", "embed_tokens")

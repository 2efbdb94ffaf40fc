"""The VLM under FlagScaleStrategy matches the single-process fp32 run: parameters after 3 SGD steps, ragged labels.

Layouts: DP=2 with ZeRO-3 (both towers FSDP2-sharded) and TP=2 with sequence parallelism (the language model
Megatron-sharded, the vision tower replicated; images spliced before the sequence scatter). Every batch holds
images of several sizes; labels are ragged (a different share of each answer ignored).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_flagscale.multimodal import VLMConfig, VLMModule
from lightning_flagscale.multimodal.data import SyntheticShapesDataset, VLMCollator
from tests._oracle import global_batch_indices
from tests.strategies._lm import assert_rel_close

STEPS, GLOBAL_BATCH, NUM_SAMPLES, LR = 3, 4, 16, 0.2
CFG = VLMConfig.from_preset("qwen2.5-vl-tiny", num_layers=2, vision={"depth": 2, "fullatt_block_indexes": [1]})


class RaggedShapes(Dataset):
    """Synthetic shapes with the first ``i % 4`` answer labels of sample ``i`` ignored as well."""

    def __init__(self) -> None:
        self.data = SyntheticShapesDataset(CFG, NUM_SAMPLES, seed=2)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.data[i])
        labels = sample["labels"].clone()
        kept = (labels != -100).nonzero().flatten()
        labels[kept[: i % 4]] = -100
        sample["labels"] = labels
        return sample


def _module(**kwargs) -> VLMModule:
    torch.manual_seed(0)
    return VLMModule(CFG, optimizer="sgd", learning_rate=LR, warmup_steps=0, min_lr_ratio=1.0, **kwargs)


COLLATE = VLMCollator(config=CFG, pad_to_multiple_of=2)


def reference_run() -> dict[str, torch.Tensor]:
    module = _module()
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    data = RaggedShapes()
    for step in range(STEPS):
        batch = COLLATE([data[int(i)] for i in global_batch_indices(len(data), GLOBAL_BATCH, step)])
        module._loss(batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}


def trainer_run(strategy_kwargs: dict, module_kwargs: dict) -> dict[str, torch.Tensor]:
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy

    world = dist.get_world_size()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    module = _module(**module_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[FlagScalePrecision("32-true")],
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    dp = world // strategy_kwargs.get("tensor_parallel_size", 1)
    trainer.fit(module, DataLoader(RaggedShapes(), batch_size=GLOBAL_BATCH // dp, collate_fn=COLLATE))
    out = {}
    for name, p in module.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_fsdp_wrapped_module.", "")] = full.detach().float().clone()
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run()


LAYOUTS = {
    "dp2-zero3": dict(zero_stage=3),
    "tp2-sp": dict(tensor_parallel_size=2, sequence_parallel=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(launcher, reference, layout):
    results = launcher(2, trainer_run, LAYOUTS[layout], {})
    for rank, params in enumerate(results):
        assert set(params) == set(reference), f"{layout} rank {rank}: parameter names"
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

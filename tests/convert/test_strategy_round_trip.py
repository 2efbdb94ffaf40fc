"""HF -> FlagScaleStrategy training (TP=2) -> HF: the wiring the lead will put into CausalLMModule.

``_HFModule`` is CausalLMModule plus the two hooks this package asks for (``from_hf`` and
``initialize_weights`` loading HF weights after the strategy materialised the parallel model).
"""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.models import CausalLM, CausalLMModule
from tests.convert._hf import hf_logits, make_hf_model, save

pytest.importorskip("transformers")


_HFModule = CausalLMModule  # from_hf + initialize_weights (HF weights after parallelise + materialise)


def _train_and_export(hf_dir: str, out_dir: str, strategy_kwargs: dict) -> dict:
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.callbacks.hf_export import HFExportCallback
    from tests.strategies._lm import TokenDataset

    module = _HFModule.from_hf(hf_dir, learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=FlagScaleStrategy(**strategy_kwargs),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[HFExportCallback(out_dir)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(TokenDataset(vocab=50, num_samples=8, seq=8), batch_size=2))
    params = {}
    for name, p in module.model.named_parameters():
        params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return params


@pytest.mark.parametrize(
    "world,layout",
    [(2, {"tensor_parallel_size": 2}), (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})],
    ids=["tp2", "tp2xpp2"],
)
def test_train_under_strategy_then_export(launcher, tmp_path, world, layout):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model("llama", num_hidden_layers=2)
    hf_dir = save(hf_model, tmp_path / "hf")
    results = launcher(world, _train_and_export, str(hf_dir), str(tmp_path / "out"), layout)
    trained = {k: v for r in results for k, v in r.items()}  # pipeline stages hold different parts
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    state = exported.state_dict()
    config = exported.config
    ours = CausalLM(_HFModule.from_hf(hf_dir).config)
    for name, tensor in ours.state_dict().items():
        value = (
            trained[name][: config.vocab_size] if name in ("embed_tokens.weight", "lm_head.weight") else trained[name]
        )
        tensor.copy_(value)
        hf_name = name if name.startswith("lm_head") else f"model.{name}"
        assert torch.equal(state[hf_name], value), name  # the export is the trained weights, bit for bit
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(exported, ids), ours.logits(ours(ids)), rtol=0, atol=1e-5)
        assert (hf_logits(exported, ids) - hf_logits(hf_model, ids)).abs().max() > 1e-3  # training changed it

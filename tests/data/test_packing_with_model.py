"""Contract check between packing and the reference decoder: a packed block gives every document exactly the
logits and loss it gets when run alone, because ``segment_ids`` keep attention inside each document. (RoPE is
relative, so restarting ``position_ids`` does not change these logits; the position layout is checked exactly in
test_datasets.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.data import IGNORE_INDEX, ByteTokenizer, PackedDataset, SyntheticTextDataset


def test_packed_block_equals_documents_run_separately():
    from lightning_flagscale.models.decoder import CausalLM

    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.from_preset("llama-tiny", num_layers=2))
    model.init_weights(seed=0)
    model.eval()
    packed = PackedDataset(SyntheticTextDataset(30, seed=2), ByteTokenizer(), seq_len=96)
    several = [s for s in packed if s["segment_ids"][-1] >= 2][:2]  # blocks that hold at least three documents
    assert len(several) == 2
    batch = {k: torch.stack([s[k] for s in several]) for k in several[0]}

    with torch.no_grad():
        logits = model.logits(model(batch["input_ids"], batch["position_ids"], batch["segment_ids"]))
        for b in range(2):
            for seg in batch["segment_ids"][b].unique():
                idx = (batch["segment_ids"][b] == seg).nonzero().squeeze(1)
                alone = model.logits(model(batch["input_ids"][b, idx][None]))[0]
                torch.testing.assert_close(logits[b, idx], alone, rtol=1e-5, atol=1e-5)
        # and the loss only counts targets inside documents
        labels = batch["labels"]
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        expected = per_token[labels.flatten() != IGNORE_INDEX].mean()
        loss = model.loss_fn(model(batch["input_ids"], batch["position_ids"], batch["segment_ids"]), labels)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)

"""First-batch memory pre-allocation on CUDA (issue 13): with batches of growing image-token counts, padding the first
step to the configured maximum lets the caching allocator reserve the peak once. Reports ``torch.cuda.memory_stats``
reserved / allocated bytes and allocator retries with and without it. Needs a GPU; skipped on CPU-only machines."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.models.qwen2_5_vl.data import SyntheticShapesDataset, VLMCollator
from lightning_flagscale.multimodal import VLMConfig, VLMModule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = VLMConfig.from_preset("qwen2.5-vl-tiny")


def _run(preallocate: bool) -> dict[str, int]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    module = VLMModule(CFG, preallocate=preallocate, max_image_tokens=256, max_seq_len=CFG.max_seq_len)
    module.configure_model()
    module.cuda()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = SyntheticShapesDataset(CFG, 64, seed=1)
    collate = VLMCollator(config=CFG)
    for step in range(8):  # batches of growing size: a fragmenting allocation pattern without pre-allocation
        batch = collate([data[i] for i in range(step % 4 + 1)])
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if module.prealloc is not None:
            batch = module.prealloc.maybe_pad(batch, module.config)
        module._loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = torch.cuda.memory_stats()
    return {k: stats[k] for k in ("num_alloc_retries", "reserved_bytes.all.peak", "allocated_bytes.all.peak")}


def test_preallocation_does_not_add_allocator_retries_and_reserves_the_peak_up_front():
    without, with_ = _run(False), _run(True)
    print(f"memory_stats without pre-allocation: {without}\nmemory_stats with pre-allocation: {with_}")
    assert with_["num_alloc_retries"] <= without["num_alloc_retries"]
    assert with_["reserved_bytes.all.peak"] >= with_["allocated_bytes.all.peak"] > 0

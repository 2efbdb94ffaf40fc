"""LoRA checkpoints (issue 40 item 4): a LoRA run's checkpoint holds what trains (adapters and their AdamW moments)
and a reference to the frozen base (where it came from and its SHA-256), not the base; a resume rebuilds the base
from the module (here its seeded init), reshards the adapters and their optimizer state to another layout and
continues as the uninterrupted run; a different base is refused naming both hashes.

Saved under TP 2 + SP (A/B sharded like their layers), resumed under ZeRO-3 over 2 ranks (adapter moments sharded over
DP, frozen base sharded) and under PP 2 (each stage reads its blocks' adapters): AdamW, so a moment lost or resharded to the wrong rows changes the weights. 12 samples, global batch 4: the
checkpoint sits on an epoch boundary (3 steps)."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.checkpoint import read_meta
from lightning_flagscale.checkpoint.sharded import checkpoint_keys
from lightning_flagscale.models.lora import base_weights_reference, is_adapter_name
from tests._launcher import WorkerError
from tests.strategies._lm import assert_rel_close, tiny_config
from tests.strategies._lora import lora_config, lora_reference_run, lora_trainer_run

NUM_SAMPLES, STEPS = 12, 3
ADAMW = dict(optimizer="adamw", learning_rate=1e-2)
SAVE_LAYOUT = dict(tensor_parallel_size=2, sequence_parallel=True)


def _run(launcher, layout, epochs, **kw):
    return launcher(2, lora_trainer_run, layout, tiny_config(), lora_config(), -1, max_epochs=epochs,
                    num_samples=NUM_SAMPLES, **{"module_kwargs": ADAMW, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def saved(launcher, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lora") / "tp2-sp.ckpt")
    _run(launcher, SAVE_LAYOUT, 1, save_path=path)
    return path


def test_lora_checkpoint_holds_adapters_their_optimizer_state_and_a_base_reference(saved):
    keys = checkpoint_keys(saved)
    weights = sorted(k.removeprefix("state_dict.") for k in keys if k.startswith("state_dict."))
    assert weights and all(is_adapter_name(k) for k in weights), [k for k in weights if not is_adapter_name(k)]
    assert len(weights) == 2 * 7 * tiny_config().num_layers  # A and B of the seven projections of each block
    moments = {k for k in keys if k.startswith("optimizer_0.state.") and k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert {k.removeprefix("optimizer_0.state.").rsplit(".", 1)[0] for k in moments} == set(weights)
    base = read_meta(saved)["base_weights"]
    want = base_weights_reference(tiny_config(), None, 0, 64)
    assert base == want and base["source"] == "init" and len(base["sha256"]) == 64


@pytest.fixture(scope="module")
def uninterrupted():
    return lora_reference_run(tiny_config(), lora_config(), 2 * STEPS, NUM_SAMPLES, **ADAMW)


# ZeRO-3 (FSDP2: frozen base sharded without gradients, adapter moments sharded over DP) and PP 2 (each stage reads
# its blocks' adapters and moments); ZeRO-1's sliced moments are the same resharding as ZeRO-3's DP shards.
RESUME_LAYOUTS = {
    "zero3": dict(zero_stage=3, zero3_impl="fsdp2"),
    "pp2": dict(pipeline_parallel_size=2, micro_batch_size=1),
}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_lora_resume_under_another_layout_matches_uninterrupted(launcher, saved, uninterrupted, layout):
    ref_losses, ref_after, ref_before = uninterrupted
    for rank, (losses, params, _) in enumerate(_run(launcher, RESUME_LAYOUTS[layout], 2, ckpt_path=saved)):
        assert len(losses) == STEPS, "the resumed run continues at step 4"
        assert losses == pytest.approx(ref_losses[STEPS:], rel=1e-5), (layout, rank, losses, ref_losses[STEPS:])
        for name, value in params.items():
            if is_adapter_name(name):
                assert_rel_close(value, ref_after[name], 1e-5, f"{layout} rank {rank} {name}")
            else:  # the base rebuilt from the module's init, bit-identical and still frozen
                assert torch.equal(value, ref_before[name]), f"{layout} rank {rank}: base weight {name} changed"


def test_lora_resume_refuses_another_base_naming_both_hashes(launcher, saved):
    saved_hash = read_meta(saved)["base_weights"]["sha256"]
    other = base_weights_reference(tiny_config(), None, 1, 64)["sha256"]
    assert other != saved_hash
    with pytest.raises(WorkerError, match=rf"(?s)init_seed=0 \(sha256 {saved_hash}\).*init_seed=1 \(sha256 {other}\)"):
        _run(launcher, RESUME_LAYOUTS["zero3"], 2, ckpt_path=saved, module_kwargs={**ADAMW, "init_seed": 1})


def test_convert_ckpt_to_hf_merges_a_lora_checkpoint(saved, tmp_path):
    """Item 3 from a checkpoint: ``convert ckpt-to-hf`` of the adapters-only folder rebuilds the base from its
    reference, reads the adapters and writes the merged model, whose logits are the adapted model's (3 AdamW steps
    on one process)."""
    transformers = pytest.importorskip("transformers")
    from lightning_flagscale.convert.cli import convert_main
    from tests.strategies._lora import lora_module

    _, ref_after, _ = lora_reference_run(tiny_config(), lora_config(), STEPS, NUM_SAMPLES, **ADAMW)
    assert convert_main(["ckpt-to-hf", saved, str(tmp_path / "merged")]) == 0
    oracle = lora_module(tiny_config(), lora_config())
    oracle.configure_model()
    with torch.no_grad():
        for name, p in oracle.model.named_parameters():
            p.copy_(ref_after[name])
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
        ours = oracle.model.logits(oracle(ids))
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=1e-4)
        base = lora_module(tiny_config(), None)
        base.configure_model()
        assert (base.model.logits(base(ids)) - ours).abs().max() > 1e-2  # the adapters changed the model

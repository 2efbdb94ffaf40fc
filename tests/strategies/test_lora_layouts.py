"""LoRA under the strategy's layouts matches one process (issue 40 item 2): SGD, ragged labels, 3 steps; the adapter
weights after the last step match the single-process run's, the frozen base weights are bit-unchanged, and only
adapter parameters are trainable and in the optimizer on every rank."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.models.lora import is_adapter_name
from tests._launcher import WorkerError
from tests.moe._trainer import shrink
from tests.strategies._lm import GLOBAL_BATCH, assert_rel_close, tiny_config
from tests.strategies._lora import (
    SNAPSHOT_AT,
    lora_config,
    lora_module,
    lora_reference_run,
    lora_trainer_run,
    lora_trainer_runs,
    vlm_lora_reference,
    vlm_lora_run,
)

STEPS = 3
LAYOUTS = {
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3-fsdp2": dict(zero_stage=3, zero3_impl="fsdp2"),
    "zero3-flat": dict(zero_stage=3, zero3_impl="flat"),
    "tp2-sp": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_parallel_size=2, micro_batch_size=1),
    "cp2": dict(context_parallel_size=2),
}
# Two meshes chained as pipeline stages (4 processes): TP 2 holds layer 0, DP 2 layer 1 (and the head).
HETERO = dict(
    hetero_meshes=[{"tensor_parallel_size": 2, "data_parallel_size": 1}, {"data_parallel_size": 2}],
    hetero_layers=[1, 1],
    micro_batch_size=2,
)
# An MoE preset (grouped experts, aux loss) with adapters on the attention projections and per-expert adapters on
# every expert's gate_up_proj and down_proj (item 2): under EP each rank holds its experts' adapters, and the experts'
# base weights, EP-sharded, stay frozen.
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
MOE_LAYOUTS = {
    "ep2": dict(expert_parallel_size=2),
    "ep2-zero1": dict(expert_parallel_size=2, zero_stage=1),
    "ep2-zero3": dict(expert_parallel_size=2, zero_stage=3),
}


@pytest.fixture(scope="module")
def reference():
    return lora_reference_run(tiny_config(), lora_config(), STEPS)


# TP 2+SP and PP 2 are checked against one process by the peft export test's launch (one launch each); TP 2+SP runs
# DoRA there (item 4), plain LoRA under TP 2+SP is the saved run of test_lora_checkpoint.py, whose resumes match an
# uninterrupted one-process run. Every other layout's launch (PP 2's included) runs DoRA after plain LoRA.
EXPORTED = {"tp2-sp": True, "pp2": False}  # layout -> use_dora


@pytest.fixture(scope="module")
def dora_reference():
    reference = lora_reference_run(tiny_config(), lora_config(use_dora=True), STEPS)
    assert any(n.endswith("lora_magnitude_vector") for n in reference[1])
    return reference


def _with_dora(launcher, layout, lora, snapshot_dir=None, **kwargs):
    """One launch: the layout's run with ``lora`` (``kwargs`` its extras), then the same layout with DoRA (item 1:
    DDP, ZeRO-1/2/3 flat and FSDP2, PP and CP; a magnitude per output row, replicated and reduced like any
    parameter, its row norm over the whole row, which ZeRO-3 gathers for the forward). Both runs' results by rank
    (and, with ``snapshot_dir``, :func:`lora_snapshot_resume`'s)."""
    args = (LAYOUTS[layout], tiny_config())
    runs = [((*args, lora, STEPS), kwargs), ((*args, lora_config(use_dora=True), STEPS), {})]
    both = launcher(2, lora_trainer_runs, runs, snapshot_dir)
    return [r[0] for r in both], [r[1] for r in both], [r[2] if snapshot_dir else None for r in both]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in EXPORTED])
def test_lora_layout_matches_single_process(launcher, reference, dora_reference, layout, tmp_path):
    snapshot_dir = str(tmp_path / "snapshots") if layout == "zero1" else None
    results, dora, snapshots = _with_dora(launcher, layout, lora_config(), snapshot_dir)
    _assert_matches(results, reference, layout)
    _assert_matches(dora, dora_reference, f"dora {layout}")
    if snapshot_dir is not None:
        _assert_snapshot_resumes_bit_exact(snapshots)


def _assert_snapshot_resumes_bit_exact(snapshots):
    """Item 5 (in ZeRO-1's launch): an in-memory snapshot of a LoRA run (AdamW; ZeRO-1's flat slices saved as they
    lie) holds the adapters and their Adam moments, not the frozen base; a fresh Trainer resumed from it continues
    as the uninterrupted run to the last bit, base included."""
    keys = snapshots[0]["keys"]
    weights = [k.removeprefix("state_dict.model.") for k in keys if k.startswith("state_dict.")]
    assert weights and all(is_adapter_name(k) for k in weights), [k for k in weights if not is_adapter_name(k)]
    assert any(k.endswith(".exp_avg_sq") for k in keys), keys
    for rank, run in enumerate(snapshots):
        (full_losses, full_params, _), (losses, params, _) = run["full"], run["resumed"]
        assert losses == full_losses[SNAPSHOT_AT:], (rank, losses, full_losses)
        assert set(params) == set(full_params)
        for name, value in params.items():
            assert torch.equal(value, full_params[name]), f"rank {rank}: {name} differs after the snapshot resume"


def test_lora_on_hetero_meshes_matches_single_process(launcher, reference, dora_reference):
    # the first mesh (DP 1) reads the whole global batch, the second slices it; then DoRA in the same launch (item 1:
    # the TP 2 mesh places m like its layers' output rows, the DP 2 mesh reduces it like any parameter)
    runs = [((HETERO, tiny_config(), lora, STEPS), dict(batch_size=GLOBAL_BATCH))
            for lora in (lora_config(), lora_config(use_dora=True))]  # fmt: skip
    both = launcher(4, lora_trainer_runs, runs)
    _assert_matches([r[0] for r in both], reference, "hetero tp2|dp2")
    _assert_matches([r[1] for r in both], dora_reference, "dora hetero tp2|dp2")
    placed = both[0][1][2]["magnitudes"]  # rank 0 is on the TP 2 mesh (layer 0)
    assert placed["layers.0.self_attn.q_proj.lora_magnitude_vector"] == "(Shard(dim=0),)", placed


@pytest.fixture(scope="module")
def moe_reference():
    return lora_reference_run(shrink("mixtral-tiny"), lora_config(target_modules=MOE_TARGETS), STEPS)


@pytest.fixture(scope="module")
def moe_dora_reference():
    reference = lora_reference_run(
        shrink("mixtral-tiny"), lora_config(target_modules=MOE_TARGETS, use_dora=True), STEPS
    )
    assert any(".experts.lora_magnitude_vector." in n for n in reference[1])
    return reference


# Each EP launch runs DoRA after plain LoRA (item 1): DoRA on the attention and per-expert DoRA on every expert
# (m [E, out] per weight, EP-sharded with its experts); under ZeRO-3 the DoRA run takes the other engine (FSDP2).
MOE_DORA = {"ep2": {}, "ep2-zero1": {}, "ep2-zero3": dict(zero3_impl="fsdp2")}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_lora_with_per_expert_adapters_matches_single_process(
    launcher, moe_reference, moe_dora_reference, layout, tmp_path
):
    lora = lora_config(target_modules=MOE_TARGETS)
    export = str(tmp_path) if layout == "ep2" else None  # the peft folder, gathered from the EP shards
    config = shrink("mixtral-tiny")
    runs = [
        ((MOE_LAYOUTS[layout], config, lora, STEPS), dict(export_dir=export)),
        (({**MOE_LAYOUTS[layout], **MOE_DORA[layout]}, config, lora_config(target_modules=MOE_TARGETS, use_dora=True),
          STEPS), {}),
    ]  # fmt: skip
    both = launcher(2, lora_trainer_runs, runs)
    results, dora = [r[0] for r in both], [r[1] for r in both]
    _assert_matches(results, moe_reference, layout)
    _assert_matches(dora, moe_dora_reference, f"dora {layout}")
    if export is not None:
        from safetensors.torch import load_file

        from lightning_flagscale.convert.peft import _expert_to_peft

        saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
        slot = {"gate_up_proj": "base_layer.", "down_proj": ""}
        for name, value in moe_reference[1].items():
            if ".experts.lora_" in name:
                parent, kind, weight = name.rsplit(".", 2)
                key = f"base_model.model.model.{parent.removesuffix('.' + kind)}.{slot[weight]}{kind}.weight"
                assert_rel_close(saved[key], _expert_to_peft(kind, value), 1e-5, f"{layout} {key}")
    for rank, (_, _, info) in enumerate(
        results
    ):  # each rank holds (and trains) the adapters of its half of the experts
        assert info["expert_adapter_experts"] == [config.num_experts // 2] * 4 * config.num_layers, (rank, info)
    for rank, (_, _, info) in enumerate(dora):  # and the magnitudes of its experts (DTensors on the EP mesh)
        assert info["expert_adapter_experts"] == [config.num_experts // 2] * 6 * config.num_layers, (rank, info)
        assert "layers.0.mlp.experts.lora_magnitude_vector.down_proj" in info["trainable"], info["trainable"]


def test_per_expert_adapters_are_refused_with_expert_tensor_parallelism(launcher):
    with pytest.raises(WorkerError, match="per-expert LoRA adapters are not supported with expert tensor parallel"):
        launcher(2, lora_trainer_run, dict(expert_tensor_parallel_size=2), shrink("mixtral-tiny"),
                 lora_config(target_modules=MOE_TARGETS), 1)  # fmt: skip


# The VLM (item 3): adapters on the decoder's attention and on the vision tower's attention projections; the rest of
# the tower (patch embedding, MLPs, merger) and of the decoder frozen. TP 2+SP: the decoder Megatron-sharded, the
# tower replicated with its adapters.
VLM_TARGETS = r"layers\.\d+\.self_attn\.(q|k|v|o)_proj|visual\.blocks\.\d+\.attn\.(qkv|proj)"


def test_lora_on_the_vlm_matches_single_process_and_resumes_from_its_checkpoint(launcher, tmp_path):
    """Item 2 on the VLM under TP 2+SP, and item 4 in the same launch: the checkpoint of the first epoch holds the
    adapters only (no optimizer state under SGD) and the base reference (the whole VLM's seeded init and its
    SHA-256); resumed, the second epoch gives the uninterrupted run's parameters bit for bit; another base is
    refused naming both hashes; the checkpoint rebuilds the adapted VLMModule on one process (``convert
    ckpt-to-hf``'s reader)."""
    from lightning_flagscale.checkpoint import read_meta
    from lightning_flagscale.checkpoint.sharded import checkpoint_keys
    from lightning_flagscale.convert.lora_checkpoint import module_from_lora_checkpoint
    from tests.multimodal.test_parallel import _module

    lora = lora_config(target_modules=VLM_TARGETS)
    ref_after, ref_before = vlm_lora_reference(lora, STEPS)
    adapted = {n.split(".lora_")[0] for n in ref_after if is_adapter_name(n)}
    assert {n for n in adapted if n.startswith("visual.")} and {n for n in adapted if not n.startswith("visual.")}
    tp2 = dict(tensor_parallel_size=2, sequence_parallel=True)
    ckpt = str(tmp_path / "vlm-lora.ckpt")
    runs = launcher(2, vlm_lora_run, tp2, lora, 1, ckpt)
    for rank, run in enumerate(runs):
        params = run["epoch1"]
        assert set(params) == set(ref_after), f"rank {rank}: parameter names"
        for name, value in params.items():
            want = ref_after[name]
            if value.shape[0] > want.shape[0]:  # the strategy pads the vocabulary (rows stay zero)
                assert torch.count_nonzero(value[want.shape[0] :]) == 0, name
                value = value[: want.shape[0]]
            if is_adapter_name(name):
                assert_rel_close(value, want, 1e-5, f"vlm rank {rank} {name}")
                assert not torch.equal(value, ref_before[name]), f"vlm rank {rank}: {name} did not train"
            else:
                assert torch.equal(value, ref_before[name]), f"vlm rank {rank}: base weight {name} changed"
        resumed, uninterrupted = run["resumed"], run["uninterrupted"]
        assert set(resumed) == set(uninterrupted)
        for name, value in resumed.items():
            assert torch.equal(value, uninterrupted[name]), f"vlm rank {rank}: {name} differs after the resume"
            if is_adapter_name(name):
                assert not torch.equal(value, params[name]), f"vlm rank {rank}: {name} did not train after step 3"
    keys = checkpoint_keys(ckpt)
    weights = sorted(k.removeprefix("state_dict.model.") for k in keys if k.startswith("state_dict."))
    assert set(weights) == {n for n in ref_after if is_adapter_name(n)}, weights
    assert not any(k.startswith("optimizer_0.state.") for k in keys)  # SGD keeps no state
    saved_base = read_meta(ckpt)["base_weights"]
    assert saved_base == _module().base_weights_reference() and saved_base["source"] == "init"
    other = _module(init_seed=1).base_weights_reference()["sha256"]
    for run in runs:
        assert f"init_seed=0 (sha256 {saved_base['sha256']})" in run["refused"], run["refused"]
        assert f"init_seed=1 (sha256 {other})" in run["refused"], run["refused"]
    module = module_from_lora_checkpoint(ckpt)
    for name, value in module.model.named_parameters():
        want = runs[0]["epoch1"][name]
        assert torch.equal(value, want[: value.shape[0]] if not is_adapter_name(name) else want), name
    # ... and exports merged (W + s B A in the decoder and the tower): the plain HF folder gives the adapted outputs
    from lightning_flagscale.convert import export_hf
    from lightning_flagscale.multimodal import VLMModule
    from tests.multimodal.test_parallel import COLLATE
    from tests.strategies._lora import _vlm_data

    export_hf(module, tmp_path / "merged")
    merged = VLMModule.from_hf(str(tmp_path / "merged"))
    merged.configure_model()
    batch = COLLATE([_vlm_data()[i] for i in range(4)])
    with torch.no_grad():
        torch.testing.assert_close(merged(batch), module(batch), rtol=0, atol=1e-5)
        assert not any(is_adapter_name(n) for n, _ in merged.model.named_parameters())


def _assert_matches(results, reference, layout):
    ref_losses, ref_after, ref_before = reference
    held = set()
    for rank, (losses, params, info) in enumerate(results):
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{layout} rank {rank} step {step}: loss {got} != {want}"
        for name, value in params.items():
            if is_adapter_name(name):
                assert_rel_close(value, ref_after[name], 1e-5, f"{layout} rank {rank} {name}")
                assert not torch.equal(value, ref_before[name]), f"{layout} rank {rank}: {name} did not train"
            else:
                assert torch.equal(value, ref_before[name]), f"{layout} rank {rank}: base weight {name} changed"
        assert all(is_adapter_name(n) for n in info["trainable"]), f"{layout} rank {rank}: {info['trainable']}"
        magnitudes = {n for n in params if n.endswith("lora_magnitude_vector")}
        assert magnitudes <= set(info["trainable"]), f"{layout} rank {rank}: a DoRA magnitude is not trainable"
        adapters = sum(v.numel() for n, v in params.items() if is_adapter_name(n))
        # the optimizer holds adapter parameters (or this rank's shard of them) only
        assert 0 < info["optimizer_numel"] <= adapters, f"{layout} rank {rank}: {info['optimizer_numel']} > {adapters}"
        held |= set(params)
    assert held == set(ref_after), f"{layout}: parameters held across ranks differ from the model's"


@pytest.mark.parametrize("layout", list(EXPORTED))
def test_peft_adapter_and_merged_export_from_layout(launcher, reference, dora_reference, layout, tmp_path):
    """The run matches one process as the other layouts do (TP 2+SP with DoRA: its magnitudes placed like the output
    rows, ``Shard(0)`` on column-parallel layers whose row norms are local, replicated on row-parallel ones whose
    squared norms DTensor sums over TP); item 3 from parallel layouts: the gathered adapters hold the trained values
    under peft's key names, ``peft.PeftModel.from_pretrained`` on the base HF model and the merged HF export both give
    the logits of the single-process adapted model."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from lightning_flagscale.convert import export_hf

    lora = lora_config(use_dora=EXPORTED[layout])
    if lora.use_dora:
        reference = dora_reference
        results = launcher(2, lora_trainer_run, LAYOUTS[layout], tiny_config(), lora, STEPS, export_dir=str(tmp_path))
    else:  # and DoRA on this layout in the same launch
        results, dora, _ = _with_dora(launcher, layout, lora, export_dir=str(tmp_path))
        _assert_matches(dora, dora_reference, f"dora {layout}")
    _, ref_after, _ = reference
    _assert_matches(results, reference, layout)
    if lora.use_dora:
        placed = results[0][2]["magnitudes"]
        assert placed["layers.0.self_attn.q_proj.lora_magnitude_vector"] == "(Shard(dim=0),)", placed
        assert placed["layers.0.self_attn.o_proj.lora_magnitude_vector"] == "(Replicate(),)", placed
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = {f"base_model.model.model.{n}": v for n, v in ref_after.items() if is_adapter_name(n)}
    assert set(saved) == set(want)
    for name, value in saved.items():
        assert_rel_close(value, want[name], 1e-5, f"{layout} {name}")

    oracle = lora_module(tiny_config(), lora)
    oracle.configure_model()
    base = lora_module(tiny_config(), None)
    base.configure_model()
    export_hf(base, tmp_path / "base")
    with torch.no_grad():
        for name, p in oracle.model.named_parameters():
            p.copy_(ref_after[name])
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
        ours = oracle.model.logits(oracle(ids))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(ids).logits, ours, rtol=0, atol=1e-4)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=1e-4)

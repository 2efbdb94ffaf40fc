"""Import into parallel layouts: TP=2 DTensor shards (world 2) and a pipeline stage that lacks parts."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_flagscale.convert import config_from_hf, export_hf, load_hf_weights
from lightning_flagscale.models import CausalLM
from tests.convert._hf import hf_logits, make_hf_model, save

pytest.importorskip("transformers")

IDS = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))


def _tp_import_and_export(hf_dir: str, out_dir: str, sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):  # the strategy's flow: meta build, parallelise, materialise, load instead of init
        model = CausalLM(config_from_hf(hf_dir), vocab_multiple=4)
    apply_tp(model, mesh, sequence_parallel=sequence_parallel)
    model.to_empty(device="cpu")
    read = load_hf_weights(model, hf_dir)
    with torch.no_grad():
        logits = model.logits(model(IDS))
    export_hf(model, out_dir, max_shard_size="30KB")  # collective: DTensors gathered, rank 0 writes
    return {"logits": logits, "bytes_read": read}


@pytest.mark.parametrize(("family", "sequence_parallel"), [("llama", False), ("qwen2", True)])
def test_tp2_import_matches_transformers_and_exports_identically(launcher, tmp_path, family, sequence_parallel):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model(family)
    hf_dir = save(hf_model, tmp_path / "hf")
    results = launcher(2, _tp_import_and_export, str(hf_dir), str(tmp_path / "out"), sequence_parallel)
    want = hf_logits(hf_model, IDS)
    for r in results:
        torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-5)
    # Each rank reads its shard only: about half of the sharded matrices (norms and biases are replicated).
    total = sum(t.numel() * t.element_size() for t in hf_model.state_dict().values())
    assert all(r["bytes_read"] < 0.6 * total for r in results), [r["bytes_read"] / total for r in results]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family


def test_pipeline_stage_reads_only_its_parts(tmp_path):
    hf_model = make_hf_model("qwen2", num_hidden_layers=4)  # tied: the last stage's head comes from the embedding
    hf_dir = save(hf_model, tmp_path / "hf")
    config = config_from_hf(hf_dir)
    stage = CausalLM(config)
    stage.embed_tokens = None  # what the pipeline splitter does for the last of two stages
    del stage.layers["0"], stage.layers["1"]
    read = load_hf_weights(stage, hf_dir)
    want = hf_model.state_dict()
    assert torch.equal(stage.lm_head.weight, want["model.embed_tokens.weight"])
    assert torch.equal(stage.layers["3"].mlp.down_proj.weight, want["model.layers.3.mlp.down_proj.weight"])
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert read < 0.75 * total


def _ep_import(hf_dir: str, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    with torch.device("meta"):
        model = CausalLM(config_from_hf(hf_dir))
    apply_ep(model, mesh)
    model.to_empty(device="cpu")
    read = load_hf_weights(model, hf_dir)
    experts = [p for n, p in model.named_parameters() if "experts." in n]
    assert experts and all(isinstance(p, DTensor) for p in experts)
    with torch.no_grad():
        logits = model.logits(model(IDS))
    export_hf(model, out_dir)
    return {"logits": logits, "bytes_read": read}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep2_import_matches_transformers_and_exports_identically(launcher, tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model(family)
    hf_dir = save(hf_model, tmp_path / "hf")
    results = launcher(2, _ep_import, str(hf_dir), str(tmp_path / "out"))
    want = hf_logits(hf_model, IDS)
    state = hf_model.state_dict()
    expert_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if ".experts." in n)
    total = sum(t.numel() * t.element_size() for t in state.values())
    for r in results:
        torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-5)
        assert r["bytes_read"] == total - expert_bytes // 2  # each rank reads half of the experts, all the rest
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in state.items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def _pp_import_and_export(hf_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    from lightning_flagscale.parallel.pipeline_parallel.runner import build_stage_module, plan_stages

    with torch.device("meta"):
        full = CausalLM(config_from_hf(hf_dir))
    plan = plan_stages(full.pipeline_units(), 2)
    stage = build_stage_module(full, plan.units[dist.get_rank()]).to_empty(device="cpu")
    stage.tie_weights()
    read = load_hf_weights(stage, hf_dir)
    export_hf(stage, out_dir, max_shard_size="30KB")  # stage 1 sends its tensors to rank 0
    return {"bytes_read": read, "names": sorted(stage.state_dict())}


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_pp2_stages_import_their_parts_and_export_together(launcher, tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model(family, num_hidden_layers=4)
    hf_dir = save(hf_model, tmp_path / "hf")
    results = launcher(2, _pp_import_and_export, str(hf_dir), str(tmp_path / "out"))
    assert not set(results[0]["names"]) & {"norm.weight"} and "embed_tokens.weight" not in results[1]["names"]
    state = hf_model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert all(r["bytes_read"] < 0.75 * total for r in results)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in state.items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    torch.testing.assert_close(hf_logits(reloaded, IDS), hf_logits(hf_model, IDS), rtol=0, atol=0)

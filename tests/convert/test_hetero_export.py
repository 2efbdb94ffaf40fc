"""HF export from a heterogeneous-mesh run (issue 12, item 8): train on a fast TP=2 mesh and a slow DP=2 mesh whose
ranks are interleaved by device type, export with ``HFExportCallback`` at fit end and, offline, from the run's DCP
checkpoint; both exports are the trained weights (= the single-process run's) and give our logits in transformers.
The meshes are listed fast then slow and ``hetero_mesh_order="speed"`` runs them slow then fast (the LM head on the
fast mesh; issue 42 item 5), so the reordered layout, its ranks by device type and its export are checked too."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.convert.hf_export import export_hf
from lightning_flagscale.models import CausalLM
from tests.convert._hf import hf_logits
from tests.strategies._lm import assert_rel_close, reference_run, tiny_config
from tests.strategies.test_hetero_ranks import FAST, INTERLEAVED, SLOW, _run_as_type

pytest.importorskip("transformers")


def test_export_from_hetero_run_equals_one_process_model(launcher, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = tiny_config(num_layers=4)
    strategy = dict(hetero_meshes=[FAST, SLOW], hetero_device_speed={"fast": 3.0, "slow": 1.0},
                    hetero_mesh_order="speed", micro_batch_size=2, zero_stage=1)  # fmt: skip
    live, ckpt = tmp_path / "live", tmp_path / "run.ckpt"
    out = launcher(4, _run_as_type, INTERLEAVED, None, strategy, config, 3, export_dir=str(live),
                   save_path=str(ckpt), batch_size=4)  # fmt: skip
    # the slow mesh (ranks 0, 2 by device type) runs first with one block, the fast one (1, 3) last with the head
    assert out[0][2]["ranks"] == [[0, 2], [1, 3]] and out[0][2]["layers"] == [1, 3], out[0][2]
    trained = {k: v for _, params, _ in out for k, v in params.items()}  # stages hold different parts
    _, reference = reference_run(config, 3)
    exported = AutoModelForCausalLM.from_pretrained(live).eval()
    state = exported.state_dict()
    ours = CausalLM(config)
    for name, tensor in ours.state_dict().items():
        value = trained[name][: config.vocab_size] if "embed_tokens" in name or "lm_head" in name else trained[name]
        tensor.copy_(value)
        assert torch.equal(state[name if name.startswith("lm_head") else f"model.{name}"], value), name
        assert_rel_close(value, reference[name][: value.shape[0]], 1e-5, name)  # hetero training == one process
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(exported, ids), ours.logits(ours(ids)), rtol=0, atol=1e-5)
    offline = export_hf(ckpt, tmp_path / "offline")  # the same weights through DCP resharding, in one process
    live_tensors = {k: v for f in sorted(live.glob("*.safetensors")) for k, v in load_file(f).items()}
    offline_tensors = {k: v for f in sorted(offline.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert live_tensors and live_tensors.keys() == offline_tensors.keys()
    for name, tensor in live_tensors.items():
        assert torch.equal(tensor, offline_tensors[name]), name

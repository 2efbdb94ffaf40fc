"""Two "nodes" x two processes on localhost: launched by two ``torchrun`` commands (static rendezvous, as on a
cluster) and by Lightning's own launcher with ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (two commands again).

The run is the main recipe's module (fp32, AdamW, warmup + cosine, clipping, ``LMDataModule``) under TP=2 x DP=2 with
``Trainer(num_nodes=2, devices=2)``. Every rank records its node and its tensor-parallel group: TP groups must be
the two ranks of one node (TP is the innermost mesh axis, so its collectives stay on the fast intra-node links).
Per-step losses and final weights must equal, to the last bit, the same layout run on one node with 4 processes
(global rank r sits on node r // 2 with local rank r % 2 either way, so every collective is the same).
"""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch

from tests.strategies._kill import ROOT, final_weights, job_env, launch_ok, losses, run_together

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

SPEC = dict(layout=dict(tensor_parallel_size=2), max_steps=3, every_n_steps=100, record_layout=True)
SCRIPT = str(ROOT / "tests" / "strategies" / "_resume_run.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(spec: dict, port: int) -> list:
    return [
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
          "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
          SCRIPT, json.dumps(spec)], job_env())
        for node in (0, 1)
    ]  # fmt: skip


def _lightning_env(spec: dict, port: int) -> list:
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4")
    return [([sys.executable, SCRIPT, json.dumps(spec)], job_env(NODE_RANK=str(node), **env)) for node in (0, 1)]


def _check_layout(out, env_name: str) -> None:
    rows = [json.loads((out / f"layout-{rank}.json").read_text()) for rank in range(4)]
    for rank, row in enumerate(rows):
        assert row["env"] == env_name, row
        assert row["node"] == rank // 2 and row["local"] == rank % 2, row
        assert row["tp"] == [2 * (rank // 2), 2 * (rank // 2) + 1], row  # the TP group is this node's two ranks


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_node")
    launch_ok({**SPEC, "out": str(out), "devices": 4})
    return losses(out), final_weights(out)


@pytest.mark.parametrize(
    ("launch", "env_name"), [(_torchrun, "TorchElasticEnvironment"), (_lightning_env, "LightningEnvironment")]
)
def test_two_nodes_keep_tp_inside_a_node_and_match_one_node(single_node, tmp_path, launch, env_name):
    spec = {**SPEC, "out": str(tmp_path), "devices": 2, "num_nodes": 2}
    for code, log in run_together(launch(spec, _free_port()), timeout=300):
        assert code == 0, log[-4000:]
    _check_layout(tmp_path, env_name)
    want_losses, want_weights = single_node
    assert losses(tmp_path) == want_losses
    weights = final_weights(tmp_path)
    assert weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        assert torch.equal(weights[name], value), name

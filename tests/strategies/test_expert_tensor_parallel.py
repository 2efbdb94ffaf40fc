"""Expert tensor parallelism (issue 39 item 4) inside Trainer.fit: each expert's FFN split over ETP ranks, folded with
EP over a stage's ranks, matches the single-process run (plain SGD, ragged labels, clipped, 3 steps, aux loss on).

Each launch trains several layouts one after the other on the same workers (one pool start per world size):

- ETP ranks holding different tokens (ETP over data-parallel ranks): tokens all-gathered over ETP, partial outputs
  reduce-scattered;
- ETP inside a TP group (the TP ranks feed the MoE blocks the same tokens): the same rows split, outputs all-reduced;
  under sequence parallelism (ETP = TP on 2 ranks, ETP 2 over half of TP 4 on 4) reduce-scattered over ETP, each rank
  its sequence chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_flagscale.convert import export_hf
from lightning_flagscale.models import CausalLM
from tests.moe._trainer import assert_sgd_parity, sgd_reference, sgd_trainer_run, shrink
from tests.strategies._lm import GRAD_NORMS, assert_rel_close, reference_run, trainer_run

STEPS = 3
CLIP = 1.0
REL = 1e-6

LAYOUTS_2 = {
    "etp2": dict(expert_tensor_parallel_size=2),  # dp 2 folded as etp 2: all-gather / reduce-scatter
    "tp2-sp-etp2-zero1": dict(  # etp = tp: the same rows split, partial outputs all-reduced
        tensor_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2, zero_stage=1
    ),
}
LAYOUTS_4 = {
    "ep2xetp2": dict(expert_parallel_size=2, expert_tensor_parallel_size=2),  # dp 4: all-to-all, then etp gather
    "ep2xetp2-tp2-zero1": dict(
        expert_parallel_size=2, expert_tensor_parallel_size=2, tensor_parallel_size=2, zero_stage=1
    ),
    "etp2-zero2": dict(expert_tensor_parallel_size=2, zero_stage=2),  # dp 4 = edp 2 x etp 2
    "tp4-sp-ep2xetp2": dict(  # etp < tp: each half of the TP group splits the same rows, reduce-scattered over etp
        tensor_parallel_size=4, sequence_parallel=True, expert_parallel_size=2, expert_tensor_parallel_size=2
    ),
}
# Two meshes of one layer each, ETP 2 on both: over data-parallel ranks on the first (gathered), inside TP on the
# second (replicated); one micro-batch per step, so the aux statistics are the whole batch's as in one process.
HETERO = dict(
    hetero_meshes=[
        dict(data_parallel_size=2, expert_tensor_parallel_size=2),
        dict(tensor_parallel_size=2, expert_tensor_parallel_size=2),
    ],
    hetero_layers=[1, 1], micro_batch_size=2, zero_stage=1,
)  # fmt: skip


def _safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}


def _hf_config():
    return shrink("mixtral-tiny", intermediate_size=16)  # Mixtral's config.json has one FFN width: the experts'


def _config(**overrides: Any):
    # 8 experts, top-2, moe_intermediate_size 16, its default aux loss; 4 KV heads, which TP 4 splits
    return shrink("mixtral-tiny", num_key_value_heads=4, **overrides)


def run_layouts(
    layouts: dict[str, dict[str, Any]], one_layer: bool = False, hf_dir: str | None = None, hetero: bool = False
) -> dict[str, dict[str, Any]]:
    """Every layout's ``sgd_trainer_run`` on this worker, in order (one launch for all of them), then
    :func:`layer_under_etp_sequence_parallel` in both modes; with ``one_layer`` also :func:`layer_under_etp` in both
    modes, with ``hf_dir`` :func:`hf_round_trip_under_etp`, with ``hetero`` the :data:`HETERO` layout."""
    results = {name: sgd_trainer_run(kwargs, _config(), STEPS, clip=CLIP) for name, kwargs in layouts.items()}
    if hetero:
        results["hetero"] = sgd_trainer_run(HETERO, _config(), STEPS, batch_size=2, clip=CLIP)
    if one_layer:
        results.update({f"layer-{mode}": layer_under_etp(mode == "replicated") for mode in ("gathered", "replicated")})
    results.update({f"layer-sp-{mode}": layer_under_etp_sequence_parallel(mode == "reduce-scatter")
                    for mode in ("all-reduce", "reduce-scatter")})  # fmt: skip
    if hf_dir is not None:
        results["hf"] = hf_round_trip_under_etp(hf_dir)
    return results


def _assert_experts_split(results: list[dict[str, Any]], ep: int, what: str) -> None:
    """Every rank holds 1/ep of the experts and half of each one's FFN (ETP 2)."""
    config = _config()
    e, inter, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for rank, res in enumerate(results):
        shapes = {n: s for n, s in res["local_shapes"].items() if ".experts." in n}
        assert shapes, (what, rank)
        for name, shape in shapes.items():
            want = (e // ep, inter, h) if name.endswith("gate_up_proj") else (e // ep, h, inter // 2)
            assert shape == want, (what, rank, name, shape, want)


def hf_round_trip_under_etp(hf_dir: str) -> dict[str, Any]:
    """An HF folder streamed into a model under ETP 2 (each rank reads its gate/up row blocks) and exported back."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.convert import export_hf
    from lightning_flagscale.convert.hf_import import load_hf_weights
    from lightning_flagscale.models import CausalLM
    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep

    reference = CausalLM(_hf_config())
    load_hf_weights(reference, hf_dir)
    model = CausalLM(_hf_config())
    apply_ep(model, init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "etp")))
    load_hf_weights(model, hf_dir)
    strided = isinstance(model.layers["0"].mlp.experts.gate_up_proj, DTensor)
    equal = all(
        torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, reference.get_parameter(name))
        for name, p in model.named_parameters()
    )
    export_hf(model, f"{hf_dir}-etp2")
    return {"strided": strided, "equal": equal}


@pytest.fixture(scope="module")
def reference():
    config = _config()
    assert config.moe_aux_loss_coeff > 0
    return sgd_reference(config, STEPS, clip=CLIP)


@pytest.mark.parametrize("world,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["world2", "world4"])
def test_expert_tensor_parallel_matches_single_process(launcher, reference, tmp_path, world, layouts):
    assert min(reference["norms"]) > CLIP  # clipping active: the compared pre-clip norms carry the gradient scale
    hf_dir = None
    if world == 2:  # an HF folder of seeded weights, read and written back under ETP 2 by the same launch
        hf_dir = str(tmp_path / "hf")
        source = CausalLM(_hf_config())
        source.init_weights(seed=3)
        export_hf(source, hf_dir)
    per_rank = launcher(world, run_layouts, layouts, world == 2, hf_dir, world == 4, timeout=600.0)
    for name in layouts:
        assert_sgd_parity([res[name] for res in per_rank], reference, name, rel=REL)
        _assert_experts_split([res[name] for res in per_rank], layouts[name].get("expert_parallel_size", 1), name)
    if world == 4:
        assert_sgd_parity([res["hetero"] for res in per_rank], reference, "hetero", rel=REL, pipeline=True)
        _assert_experts_split([res["hetero"] for res in per_rank], 1, "hetero")
    if hf_dir is not None:
        assert all(res["hf"]["strided"] and res["hf"]["equal"] for res in per_rank), [r["hf"] for r in per_rank]
        assert _safetensors(hf_dir + "-etp2").keys() == _safetensors(hf_dir).keys()
        for name, value in _safetensors(hf_dir + "-etp2").items():
            assert torch.equal(value, _safetensors(hf_dir)[name]), name
    for mode in ("gathered", "replicated") if world == 2 else ():
        for rank, res in enumerate(res[f"layer-{mode}"] for res in per_rank):
            assert res["is_dtensor"] and res["gate_up_local"] and res["down_local"] and res["full"], (mode, rank, res)
            for key in ("out_err", "gate_up_grad_err", "down_grad_err", "router_grad_err"):
                assert res[key] < REL, (mode, rank, key, res[key])
    # ETP 2 inside TP under SP (world 2: ETP = TP; world 4: ETP over half of TP 4): the reduce-scatter pair equals one
    # process and moves less than all-reduces
    n, k = world, 2  # TP and ETP sizes
    for rank, res in enumerate(per_rank):
        modes = {mode: res[f"layer-sp-{mode}"] for mode in ("all-reduce", "reduce-scatter")}
        for mode, layer in modes.items():
            errs = {"out": layer["out_err"], "input grad": layer["input_grad_err"], **layer["grad_errs"]}
            assert {"mlp.gate.weight", "mlp.shared_experts.down_proj.weight", "experts.down_proj"} <= set(errs)
            assert max(errs.values()) < REL, (world, mode, rank, errs)
        old, new = modes["all-reduce"]["ops"], modes["reduce-scatter"]["ops"]
        x, rows, weights = (modes["all-reduce"][key] for key in ("x_bytes", "row_bytes", "weight_bytes"))
        # before: every routed row all-reduced over ETP in forward (outputs) and backward (input gradients)
        assert old["reduce_scatter"].calls == 0 and old["all_reduce"].payload_bytes == 2 * rows
        assert modes["all-reduce"]["wire_bytes"] == 2 * (n - 1) / n * x + 2 * 2 * (k - 1) / k * rows
        # now: forward, the input all-gathered over TP and the output reduce-scattered over ETP, of the k chunks of
        # its ranks only; backward, the output gradient all-gathered over TP and the input's partial gradients
        # reduce-scattered over TP; left to all-reduce: the routing weights' gradients, one scalar per routed row
        assert new["reduce_scatter"].calls == 2 and new["all_gather"].calls == 2, (rank, new)
        assert new["reduce_scatter"].payload_bytes == x * k // n + x, (rank, new)
        assert new["all_reduce"].payload_bytes == weights, (rank, new)
        wire = modes["reduce-scatter"]["wire_bytes"]
        assert wire == (3 * (n - 1) + k - 1) / n * x + 2 * (k - 1) / k * weights, (rank, wire)
        assert wire < modes["all-reduce"]["wire_bytes"] / 2, (rank, modes)


def layer_under_etp(replicated: bool) -> dict[str, Any]:
    """One MoE layer under ETP 2 (world 2, no EP) against the same layer in this process: outputs, the local shards
    (gate and up rows of chunk s, down columns of chunk s) and their gradients. ``replicated``: both ranks feed the
    same tokens (ETP inside TP); else each rank its own (ETP over data-parallel ranks: all-gathered)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.moe import build_moe
    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep, set_moe_token_group

    rank = dist.get_rank()
    config = shrink("mixtral-tiny", moe_aux_loss_coeff=0.0)
    torch.manual_seed(0)
    ref = torch.nn.ModuleDict({"mlp": build_moe(config, 0)})
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    xs = torch.randn(2, 3, 5, config.hidden_size)  # one batch per rank
    ws = torch.randn(2, 3, 5, config.hidden_size)
    set_moe_token_group(ref, None)
    ref_out = [ref.mlp(xs[r]) for r in range(2)]
    sources = [0] if replicated else [0, 1]
    sum(((ref_out[r] * ws[r]).sum() for r in sources), torch.zeros(())).backward()

    model = torch.nn.ModuleDict({"mlp": build_moe(config, 0)})
    model.load_state_dict(ref.state_dict())
    set_moe_token_group(model, None)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "etp"))
    apply_ep(model, mesh, etp_tokens_replicated=replicated)
    x = xs[0] if replicated else xs[rank]
    w = ws[0] if replicated else ws[rank]
    out = model.mlp(x)
    (out * w).sum().backward()
    experts, ref_experts = model.mlp.experts, ref.mlp.experts
    inter = config.moe_intermediate_size // 2
    chunk = slice(rank * inter, (rank + 1) * inter)
    g, u = ref_experts.gate_up_proj.chunk(2, dim=1)
    gg, gu = ref_experts.gate_up_proj.grad.chunk(2, dim=1)
    return {
        "out_err": float((out - ref_out[0 if replicated else rank]).norm() / ref_out[0].norm()),
        "is_dtensor": isinstance(experts.gate_up_proj, DTensor),
        "gate_up_local": torch.equal(experts.gate_up_proj.to_local(), torch.cat([g[:, chunk], u[:, chunk]], dim=1)),
        "down_local": torch.equal(experts.down_proj.to_local(), ref_experts.down_proj[:, :, chunk]),
        "full": torch.equal(experts.gate_up_proj.full_tensor(), ref_experts.gate_up_proj.detach()),
        "gate_up_grad_err": float(
            (experts.gate_up_proj.grad.to_local() - torch.cat([gg[:, chunk], gu[:, chunk]], dim=1)).norm() / gg.norm()
        ),
        "down_grad_err": float(
            (experts.down_proj.grad.to_local() - ref_experts.down_proj.grad[:, :, chunk]).norm()
            / ref_experts.down_proj.grad.norm()
        ),
        "router_grad_err": float(
            (model.mlp.gate.weight.grad - ref.mlp.gate.weight.grad).norm() / ref.mlp.gate.weight.grad.norm()
        )
        if replicated
        else 0.0,
    }


def layer_under_etp_sequence_parallel(reduce_scatter: bool) -> dict[str, Any]:
    """One MoE layer with a shared expert and the aux loss, ETP 2 inside TP = world size under sequence parallelism
    (no EP; world 2: ETP = TP; world 4: ETP over half of the TP group, the other half a second ETP group, an
    expert-data-parallel copy): each rank feeds its chunk of the sequence and gets its chunk of the output.
    ``reduce_scatter``: the partial expert outputs reduce-scattered over ETP (the chunks of its ranks), the input's
    partial gradients over TP (``etp_sequence_parallel``); else all-reduced per routed row, then sliced. Outputs,
    input gradients and every parameter gradient against the layer in this process, and what each mode sends over
    the groups (``CommTracker``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.accounting.comm import CommTracker
    from lightning_flagscale.moe import build_moe
    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep, set_moe_token_group

    rank, world = dist.get_rank(), dist.get_world_size()
    config = shrink("mixtral-tiny", num_shared_experts=1, shared_expert_intermediate_size=24)
    assert config.moe_aux_loss_coeff > 0
    torch.manual_seed(0)
    ref = torch.nn.ModuleDict({"mlp": build_moe(config, 0)})
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 8, config.hidden_size)
    w = torch.randn(3, 8, config.hidden_size)
    set_moe_token_group(ref, None)
    x_ref = x.clone().requires_grad_(True)
    ref_out = ref.mlp(x_ref)
    (ref_out * w).sum().backward()

    model = torch.nn.ModuleDict({"mlp": build_moe(config, 0)})
    model.load_state_dict(ref.state_dict())
    set_moe_token_group(model, None)
    mesh = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("edp", "ep", "etp"))
    apply_ep(model, mesh[("ep", "etp")], etp_tokens_replicated=True, etp_sequence_parallel=reduce_scatter)
    model.mlp.sequence_parallel_group = dist.group.WORLD  # what the TP plan's MoESequenceParallel sets
    piece = x.shape[1] // world
    chunk = slice(rank * piece, (rank + 1) * piece)
    x_local = x[:, chunk].clone().requires_grad_(True)
    with CommTracker() as comm:
        out = model.mlp(x_local)
        (out * w[:, chunk]).sum().backward()

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.detach() - want.detach()).norm() / want.norm())

    inter = config.moe_intermediate_size // 2
    part = slice(rank % 2 * inter, (rank % 2 + 1) * inter)
    gg, gu = ref.mlp.experts.gate_up_proj.grad.chunk(2, dim=1)
    grads = {
        name: err(p.grad, ref.get_parameter(name).grad)
        for name, p in model.named_parameters()
        if not isinstance(p, DTensor)  # router and shared expert: replicated, the full gradient on every rank
    }
    grads["experts.gate_up_proj"] = err(model.mlp.experts.gate_up_proj.grad.to_local(),
                                        torch.cat([gg[:, part], gu[:, part]], dim=1))  # fmt: skip
    grads["experts.down_proj"] = err(
        model.mlp.experts.down_proj.grad.to_local(), ref.mlp.experts.down_proj.grad[..., part]
    )
    return {
        "out_err": err(out, ref_out[:, chunk]),
        "input_grad_err": err(x_local.grad, x_ref.grad[:, chunk]),
        "grad_errs": grads,
        "ops": {op: comm.stats(op) for op in ("all_reduce", "all_gather", "reduce_scatter")},
        "wire_bytes": comm.total_wire_bytes(),
        "x_bytes": x.numel() * x.element_size(),  # the block's whole input
        "row_bytes": x.numel() * config.num_experts_per_tok * x.element_size(),  # every routed row, H wide
        "weight_bytes": x.numel() // config.hidden_size * config.num_experts_per_tok * x.element_size(),
    }


# ---- checkpoints reshard across ETP sizes: one AdamW run saved and resumed under three layouts in turn equals one
# uninterrupted single-process AdamW run (Adam's moments of the ETP-split gate/up rows must land on the right rows) ----
NUM_SAMPLES, STEPS_PER_EPOCH = 12, 3  # global batch 4: each checkpoint sits on an epoch boundary
RESUME_LEGS = [  # (what, strategy keywords, DataLoader batch per rank)
    ("ep2xetp2-zero1", dict(expert_parallel_size=2, expert_tensor_parallel_size=2, zero_stage=1), 1),
    ("ep2-zero1", dict(expert_parallel_size=2, zero_stage=1), 1),  # ETP 2 -> 1
    ("tp2-etp2-zero1", dict(tensor_parallel_size=2, expert_tensor_parallel_size=2, zero_stage=1), 2),  # ETP 1 -> 2
]


def resume_chain(folder: str) -> list[tuple[list[float], dict]]:
    """Every leg of :data:`RESUME_LEGS` on this worker, each resuming the previous leg's checkpoint."""
    results, checkpoint = [], None
    for leg, (what, strategy, batch_size) in enumerate(RESUME_LEGS):
        save = f"{folder}/{leg}-{what}.ckpt"
        kwargs = dict(max_epochs=leg + 1, num_samples=NUM_SAMPLES, clip=CLIP, optimizer="adamw", batch_size=batch_size)
        results.append(trainer_run(strategy, _config(), -1, ckpt_path=checkpoint, save_path=save, **kwargs))
        checkpoint = save
    return results


def test_adam_checkpoints_reshard_across_expert_tensor_parallel_sizes(launcher, tmp_path):
    references = [
        reference_run(_config(), STEPS_PER_EPOCH * (leg + 1), clip=CLIP, num_samples=NUM_SAMPLES, optimizer="adamw")
        for leg in range(len(RESUME_LEGS))
    ]
    ref_losses, ref_params = references[-1]
    assert (ref_params[GRAD_NORMS] > CLIP).all(), ref_params[GRAD_NORMS]  # clipping active at every step
    per_rank = launcher(4, resume_chain, str(tmp_path), timeout=600.0)
    for leg, (what, _, _) in enumerate(RESUME_LEGS):
        steps = slice(STEPS_PER_EPOCH * leg, STEPS_PER_EPOCH * (leg + 1))
        want = references[leg][1]
        for rank, legs in enumerate(per_rank):
            losses, params = legs[leg]
            where = f"leg {leg + 1} ({what}) rank {rank}"
            assert losses == pytest.approx(ref_losses[steps], rel=1e-5), (where, losses, ref_losses[steps])
            assert_rel_close(params.pop(GRAD_NORMS), ref_params[GRAD_NORMS][steps], 1e-5, f"{where} gradient norms")
            assert set(params) == set(want) - {GRAD_NORMS}, where
            for name, value in params.items():
                assert_rel_close(value, want[name], 1e-5, f"{where} {name}")

"""Expert parallelism (gloo/CPU): EP layers equal the single-process layer run on every rank's tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.moe import build_moe
from lightning_flagscale.parallel.expert_parallel.apply import apply_ep, is_expert_param, set_moe_token_group
from tests.moe._reference import init_moe, rel_err


def _ep_parity(
    preset: str,
    mesh_shape: tuple[int, ...],
    overrides: dict,
    replicate: tuple[int, ...] = (),
    recompute: tuple[str | None, int | None] = (None, None),
    sp: bool = False,
    drop_policy: str = "position",
) -> dict:
    """With ``sp`` the ranks are one sequence-parallel (TP) group: each holds its chunk of the same sequences and
    routes it (``MoELayer.forward``); the oracle is one process on the whole sequences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ("edp", "ep") if len(mesh_shape) == 2 else ("ep",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    cfg = TransformerConfig.from_preset(preset, **overrides)
    ref = set_moe_token_group(init_moe(build_moe(cfg, cfg.first_k_dense_layers), seed=0), None)
    ref.drop_policy = drop_policy
    layer = apply_ep(copy.deepcopy(ref), mesh)
    # Every rank holds different tokens; this test sums (not averages) gradients over ranks, hence grad_scale 1.
    set_moe_token_group(layer, dist.group.WORLD, grad_scale=1.0)
    layer.replicated_experts = replicate
    layer.recompute_level, layer.recompute_token_threshold = recompute
    g = torch.Generator().manual_seed(1)
    if sp:
        layer.sequence_parallel_group = dist.group.WORLD  # what the TP plan's MoESequenceParallel sets
        full_x = torch.randn(2, 4 * world, cfg.hidden_size, generator=g)
        full_g = torch.randn(full_x.shape, generator=g)
        chunks = lambda t: torch.stack(t.chunk(world, dim=1))  # noqa: E731
        xs, gs = chunks(full_x), chunks(full_g)
    else:
        xs = torch.randn(world, 2, 5, cfg.hidden_size, generator=g)
        gs = torch.randn(world, 2, 5, cfg.hidden_size, generator=g)
    ref_x = xs.clone().requires_grad_()
    if sp:  # one process on the whole sequences (capacity and aux statistics of all of them)
        ref_out = chunks(ref(torch.cat(list(ref_x), dim=1)))
    elif cfg.moe_aux_loss_scope == "global":
        # Oracle: the single-process layer on all ranks' tokens at once (global aux/z statistics).
        ref_out = ref(ref_x.view(world * 2, 5, -1)).view(xs.shape)
    else:  # per-shard aux losses (and per-shard capacity), summed
        ref_out = torch.stack([ref(ref_x[r]) for r in range(world)])
    (ref_out * gs).sum().backward()

    x = xs[rank].clone().requires_grad_()
    out = layer(x)
    (out * gs[rank]).sum().backward()
    errs = {"out": rel_err(out.detach(), ref_out[rank].detach()), "x_grad": rel_err(x.grad, ref_x.grad[rank])}
    if cfg.moe_aux_loss_scope == "global":  # every rank reports the global values
        for key, value in ref.last_aux_losses.items():
            errs["value:" + key] = rel_err(layer.last_aux_losses[key], value)
    edp_group = mesh["edp"].get_group() if "edp" in names else None
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = p.grad
        if isinstance(p, DTensor):
            assert is_expert_param(p) and isinstance(grad, DTensor)
            grad = grad.to_local().clone()
            if edp_group is not None:  # the contract: expert grads are summed over edp only
                dist.all_reduce(grad, group=edp_group)
            per = grad.shape[0]
            ep_rank = mesh["ep"].get_local_rank()
            expected = ref_params[name].grad[ep_rank * per : (ep_rank + 1) * per]
            errs[name + ".full"] = rel_err(p.full_tensor().detach(), ref_params[name].detach())
        else:
            assert not is_expert_param(p)
            grad = grad.clone()
            if not sp:  # under SP the layer summed them over the TP group itself
                dist.all_reduce(grad)  # router / shared experts: normal data-parallel sum
            expected = ref_params[name].grad
        errs[name] = rel_err(grad, expected)
    assert list(layer.state_dict()) == list(ref.state_dict())
    return {"errs": errs, "a2a_bytes": layer.a2a_bytes, "tokens_per_ep_rank": layer.tokens_per_ep_rank.tolist(),
            "dropped": layer.dropped_fraction}  # fmt: skip


def _tp_sums_per_step(preset: str, micro_batches: int) -> dict:
    """TP 2 + SP x EP 2 on 2 ranks (the EP group is the TP pair), ``micro_batches`` per step, the gradients reduced by
    DDP (``DistributedOptimizer`` over ``reduction_groups``, as the strategy builds it). Two paths: the layer summing
    its chunk-partial gradients over TP where it uses the weights (standalone), and the strategy's
    (``tag_chunk_routed_params``: summed inside the data-parallel buckets over dp x cp x tp, once per step). Counted
    with ``CommTracker`` over the whole step, without aux losses (whose statistics would add all-reduces); gradients
    compared with one process on the whole sequences."""
    from lightning_flagscale.accounting.comm import CommTracker
    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer, reduction_groups
    from lightning_flagscale.parallel.expert_parallel.apply import tag_chunk_routed_params, tag_expert_params
    from lightning_flagscale.parallel.mesh import build_meshes

    parallel = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2).resolve(2)
    meshes = build_meshes(parallel, "cpu")
    stage_group = meshes.group("dp_cp_tp")
    cfg = TransformerConfig.from_preset(preset, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    ref = set_moe_token_group(init_moe(build_moe(cfg, cfg.first_k_dense_layers), seed=0), None)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(micro_batches, 2, 8, cfg.hidden_size, generator=g)
    gs = torch.randn(xs.shape, generator=g)
    for x, grad_out in zip(xs, gs):  # one process: each micro-batch's whole sequences, gradients accumulated
        (ref(x) * grad_out).sum().backward()
    rank, ref_params = dist.get_rank(), dict(ref.named_parameters())
    out = {}
    for path in ("at use", "at step"):
        layer = apply_ep(copy.deepcopy(ref), meshes[("ep", "etp")])
        layer.zero_grad(set_to_none=True)
        layer.sequence_parallel_group = meshes.group("tp")  # what the TP plan's MoESequenceParallel sets
        tag_expert_params(layer)
        tagged = tag_chunk_routed_params(layer) if path == "at step" else []
        groups, divisors = reduction_groups(meshes, parallel)
        dopt = DistributedOptimizer(
            torch.optim.SGD(layer.parameters(), lr=0.1), layer, groups, stage=0, master_weights=False,
            divisors=divisors,
        )  # fmt: skip
        with CommTracker() as comm:
            for i, (x, grad_out) in enumerate(zip(xs, gs)):
                dopt.require_sync = i == micro_batches - 1  # the strategy's no_grad_sync inside the window
                (layer(x.chunk(2, dim=1)[rank]) * grad_out.chunk(2, dim=1)[rank]).sum().backward()
            dopt.reduce_grads()
        errs = {}
        for name, p in layer.named_parameters():
            if isinstance(p, DTensor):  # this EP rank's experts; the rest of the layer is whole on every rank
                per = p.to_local().shape[0]
                want, got = ref_params[name].grad[rank * per : (rank + 1) * per], p.grad.to_local()
            else:
                want, got = ref_params[name].grad, p.grad
            errs[name] = rel_err(got, want)
        out[path] = {
            "errs": errs, "tagged": len(tagged), "all_reduces": comm.stats("all_reduce").calls,
            "buckets": len(dopt.buckets), "stage_buckets": sum(b.group is stage_group for b in dopt.buckets),
        }  # fmt: skip
        dopt.close()
    return out


def _dropless_runs(preset: str) -> list[dict]:
    return [_ep_parity(preset, (2,), AUX), _tp_sums_per_step("qwen2-moe-tiny", micro_batches=3)]


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


AUX = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}


def test_ep2_dropless_matches_single_process(launcher):
    parity, tp_sums = zip(*launcher(2, _dropless_runs, "deepseek-v3-routing-tiny"))
    _check(list(parity))
    # Same launch, TP 2 + SP = EP 2, 3 micro-batches per step: qwen2-moe's router, shared expert and its gate see only
    # their TP rank's chunk. Summed where the layer uses them: 3 TP all-reduces per micro-batch besides the step's
    # one reduction per DDP bucket. Summed by the step (the strategy's path): no all-reduce but one per bucket, their
    # buckets reduced over dp x cp x tp instead of dp x cp (on 2 ranks both the TP group: no group to tell apart).
    for rank, res in enumerate(tp_sums):
        at_use, at_step = res["at use"], res["at step"]
        assert at_use["all_reduces"] == at_use["buckets"] + 3 * 3 and at_use["stage_buckets"] == 0, (rank, at_use)
        assert at_step["tagged"] == 5, at_step  # gate.weight, shared_expert.{gate,up,down}_proj, shared_expert_gate
        assert at_step["stage_buckets"] >= 1 and at_step["all_reduces"] == at_step["buckets"], (rank, at_step)
        _check([at_use, at_step])  # both equal one process


def test_ep4_dropless_matches_single_process(launcher):
    results = launcher(4, _ep_parity, "qwen2-moe-tiny", (4,), AUX)
    _check(results)
    assert len(results[0]["tokens_per_ep_rank"]) == 4 and sum(results[0]["tokens_per_ep_rank"]) == 4 * 10 * 2


def test_edp2_ep2_folded_grads_reduced_over_edp(launcher):
    _check(launcher(4, _ep_parity, "mixtral-tiny", (2, 2), AUX))


def _capacity_layouts(local: dict, capped: dict) -> list[dict]:
    """Per-rank shards with per-shard capacity, then sequence-parallel chunks under both drop policies."""
    runs = [_ep_parity("mixtral-tiny", (2,), local)]
    return runs + [_ep_parity("mixtral-tiny", (2,), capped, sp=True, drop_policy=p) for p in ("position", "probs")]


def test_ep2_capacity_matches_single_process(launcher):
    # Capacity is per rank (its own token count), so the oracle runs shard by shard with per-shard aux losses. Under
    # sequence parallelism (TP 2 = EP 2 here) the drop decisions are the whole sequence's, as in one process, while
    # each rank routes and dispatches its own chunk (same launch; both drop policies).
    local = {"moe_capacity_factor": 0.75, "moe_aux_loss_scope": "local", **AUX}
    capped = {"moe_capacity_factor": 0.75, **AUX}
    for results in zip(*launcher(2, _capacity_layouts, local, capped)):
        _check(list(results))
        assert all(r["dropped"] > 0 for r in results)  # the capacity really drops assignments


def test_hot_expert_replication_changes_traffic_not_results(launcher):
    plain = launcher(2, _ep_parity, "mixtral-tiny", (2,), AUX)
    _check(plain)
    # (1, 6): one replicated expert per owner; (0, 1): rank 1 owns none of them but joins the replica collectives.
    for replicate in ((1, 6), (0, 1)):
        replicated = launcher(2, _ep_parity, "mixtral-tiny", (2,), AUX, replicate=replicate)
        _check(replicated)
        assert sum(r["a2a_bytes"] for r in replicated) < sum(r["a2a_bytes"] for r in plain)


@pytest.mark.parametrize("recompute", [("full", None), ("medium", 0)])
def test_ep2_recompute_matches_single_process(launcher, recompute):
    # "full" re-runs the all-to-alls inside backward; "medium" with a threshold exercises the adaptive decision.
    _check(launcher(2, _ep_parity, "deepseek-v3-routing-tiny", (2,), AUX, replicate=(3,), recompute=recompute))


def _ep_error(num_experts: int) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    cfg = TransformerConfig.from_preset("mixtral-tiny", num_experts=num_experts)
    try:
        apply_ep(build_moe(cfg, 0), mesh)
    except ValueError as err:
        return str(err)
    return ""


def test_errors(launcher):
    assert "num_experts=5 is not divisible by the expert-parallel size 2" in launcher(2, _ep_error, 5)[0]
    with pytest.raises(ValueError, match="no MoE layers"):
        apply_ep(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]

"""Single-process MoE layer tests against per-token dense oracles and hand-computed losses."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.moe import (
    HotExpertReplication,
    MoELayer,
    TopKRouter,
    apply_moe_recompute,
    build_moe,
    update_moe_state,
)
from lightning_flagscale.moe.balance import select_hot_experts
from lightning_flagscale.moe.experts import grouped_linear, grouped_mm_usable
from tests.moe._reference import init_moe, reference_moe, reference_route, rel_err

PRESETS = ["mixtral-tiny", "qwen2-moe-tiny", "deepseek-v3-routing-tiny"]


def make_layer(preset: str, seed: int = 0, **overrides) -> MoELayer:
    cfg = TransformerConfig.from_preset(preset, **overrides)
    return init_moe(build_moe(cfg, cfg.first_k_dense_layers), seed)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("grouped", [True, False])
def test_matches_per_token_reference(preset, grouped):
    layer = make_layer(preset)
    layer.experts.use_grouped_mm = grouped
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert rel_err(layer(x), reference_moe(layer, x)) <= 1e-5


def test_grouped_mm_and_segment_fallback_same_gradients():
    w = torch.randn(4, 32, 16)
    x = torch.randn(11, 16)
    counts = [3, 0, 6, 2]
    assert grouped_mm_usable(x, w) == hasattr(torch, "_grouped_mm")
    outs, grads = [], []
    for use in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xi, wi, counts, use_grouped_mm=use)
        y.sum().backward()  # expanded (stride-0) gradient: the grouped-mm backward must cope
        outs.append(y.detach())
        grads.append((xi.grad, wi.grad))
    ref = torch.cat([seg @ w[e].T for e, seg in enumerate(x.split(counts))])
    assert rel_err(outs[0], ref) <= 1e-5 and rel_err(outs[1], ref) <= 1e-5
    assert rel_err(grads[0][0], grads[1][0]) <= 1e-5 and rel_err(grads[0][1], grads[1][1]) <= 1e-5


def test_gradients_match_reference():
    layer = make_layer("deepseek-v3-routing-tiny")
    x = torch.randn(2, 5, 64)
    g = torch.randn(2, 5, 64)
    (layer(x) * g).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    (reference_moe(layer, x) * g).sum().backward()
    for n, p in layer.named_parameters():
        assert rel_err(got[n], p.grad) <= 1e-5, n


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_drops_exactly_expected(policy):
    layer = make_layer("mixtral-tiny", moe_capacity_factor=0.5)
    layer.drop_policy = policy
    x = torch.randn(1, 12, 64)
    flat = x.view(-1, 64)
    chosen, weights = reference_route(layer, flat)
    cap = math.ceil(12 * 2 / 8 * 0.5)
    per_expert: dict[int, list[tuple[int, int]]] = {}
    for t in range(12):
        for j, e in enumerate(chosen[t]):
            per_expert.setdefault(e, []).append((t, j))
    keep = set()
    for rows in per_expert.values():
        if policy == "probs":
            rows = sorted(rows, key=lambda tj: -float(weights[tj[0]][tj[1]]))
        keep |= set(rows[:cap])
    assert len(keep) < 24  # the setup really drops tokens
    with torch.no_grad():
        out = layer(x)
        assert rel_err(out, reference_moe(layer, x, keep=keep)) <= 1e-5
        assert layer.dropped_fraction == pytest.approx(1 - len(keep) / 24)
        assert rel_err(out, reference_moe(layer, x)) > 1e-3  # dropping changes the output


def test_aux_losses_hand_computed_and_reach_gradients():
    layer = make_layer("mixtral-tiny", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x = torch.randn(1, 6, 64)
    flat = x.view(-1, 64)
    chosen, _ = reference_route(layer, flat)
    E, T, k = 8, 6, 2
    logits = [[float(v) for v in layer.gate.weight @ flat[t]] for t in range(T)]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    f = [sum(row.count(e) for row in chosen) / (T * k) for e in range(E)]
    p = [sum(probs[t][e] for t in range(T)) / T for e in range(E)]
    aux = 0.1 * E * sum(fi * pi for fi, pi in zip(f, p))
    z = 0.01 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / T
    g = torch.randn_like(x)
    layer.aux_loss_scale = 0.5
    (layer(x) * g).sum().backward()
    assert layer.last_aux_losses["aux_loss"].item() == pytest.approx(aux, rel=1e-5)
    assert layer.last_aux_losses["z_loss"].item() == pytest.approx(z, rel=1e-5)
    got = layer.gate.weight.grad.clone()
    layer.zero_grad()
    out = reference_moe(layer, x)
    route_scores = (flat @ layer.gate.weight.T).softmax(-1)
    idx = torch.tensor(chosen)
    aux_t = 0.1 * E * (torch.bincount(idx.view(-1), minlength=E) / (T * k) * route_scores.mean(0)).sum()
    z_t = 0.01 * torch.logsumexp(flat @ layer.gate.weight.T, -1).square().mean()
    ((out * g).sum() + 0.5 * (aux_t + z_t)).backward()
    assert rel_err(got, layer.gate.weight.grad) <= 1e-5


def test_bias_balancing_updates_outside_autograd():
    layer = make_layer("deepseek-v3-routing-tiny")
    bias0 = layer.gate.e_score_correction_bias.clone()
    x = torch.randn(2, 8, 64)
    layer(x).sum().backward()
    load = layer.load_accum.clone()
    assert load.sum() == 2 * 8 * 2
    update_moe_state(layer)
    expected = bias0 + 1e-3 * torch.sign(load.mean() - load)
    assert torch.equal(layer.gate.e_score_correction_bias, expected)
    assert layer.load_accum.sum() == 0 and not layer.gate.e_score_correction_bias.requires_grad


@pytest.mark.parametrize("rate", [0.0, 1e-3])
def test_update_moe_state_reduces_the_load_only_when_something_reads_it(rate, monkeypatch):
    # Without a bias update or hot experts nothing reads the step's load: no collective (every rank has the same
    # configuration, so every rank skips it); the accumulator is still reset.
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(t.shape))
    layer = make_layer("deepseek-v3-routing-tiny", moe_router_bias_update_rate=rate)
    layer.train()
    layer(torch.randn(2, 8, 64)).sum().backward()
    assert layer.load_accum.sum() > 0
    update_moe_state(layer, group=object())  # a group: the load would be summed over it
    assert calls == ([(1, layer.num_experts)] if rate else [])
    assert layer.load_accum.sum() == 0


@pytest.mark.parametrize("level,threshold", [("light", None), ("medium", None), ("full", None), ("medium", 4)])
def test_recompute_levels_same_gradients(level, threshold):
    x = torch.randn(2, 6, 64)
    grads = []
    for lvl in (None, level):
        layer = make_layer("qwen2-moe-tiny", moe_z_loss_coeff=0.01)
        apply_moe_recompute(layer, lvl, token_threshold=threshold)
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()
        grads.append([xi.grad] + [p.grad for _, p in sorted(layer.named_parameters())])
        if lvl is not None:
            assert layer.load_accum.sum() == 2 * 6 * 2  # recomputation does not double-count telemetry
    for a, b in zip(*grads):
        assert rel_err(b, a) <= 1e-5


def test_adaptive_recompute_threshold_gates_checkpointing():
    layer = make_layer("mixtral-tiny")
    layer.train()
    layer.recompute_level, layer.recompute_token_threshold = "medium", 10
    assert layer._recompute_parts(10) == frozenset()
    assert "fc1" in layer._recompute_parts(11)


def test_hot_expert_selection_hysteresis():
    cfg = HotExpertReplication(num_replicas=2, enable_imbalance=2.0, disable_imbalance=1.2)
    skewed = torch.tensor([10.0, 1, 1, 30, 1, 1, 1, 3])
    assert select_hot_experts(skewed, cfg, ()) == (0, 3)
    mid = torch.tensor([6.0, 4, 4, 6, 4, 4, 4, 4])  # imbalance 1.33: keep the current replicas
    assert select_hot_experts(mid, cfg, (0, 3)) == (0, 3)
    assert select_hot_experts(torch.ones(8), cfg, (0, 3)) == ()


def test_errors():
    with pytest.raises(ValueError, match="top_k=9 is larger than num_experts=8"):
        TopKRouter(64, 8, 9)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        TransformerConfig.from_preset("mixtral-tiny", num_experts_per_tok=9)
    with pytest.raises(ValueError, match="group top-k"):
        TopKRouter(64, 8, 4, num_groups=4, group_topk=1)
    with pytest.raises(ValueError, match="recompute level 'heavy' is unknown"):
        apply_moe_recompute(make_layer("mixtral-tiny"), "heavy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an MoE layer"):
        build_moe(TransformerConfig.from_preset("deepseek-v3-routing-tiny"), 0)


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-v3-routing-tiny"])
def test_global_losses_in_one_process_equal_local(preset):
    # Without a token group the global statistics are this process's: value and gradient equal the local formulas.
    x = torch.randn(2, 6, 64)
    grads, values = [], []
    for scope in ("global", "local"):
        layer = make_layer(preset, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_seq_aux_loss_coeff=0.1,
                           moe_aux_loss_scope=scope)  # fmt: skip
        layer.token_group = None
        layer(x).square().sum().backward()
        grads.append(layer.gate.weight.grad)
        values.append(layer.last_aux_losses)
    assert rel_err(grads[0], grads[1]) <= 1e-6
    assert values[0].keys() == values[1].keys() == {"aux_loss", "z_loss", "seq_aux_loss"}
    for key in values[0]:
        assert values[0][key].item() == pytest.approx(values[1][key].item(), rel=1e-6)


def test_moe_config_knobs_reach_the_layer():
    layer = make_layer("deepseek-v3-routing-tiny", moe_recompute="medium", moe_recompute_token_threshold=8,
                       moe_hot_expert_replicas=2, moe_hot_expert_enable_imbalance=1.3)  # fmt: skip
    assert (layer.recompute_level, layer.recompute_token_threshold) == ("medium", 8)
    assert layer.hot_expert_config == HotExpertReplication(num_replicas=2, enable_imbalance=1.3)
    assert make_layer("mixtral-tiny").aux_loss_scope == "global"
    with pytest.raises(ValueError, match="moe_aux_loss_scope='batch'"):
        TransformerConfig.from_preset("mixtral-tiny", moe_aux_loss_scope="batch")
    with pytest.raises(ValueError, match="moe_recompute='heavy'"):
        TransformerConfig.from_preset("mixtral-tiny", moe_recompute="heavy")
    with pytest.raises(ValueError, match="moe_hot_expert_replicas=9"):
        TransformerConfig.from_preset("mixtral-tiny", moe_hot_expert_replicas=9)
    with pytest.raises(ValueError, match="disable_imbalance"):
        make_layer("mixtral-tiny", moe_hot_expert_replicas=1, moe_hot_expert_disable_imbalance=2.0)

"""DeepSeek-V3's complementary sequence-wise balance loss (report eq. 17-20; issue 39 item 5): the formula by hand, and
the same value and router gradient when a batch's sequences are spread over data-parallel ranks and each sequence's
tokens over context-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert import family_for
from lightning_flagscale.moe import build_moe
from lightning_flagscale.moe.layer import MoELayer
from tests.moe._reference import init_moe, reference_moe, reference_route, rel_err

ALPHA = 0.1


def _layer(preset: str, **overrides) -> MoELayer:
    cfg = TransformerConfig.from_preset(preset, moe_seq_aux_loss_coeff=ALPHA, **overrides)
    return init_moe(build_moe(cfg, cfg.first_k_dense_layers), seed=0)


def _by_hand(layer: MoELayer, x: torch.Tensor) -> float:
    """alpha * mean over sequences of sum_i f_i P_i, from per-token Python loops."""
    E, k = layer.num_experts, layer.top_k
    total = 0.0
    for seq in x:
        chosen, _ = reference_route(layer, seq)
        T = seq.shape[0]
        scores = []
        for t in range(T):
            s = (layer.gate.weight @ seq[t]).sigmoid() if layer.gate.score_func == "sigmoid" else None
            s = (layer.gate.weight @ seq[t]).softmax(-1) if s is None else s / s.sum()
            scores.append(s)
        f = [E / (k * T) * sum(row.count(e) for row in chosen) for e in range(E)]
        p = [sum(float(s[e]) for s in scores) / T for e in range(E)]
        total += sum(fi * pi for fi, pi in zip(f, p))
    return ALPHA * total / x.shape[0]


def _reference_loss(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The same loss as a differentiable torch expression (counts from the per-token reference routing)."""
    E, k = layer.num_experts, layer.top_k
    terms = []
    for seq in x:
        chosen, _ = reference_route(layer, seq)
        logits = seq @ layer.gate.weight.T
        s = logits.sigmoid() if layer.gate.score_func == "sigmoid" else logits.softmax(-1)
        s = s / s.sum(-1, keepdim=True)
        f = E / (k * seq.shape[0]) * torch.bincount(torch.tensor(chosen).view(-1), minlength=E)
        terms.append((f * s.mean(0)).sum())
    return ALPHA * torch.stack(terms).mean()


@pytest.mark.parametrize("preset", ["deepseek-v3-routing-tiny", "mixtral-tiny"])
@pytest.mark.parametrize("scope", ["global", "local"])
def test_sequence_loss_by_hand_and_its_gradient(preset, scope):
    # Per sequence f and P, not over the batch: the batch's value differs from the Switch loss of the same tokens.
    layer = _layer(preset, moe_aux_loss_coeff=0.0, moe_aux_loss_scope=scope)
    layer.token_group = None  # one process
    x = torch.randn(3, 5, layer.hidden_size)
    g = torch.randn_like(x)
    layer.aux_loss_scale = 0.5
    (layer(x) * g).sum().backward()
    assert set(layer.last_aux_losses) == {"seq_aux_loss"}
    assert layer.last_aux_losses["seq_aux_loss"].item() == pytest.approx(_by_hand(layer, x), rel=1e-5)
    got = layer.gate.weight.grad.clone()
    layer.zero_grad()
    ((reference_moe(layer, x) * g).sum() + 0.5 * _reference_loss(layer, x)).backward()
    assert rel_err(got, layer.gate.weight.grad) <= 1e-5
    # and the sequence loss really is per sequence: the whole batch as one sequence gives another value
    layer.zero_grad()
    layer(x.reshape(1, -1, layer.hidden_size))
    assert abs(layer.last_aux_losses["seq_aux_loss"].item() - _by_hand(layer, x)) > 1e-4


def test_sequence_loss_config_is_validated():
    with pytest.raises(ValueError, match=r"moe_seq_aux_loss_coeff=-0\.1"):
        TransformerConfig.from_preset("deepseek-v3-routing-tiny", moe_seq_aux_loss_coeff=-0.1)


def test_deepseek_presets_and_checkpoints_carry_the_sequence_loss():
    # DeepSeek-V3's config.json: ``seq_aux: true, aux_loss_alpha: 0.001``; transformers' config class drops neither.
    config = TransformerConfig.from_preset("deepseek-v3-tiny")
    assert config.moe_seq_aux_loss_coeff == 1e-3
    family = family_for({"model_type": "deepseek_v3"})
    hf = family.config_to_hf(config)
    assert (hf["aux_loss_alpha"], hf["seq_aux"]) == (1e-3, True)
    same = dict(name=config.name, hf_source=config.hf_source, moe_router_bias_update_rate=1e-3)  # not in config.json
    assert family.config_from_hf(hf, **same) == config
    assert family.config_from_hf({**hf, "seq_aux": False}).moe_seq_aux_loss_coeff == 0.0  # a batch-wise alpha
    assert family.config_from_hf({k: v for k, v in hf.items() if k != "seq_aux"}).moe_seq_aux_loss_coeff == 0.0


def _spread(preset: str, dp: int, cp: int) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Each rank: its sequences (dp) and its token shard of them (cp, zigzag as load-balanced CP does); returns the
    loss value here and in one process (checked by hand above), the summed router gradient and one process's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    d, c = divmod(rank, cp)
    cp_groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)]
    layer = _layer(preset)
    layer.token_group, layer.sequence_group, layer.token_grad_scale = dist.group.WORLD, cp_groups[d], 1.0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * dp, 4 * cp, layer.hidden_size, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    chunks = lambda t: t.chunk(2 * cp, dim=1)  # noqa: E731
    mine = lambda t: torch.cat([chunks(t)[c], chunks(t)[2 * cp - 1 - c]], 1)[2 * d : 2 * d + 2]  # noqa: E731
    (layer(mine(x)) * mine(grad_out)).sum().backward()
    got = layer.gate.weight.grad.clone()
    dist.all_reduce(got)  # token_grad_scale 1: the shares' gradients sum to the loss's
    reference = _layer(preset)
    reference.token_group = None
    (reference(x) * grad_out).sum().backward()
    value, want = layer.last_aux_losses["seq_aux_loss"], reference.last_aux_losses["seq_aux_loss"]
    return value.item(), want.item(), got, reference.gate.weight.grad


def _spread_over_tp(preset: str) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """cp 2 x tp 2 under sequence parallelism: each rank routes its TP chunk of its (zigzag) context shard, so a
    sequence spans all four ranks; the router's gradient is summed over TP by the layer, then over CP here."""
    import torch.distributed as dist

    cp, tp = 2, 2
    c, t = divmod(dist.get_rank(), tp)
    cp_groups = [dist.new_group([i, tp + i]) for i in range(tp)]
    tp_groups = [dist.new_group([tp * i, tp * i + 1]) for i in range(cp)]
    layer = _layer(preset)
    layer.token_group, layer.sequence_group, layer.token_grad_scale = dist.group.WORLD, cp_groups[t], 1.0
    layer.sequence_parallel_group = tp_groups[c]  # what the TP plan's MoESequenceParallel sets
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4 * cp * tp, layer.hidden_size, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    chunks = lambda u: u.chunk(2 * cp, dim=1)  # noqa: E731
    mine = lambda u: torch.cat([chunks(u)[c], chunks(u)[2 * cp - 1 - c]], 1).chunk(tp, dim=1)[t]  # noqa: E731
    (layer(mine(x)) * mine(grad_out)).sum().backward()
    got = layer.gate.weight.grad.clone()
    dist.all_reduce(got, group=cp_groups[t])  # the layer summed it over TP already
    reference = _layer(preset)
    reference.token_group = None
    (reference(x) * grad_out).sum().backward()
    value, want = layer.last_aux_losses["seq_aux_loss"], reference.last_aux_losses["seq_aux_loss"]
    return value.item(), want.item(), got, reference.gate.weight.grad


def _spread_both(preset: str) -> list[tuple[float, float, torch.Tensor, torch.Tensor]]:
    return [_spread(preset, 2, 2), _spread_over_tp(preset)]


@pytest.mark.parametrize("preset", ["deepseek-v3-routing-tiny"])
def test_sequence_loss_over_data_and_context_parallel_ranks(launcher, preset):
    # dp 2 x cp 2, and cp 2 x tp 2 with each TP rank routing its own sequence chunk (its statistics summed over the
    # TP group too): every rank reports the batch's loss, and the summed router gradients are one process's.
    for results in launcher(4, _spread_both, preset):
        for value, want_value, got, want in results:
            assert value == pytest.approx(want_value, rel=1e-5)
            assert rel_err(got, want) <= 1e-5

"""Context parallelism (issue 4): ring, Ulysses and hybrid attention against single-process fp32 full attention.

Every multi-process task runs a list of cases in one launcher call (spawning work per case costs more than the
attention itself) and returns the relative errors of the output and of the q/k/v gradients, rank by rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.parallel.context_parallel.attention import (
    HybridAttention,
    apply_cp,
    load_balanced_indices,
    shard_batch_for_cp,
)
from lightning_flagscale.parallel.context_parallel.kernels import (
    TorchBlockKernel,
    get_attention_kernel,
    merge_attention,
)

TOL = 1e-5


def _reference(q, k, v, causal, seg):
    """Plain fp32 attention with explicitly expanded GQA heads: the oracle."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    mask = mask.expand(q.shape[0], n, n)
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _inputs(b, s, hq, hkv, d, packed, seed=1234):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, s, hq, d, generator=g)
    seg = None
    if packed:  # documents of uneven lengths, different per row; boundaries fall inside CP chunks
        bounds = torch.sort(torch.randint(1, s, (b, 3), generator=g), dim=1).values
        seg = (torch.arange(s)[None, :, None] >= bounds[:, None, :]).sum(-1)
    return q, k, v, dout, seg


def _holder(config: TransformerConfig | None = None) -> nn.Module:
    """The smallest model apply_cp accepts: attention modules with a ``core_attention`` child."""
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Module() for i in range(2)})
    for block in model.layers.values():
        block.self_attn = nn.Module()
        block.self_attn.core_attention = nn.Identity()
    if config is not None:
        model.config = config
    return model


def _case(cp_mesh, mode, ulysses, causal, b, s, hq, hkv, d, packed):
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    q, k, v, dout, seg = _inputs(b, s, hq, hkv, d, packed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, causal, seg)
    ref.backward(dout)
    model = apply_cp(_holder(), cp_mesh, mode=mode, ulysses_size=ulysses)
    attn = model.layers["0"].self_attn.core_attention
    assert isinstance(attn, HybridAttention)
    idx = load_balanced_indices(s, world, rank)
    local = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out = attn(*local, causal=causal, segment_ids=None if seg is None else seg[:, idx])
    out.backward(dout[:, idx])
    errs = [_rel(out.detach(), ref.detach()[:, idx])]
    errs += [_rel(lo.grad, fu.grad[:, idx]) for lo, fu in zip(local, full)]
    return errs


def run_cases(cases):
    """Task: every rank runs each case and returns [max of (out, dq, dk, dv) relative errors per case]."""
    # The CP mesh is a sub-mesh of a larger one, as the strategy will pass it (hybrid splits it with _unflatten).
    world = init_device_mesh("cpu", (1, dist.get_world_size(), 1), mesh_dim_names=("dp", "cp", "tp"))
    return [max(_case(world["cp"], *case)) for case in cases]


# (mode, ulysses_size, causal, B, S, Hq, Hkv, D, packed)
_CASES_2 = [
    ("ring", None, True, 2, 16, 2, 2, 8, False),
    ("ring", None, False, 1, 8, 2, 2, 4, False),
    ("ring", None, True, 1, 16, 4, 1, 8, False),  # GQA 4:1, K/V rotate with one head
    ("ring", None, True, 2, 24, 4, 2, 4, True),  # packed documents
    ("ulysses", None, True, 2, 16, 4, 2, 8, False),
    ("ulysses", None, False, 1, 8, 2, 2, 4, False),
    ("ulysses", None, True, 1, 16, 4, 1, 4, True),  # KV heads (1) < degree (2): replicated
]
_CASES_4 = [
    ("ring", None, True, 1, 32, 2, 1, 8, False),
    ("ring", None, False, 1, 16, 2, 2, 4, False),
    ("ring", None, True, 2, 32, 4, 2, 4, True),
    ("ulysses", None, True, 1, 16, 4, 2, 8, False),  # KV heads (2) < degree (4): replicated
    ("ulysses", None, True, 2, 16, 4, 4, 4, True),
    ("hybrid", 2, True, 1, 32, 4, 2, 8, False),
    ("hybrid", 2, False, 1, 16, 2, 2, 4, False),
    ("hybrid", 2, True, 2, 32, 4, 1, 4, True),  # GQA with KV replication inside Ulysses, packed
]


@pytest.mark.parametrize(("world", "cases"), [(2, _CASES_2), (4, _CASES_4)], ids=["cp2", "cp4"])
def test_cp_matches_full_attention(launcher, world, cases):
    for rank, errs in enumerate(launcher(world, run_cases, cases)):
        for case, err in zip(cases, errs):
            assert err <= TOL, f"rank {rank} case {case}: relative error {err:.2e}"


def test_cp_detects_wrong_result(launcher):
    """The oracle can fail: a ring that skips the last step (K/V of one rank never seen) is caught."""
    errs = launcher(2, run_broken_ring)
    assert all(e > 1e-2 for e in errs)


def run_broken_ring():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    rank = mesh.get_local_rank()
    q, k, v, _, _ = _inputs(1, 8, 2, 2, 4, False)
    idx = load_balanced_indices(8, 2, rank)
    ref = _reference(q, k, v, False, None)[:, idx]
    out = HybridAttention(None, None)(q[:, idx], k[:, idx], v[:, idx], causal=False)  # no ring: local keys only
    return _rel(out, ref)


def run_head_errors():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    messages = []
    config = TransformerConfig(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
    try:
        apply_cp(_holder(config), mesh, mode="ulysses")
    except ValueError as err:
        messages.append(str(err))
    attn = apply_cp(_holder(), mesh, mode="ulysses").layers["0"].self_attn.core_attention
    q = torch.randn(1, 4, 3, 4)
    try:
        attn(q, q, q)
    except ValueError as err:
        messages.append(str(err))
    return messages


def test_ulysses_degree_must_divide_heads(launcher):
    for messages in launcher(2, run_head_errors):
        assert len(messages) == 2
        assert all("does not divide the local query head count 3" in m for m in messages)


# ---------------------------------------------------------------------------------------------------------------------
# Single process: layout, batch sharding, kernel, errors
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_batch_round_trip(cp):
    b, s = 2, 8 * cp
    batch = {
        "input_ids": torch.randint(0, 100, (b, s)),
        "labels": torch.randint(0, 100, (b, s)),
        "segment_ids": torch.arange(s).div(5, rounding_mode="floor").expand(b, -1),
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "pixel_values": torch.randn(b, 3),
    }
    shards = [shard_batch_for_cp(batch, (r, cp)) for r in range(cp)]
    order = torch.cat([load_balanced_indices(s, cp, r) for r in range(cp)])
    assert torch.equal(order.sort().values, torch.arange(s))  # a permutation: every token on exactly one rank
    inverse = torch.argsort(order)
    for key in ("input_ids", "labels", "segment_ids", "attention_mask"):
        joined = torch.cat([sh[key] for sh in shards], dim=1)
        assert torch.equal(joined[:, inverse], batch[key]), key
    joined_pos = torch.cat([sh["position_ids"] for sh in shards], dim=1)[:, inverse]
    assert torch.equal(joined_pos, torch.arange(s).expand(b, -1))  # created, GLOBAL positions
    assert shards[0]["pixel_values"] is batch["pixel_values"]
    c = s // (2 * cp)  # rank 0 holds the first and the last chunk
    assert torch.equal(shards[0]["input_ids"], torch.cat([batch["input_ids"][:, :c], batch["input_ids"][:, -c:]], 1))


def test_shard_batch_keeps_given_positions():
    ids = torch.arange(8)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # reset per document
    shard = shard_batch_for_cp({"input_ids": ids, "position_ids": pos}, (1, 2))
    assert torch.equal(shard["position_ids"], torch.tensor([[2, 0, 1, 2]]))  # tokens 2..5, positions as given


def test_seq_len_not_divisible():
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel_size = 4"):
        shard_batch_for_cp({"input_ids": torch.zeros(1, 10, dtype=torch.long)}, (0, 2))
    with pytest.raises(ValueError, match="not divisible"):
        load_balanced_indices(12, 4, 0)


def test_backend_without_lse_is_rejected():
    with pytest.raises(ValueError, match="log-sum-exp"):
        get_attention_kernel("sdpa")
    with pytest.raises(ValueError, match="Unknown attention backend"):
        get_attention_kernel("cudnn-magic")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="flash-attn"):
            get_attention_kernel("flash_attn")


def test_torch_kernel_blocks_merge_to_full_attention():
    """Two key blocks with arbitrary positions + segments, merged by LSE, equal full attention; grads too."""
    q, k, v, dout, seg = _inputs(2, 12, 4, 2, 8, packed=True, seed=7)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, True, seg)
    ref.backward(dout)
    kern, pos, scale = TorchBlockKernel(q_block=5), torch.arange(12), 8**-0.5  # 3 query tiles
    perm = torch.randperm(12)  # key blocks need not be contiguous: the mask comes from positions
    blocks = [perm[:5], perm[5:]]
    out = torch.zeros(2, 12, 4, 8)
    lse = torch.full((2, 4, 12), float("-inf"))
    for kb in blocks:
        o, l_ = kern.forward(
            q, k[:, kb], v[:, kb], scale=scale, causal=True, q_pos=pos, k_pos=pos[kb], q_seg=seg, k_seg=seg[:, kb]
        )
        out, lse = merge_attention(out, lse, o, l_)
    assert _rel(out, ref.detach()) <= TOL
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for kb in blocks:
        bq, bk, bv = kern.backward(
            dout,
            q,
            k[:, kb],
            v[:, kb],
            out,
            lse,
            scale=scale,
            causal=True,
            q_pos=pos,
            k_pos=pos[kb],
            q_seg=seg,
            k_seg=seg[:, kb],
        )
        dq += bq
        dk[:, kb] += bk
        dv[:, kb] += bv
    for got, t in zip((dq, dk, dv), full):
        assert _rel(got, t.grad) <= TOL


def test_apply_cp_requires_core_attention():
    with pytest.raises(ValueError, match="no module with a 'core_attention' child"):
        apply_cp(nn.Linear(2, 2), None)  # the model check comes before any use of the mesh


# ---------------------------------------------------------------------------------------------------------------------
# The integration surface on the real decoder: apply_cp + shard_batch_for_cp, loss/grad reduction over CP
# ---------------------------------------------------------------------------------------------------------------------


def run_model_parity(mode, ulysses, packed):
    """CausalLM with CP vs the same weights on one process: token-weighted loss and grads summed over CP."""
    import copy

    from lightning_flagscale.models.decoder import CausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    config = TransformerConfig.from_preset("llama-tiny", num_layers=2)
    ref = CausalLM(config)
    ref.init_weights(seed=0)
    model = apply_cp(copy.deepcopy(ref), mesh, mode=mode, ulysses_size=ulysses)
    g = torch.Generator().manual_seed(3)
    b, s = 2, 32
    batch = {"input_ids": torch.randint(0, config.vocab_size, (b, s), generator=g)}
    labels = torch.randint(0, config.vocab_size, (b, s), generator=g)
    labels[:, ::7] = -100  # ignored tokens fall unevenly on the CP ranks
    batch["labels"] = labels
    if packed:  # documents with positions restarting at 0 (RoPE) and causal masks from the CP layout
        seg = (torch.arange(s)[None] >= torch.tensor([[5], [19]])).long()
        batch["segment_ids"] = seg
        starts = torch.where(seg.bool(), torch.tensor([[5], [19]]), 0)
        batch["position_ids"] = torch.arange(s)[None] - starts
    ref_loss = ref.loss_fn(ref(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids")), labels)
    ref_loss.backward()

    local = shard_batch_for_cp(batch, mesh)
    head = model(local["input_ids"], local["position_ids"], local.get("segment_ids"))
    count = (local["labels"] != -100).sum()
    total = count.clone()
    dist.all_reduce(total)
    loss = model.loss_fn(head, local["labels"]) * count / total  # this rank's share of the global token mean
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    errs = [_rel(loss, ref_loss.detach())]
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        dist.all_reduce(p.grad)  # what the strategy's DP x CP gradient reduction does (sum over CP)
        errs.append(_rel(p.grad, p_ref.grad))
    return max(errs)


@pytest.mark.parametrize(
    ("world", "mode", "ulysses", "packed"),
    [(2, "ring", None, True), (4, "hybrid", 2, False)],
    ids=["ring-cp2-packed", "hybrid-2x2"],
)
def test_decoder_with_cp_matches_single_process(launcher, world, mode, ulysses, packed):
    for err in launcher(world, run_model_parity, mode, ulysses, packed):
        assert err <= TOL


# ---------------------------------------------------------------------------------------------------------------------
# GPU kernels against the torch kernel (skipped without CUDA and the package)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "transformer_engine"])
@pytest.mark.parametrize(("causal", "packed"), [(True, False), (False, False), (True, True)])
def test_gpu_kernel_matches_torch_kernel(backend, causal, packed):
    pytest.importorskip(backend)
    kern, ref_kern = get_attention_kernel(backend), TorchBlockKernel()
    q, k, v, dout, seg = _inputs(2, 64, 4, 2, 64, packed, seed=5)
    q, k, v, dout = (t.cuda().bfloat16() for t in (q, k, v, dout))
    seg = None if seg is None else seg.cuda()
    pos = torch.arange(64)
    kw = dict(scale=0.125, causal=causal, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg)
    out, lse = kern.forward(q, k, v, **kw)
    ref_out, ref_lse = ref_kern.forward(q, k, v, **kw)
    assert _rel(out.float(), ref_out) <= 2e-2  # bf16 inputs: the kernels round differently
    assert _rel(lse, ref_lse) <= 1e-2
    grads = kern.backward(dout, q, k, v, ref_out.bfloat16(), ref_lse, **kw)
    ref_grads = ref_kern.backward(dout, q, k, v, ref_out.bfloat16(), ref_lse, **kw)
    for got, want in zip(grads, ref_grads):
        assert _rel(got.float(), want) <= 3e-2

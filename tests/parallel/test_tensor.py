"""Tensor (+ sequence) parallelism against the single-process model: loss, logits and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.parallel.tensor_parallel.apply import (
    apply_tp,
    check_tp_divisible,
    vocab_parallel_cross_entropy,
)

_CONFIGS = {
    # Qwen2-like: QKV bias, tied embeddings, a vocab (101) that TP=2 must pad.
    "tied_bias_oddvocab": dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                               tie_word_embeddings=True),
    # Qwen3/Llama-like: untied head, QK-norm, llama3 RoPE.
    "untied_qknorm": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, qk_norm=True,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _tp_vs_single(config_name: str, sequence_parallel: bool) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    cfg = TransformerConfig(**_CONFIGS[config_name])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    labels = torch.randint(0, cfg.vocab_size, (2, 8))
    labels[1, :3] = -100
    labels[0, -1] = cfg.vocab_size - 1  # a target in the last (partly padded) shard
    segment_ids = torch.tensor([[0] * 5 + [1] * 3, [0] * 8])
    position_ids = torch.tensor([list(range(5)) + list(range(3)), list(range(8))])

    ref = CausalLM(cfg)
    ref.init_weights(seed=7)
    ref_out = ref(ids, position_ids, segment_ids)
    ref_loss = ref.loss_fn(ref_out, labels)
    ref_loss.backward()

    # The strategy's flow: meta construction, parallelise, materialise, init.
    with torch.device("meta"):
        model = CausalLM(cfg, vocab_multiple=2)
    apply_tp(model, mesh, sequence_parallel=sequence_parallel)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    out = model(ids, position_ids, segment_ids)
    assert out.shape[-1] == model.padded_vocab_size // 2  # local vocab shard
    loss = model.loss_fn(out, labels)
    loss.backward()

    errors = {"loss": _rel(loss.detach(), ref_loss.detach())}
    errors["logits"] = _rel(model.logits(out).detach(), ref.logits(ref_out).detach())
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        full, grad = param.full_tensor(), param.grad.full_tensor()
        rows = ref_params[name].shape[0]  # drop the vocab padding rows (their values and grads must be zero)
        assert torch.count_nonzero(full[rows:]) == 0 and torch.count_nonzero(grad[rows:]) == 0, name
        errors[f"value:{name}"] = _rel(full[:rows], ref_params[name].detach())
        errors[f"grad:{name}"] = _rel(grad[:rows], ref_params[name].grad)

    # The eager flow: an initialised model parallelised afterwards keeps its values (and its tied head).
    eager = CausalLM(cfg, vocab_multiple=2)
    eager.init_weights(seed=7)
    apply_tp(eager, mesh, sequence_parallel=sequence_parallel)
    if cfg.tie_word_embeddings:
        assert eager.lm_head.weight is eager.embed_tokens.weight
    with torch.no_grad():
        errors["eager_loss"] = _rel(eager.loss_fn(eager(ids, position_ids, segment_ids), labels), ref_loss.detach())

    # Pipeline stages under TP(+SP): the last stage gets this rank's (sequence-sharded) hidden states and default
    # positions; a tied head alone on the last stage starts equal to the embedding.
    with torch.device("meta"):
        full = CausalLM(cfg, vocab_multiple=2)
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    first.norm = first.lm_head = None
    del first.layers["1"]
    last.embed_tokens = None
    del last.layers["0"]
    for stage in (first, last):
        apply_tp(stage, mesh, sequence_parallel=sequence_parallel)
        stage.to_empty(device="cpu")
        stage.init_weights(seed=7)
    with torch.no_grad():
        staged = last.loss_fn(last(first(ids, None, segment_ids), None, segment_ids), labels)
        errors["staged_loss"] = _rel(staged, ref.loss_fn(ref(ids, None, segment_ids), labels))
    return errors


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("config_name", list(_CONFIGS))
def test_tp_matches_single_process(launcher, config_name, sequence_parallel):
    results = launcher(2, _tp_vs_single, config_name, sequence_parallel)
    for rank, errors in enumerate(results):
        assert len(errors) > 10
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def _vocab_parallel_ce(dtype_name: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    logits = (torch.randn(3, 5, 8) * 4).to(getattr(torch, dtype_name))
    labels = torch.randint(0, 7, (3, 5))
    labels[0, 0] = -100
    labels[1, 2] = 6  # last real column (column 7 is padding)
    local = logits[..., rank * 4 : (rank + 1) * 4].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, mesh.get_group(), rank * 4, 7)
    weights = torch.rand(3, 5)
    (loss * weights).sum().backward()

    full = logits.float().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(full[..., :7].flatten(0, 1), labels.flatten(), reduction="none")
    (expected.view(3, 5) * weights).sum().backward()
    assert local.grad.dtype == local.dtype
    grad_ref = full.grad[..., rank * 4 : (rank + 1) * 4]
    return [_rel(loss, expected.view(3, 5)), _rel(local.grad.float(), grad_ref)]


def test_vocab_parallel_cross_entropy(launcher):
    for errs in launcher(2, _vocab_parallel_ce, "float32"):
        assert max(errs) <= 1e-6, errs


def test_indivisible_sizes_raise():
    cfg = TransformerConfig(**_CONFIGS["tied_bias_oddvocab"])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        check_tp_divisible(CausalLM(cfg), 3)
    with pytest.raises(ValueError, match=r"padded vocab size=101 .*vocab_multiple"):
        check_tp_divisible(CausalLM(cfg), 2)
    check_tp_divisible(CausalLM(cfg, vocab_multiple=2), 2)


def _tp_collective_counts(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.accounting.comm import CommTracker

    cfg = TransformerConfig(**dict(_CONFIGS["untied_qknorm"], qk_norm=False, num_layers=3))
    model = CausalLM(cfg)
    model.init_weights(seed=7)
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=sequence_parallel)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    counts = {}
    with CommTracker() as fwd:
        loss = model.loss_fn(model(ids), ids)
    with CommTracker() as bwd:
        loss.backward()
    for name, tracker in (("forward", fwd), ("backward", bwd)):
        ops = next(iter(tracker.summary().values()))["ops"]
        counts[name] = {op: stats["calls"] for op, stats in ops.items()}
    if sequence_parallel:
        counts["norm sums"] = _norm_grad_sums(micro_batches=2)
    return counts


def _norm_grad_sums(micro_batches: int) -> dict:
    """TP 2 + SP with QK-norm, ``micro_batches`` per step, gradients reduced by DDP (``DistributedOptimizer`` over
    ``reduction_groups``, as the strategy builds it), two ways: the plan applied on its own (the norms' replicated
    DTensor weights summed over TP in every backward) and as the strategy applies it (``partial_grads_at_step``:
    plain weights, tagged by ``tag_tp_partial_params``, summed over TP inside the step's bucket reduction). All
    collectives of the step counted; gradients against one process on the whole sequences."""
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.accounting.comm import CommTracker
    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer, reduction_groups
    from lightning_flagscale.parallel.mesh import build_meshes
    from lightning_flagscale.parallel.tensor_parallel.partial_grads import tag_tp_partial_params

    parallel = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True).resolve(2)
    meshes = build_meshes(parallel, "cpu")
    cfg = TransformerConfig(**_CONFIGS["untied_qknorm"])
    ids = torch.randint(0, cfg.vocab_size, (micro_batches, 2, 8), generator=torch.Generator().manual_seed(1))
    ref = CausalLM(cfg, vocab_multiple=2)
    ref.init_weights(seed=7)
    for x in ids:  # one process, gradients accumulated over the micro-batches
        ref.loss_fn(ref(x), x).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for path in ("at use", "at step"):
        model = CausalLM(cfg, vocab_multiple=2)
        model.init_weights(seed=7)
        apply_tp(model, meshes["tp"], sequence_parallel=True, partial_grads_at_step=path == "at step")
        tagged = tag_tp_partial_params(model)
        groups, divisors = reduction_groups(meshes, parallel)
        dopt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, groups, stage=0, master_weights=False,
            divisors=divisors,
        )  # fmt: skip
        with CommTracker() as comm:
            for i, x in enumerate(ids):
                dopt.require_sync = i == micro_batches - 1  # the strategy's no_grad_sync inside the window
                model.loss_fn(model(x), x).backward()
            dopt.reduce_grads()
        errs = {}
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            errs[name] = _rel(grad, ref_grads[name])
        out[path] = {
            "errs": errs, "tagged": len(tagged), "buckets": len(dopt.buckets),
            "all_reduces": comm.stats("all_reduce").calls,
            "plain": sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor)),
        }  # fmt: skip
        dopt.close()
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tp_reduces_each_module_input_gradient_once(launcher, sequence_parallel):
    """Megatron's TP collectives and no more: per block 2 in forward (attention and MLP output) and 2 in backward
    (their input gradients: q/k/v, gate/up share one replicated input, summed before one reduction); the
    embedding, the head's input and the vocab-parallel loss (max, then target logit and sum-exp in one) add the
    rest. Each column-parallel layer reducing its own input gradient made it 5 per block in backward."""
    layers = 3
    counts = launcher(2, _tp_collective_counts, sequence_parallel)[0]
    fwd, bwd = counts["forward"], counts["backward"]
    if not sequence_parallel:
        # embedding + 2 per block, loss 2; backward: 2 per block + the head's input (replicated final norm output)
        assert fwd == {"all_reduce": 1 + 2 * layers + 2}, fwd
        assert bwd == {"all_reduce": 2 * layers + 1}, bwd
    else:
        # all-gather in / reduce-scatter out per module, the head's input gathered; backward mirrors them
        assert fwd.get("all_gather", 0) == 2 * layers + 1 and fwd.get("reduce_scatter", 0) == 1 + 2 * layers, fwd
        assert bwd.get("reduce_scatter", 0) == 2 * layers + 1 and bwd.get("all_gather", 0) == 2 * layers + 1, bwd
        # Same launch, 2 micro-batches per step, QK-norm on: each block's 2 norms (on sequence shards) and q/k-norm
        # (on head shards) and the final norm see only this rank's part. Summed at use: one TP all-reduce per weight
        # per micro-batch besides one per DDP bucket; as the strategy applies the plan, only the bucket reductions
        # (their weights plain, reduced over dp x cp x tp). Both equal one process. The loss adds 2 per micro-batch.
        norm_weights, loss = 4 * 2 + 1, 2 * 2
        sums = counts["norm sums"]
        at_use, at_step = sums["at use"], sums["at step"]
        assert at_use["all_reduces"] == at_use["buckets"] + 2 * norm_weights + loss and not at_use["plain"], at_use
        assert at_step["all_reduces"] == at_step["buckets"] + loss and at_step["tagged"] == norm_weights, at_step
        assert all(n.endswith("norm.weight") for n in at_step["plain"]) and len(at_step["plain"]) == norm_weights
        for res in (at_use, at_step):
            bad = {k: v for k, v in res["errs"].items() if not v <= 1e-6}
            assert not bad, bad

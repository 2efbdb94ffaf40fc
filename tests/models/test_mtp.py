"""DeepSeek-V3 multi-token prediction (issue 39 item 2), one process: the MTP loss and every gradient equal a
hand-written reference, the returned (main) loss is unchanged, targets are the labels shifted per depth (ragged
and packed), and the layout follows DeepSeek-V3 (section 2.2 of its report).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.decoder import mtp_labels
from lightning_flagscale.models.lightning import set_mtp_loss_weight

SHAPE = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10, moe_router_num_groups=2,
    moe_router_group_topk=1, moe_router_bias_update_rate=0.0, vocab_size=61,
)  # fmt: skip


def config(depth: int, **overrides) -> TransformerConfig:
    return TransformerConfig.from_preset(
        "deepseek-v3-tiny", **{**SHAPE, "num_nextn_predict_layers": depth, "mtp_loss_weight": 0.3, **overrides}
    )


def batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (3, 14), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :4] = -100  # ragged
    labels[1, 7] = -100
    labels[2, -1] = -100
    return ids, labels


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def reference_loss(
    model: CausalLM, ids: torch.Tensor, labels: torch.Tensor, segment_ids=None, num_items=None, weight=None
):
    """Main + lambda / D * sum_k CE_k written out with the model's weights (blocks reused as black boxes); lambda is
    ``weight``, by default the config's ``mtp_loss_weight``."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    emb_w = model.embed_tokens.weight
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    cos, sin = model.rotary_emb(pos, torch.float32)
    h = F.embedding(ids, emb_w)
    for layer in model.layers.values():
        h = layer(h, cos, sin, segment_ids)
    denom = (labels != -100).sum() if num_items is None else num_items

    def ce(hidden, norm_w, targets):
        logits = (_rms(hidden, norm_w, eps) @ model.lm_head.weight.T)[..., : cfg.vocab_size]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / denom

    main = ce(h, model.norm.weight, labels)
    mtp = 0.0
    depth = cfg.num_nextn_predict_layers
    for k in range(1, depth + 1):
        layer = model.mtp.layers[str(k - 1)]
        shifted = torch.zeros_like(ids)
        shifted[:, :-k] = ids[:, k:]
        targets = torch.full_like(labels, -100)
        targets[:, :-k] = labels[:, k:]
        if segment_ids is not None:
            targets[:, :-k][segment_ids[:, k:] != segment_ids[:, :-k]] = -100
        e = _rms(F.embedding(shifted, emb_w), layer.enorm.weight, eps)
        x = torch.cat([e, _rms(h, layer.hnorm.weight, eps)], -1) @ layer.eh_proj.weight.T
        x = x + layer.self_attn(_rms(x, layer.input_layernorm.weight, eps), cos, sin, segment_ids)
        h = x + layer.mlp(_rms(x, layer.post_attention_layernorm.weight, eps))
        mtp = mtp + ce(h, layer.norm.weight, targets)
    return main, mtp * (cfg.mtp_loss_weight if weight is None else weight) / depth


def _grads(model: CausalLM) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_mtp_loss_and_gradients_match_reference(depth, packed):
    torch.manual_seed(0)
    model = CausalLM(config(depth), vocab_multiple=8)
    model.init_weights(3)
    ids, labels = batch(61)
    seg = torch.tensor([[0] * 6 + [1] * 7] * 3) if packed else None
    out = model(ids, segment_ids=seg)
    loss = model.loss_fn(out, labels, num_items_in_batch=50)
    logged = model.pop_mtp_loss()
    loss.backward()
    ours = _grads(model)

    main, mtp = reference_loss(model, ids, labels, seg, num_items=50)
    assert loss.item() == pytest.approx(main.item(), rel=1e-6, abs=0)  # the reported loss is the main loss only
    (main + mtp).backward()
    ref = _grads(model)
    assert ours.keys() == ref.keys()
    assert any(k.startswith("mtp.layers.") for k in ours) and "embed_tokens.weight" in ours
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    # The logged value: the token mean of each module's cross-entropy, averaged over modules, without the weight.
    count = sum((mtp_labels(labels, k, seg) != -100).sum() for k in range(1, depth + 1))
    assert logged is not None and logged.item() > 0 and count > 0
    assert model.pop_mtp_loss() is None


def test_mtp_loss_weight_schedule_switches_at_its_steps_and_the_gradients_follow():
    # DeepSeek-V3's 0.3 -> 0.1 switch (and a later 0): CausalLMModule.training_step sets the weight of
    # trainer.global_step with set_mtp_loss_weight; each step's gradients are the reference's with that weight.
    cfg = config(2, mtp_loss_weight_schedule=[[2, 0.1], [4, 0.0]])  # YAML gives lists
    assert cfg.mtp_loss_weight_schedule == [[2, 0.1], [4, 0.0]]
    assert [cfg.mtp_loss_weight_at(step) for step in range(6)] == [0.3, 0.3, 0.1, 0.1, 0.0, 0.0]
    model = CausalLM(cfg, vocab_multiple=8)
    model.init_weights(3)
    ids, labels = batch(61, seed=1)
    for step, want in enumerate([0.3, 0.3, 0.1, 0.1, 0.0]):
        set_mtp_loss_weight(model, cfg.mtp_loss_weight_at(step))
        model.loss_fn(model(ids), labels).backward()
        model.pop_mtp_loss()
        ours = _grads(model)
        main, mtp = reference_loss(model, ids, labels, weight=want)
        (main + mtp).backward()
        ref = _grads(model)
        assert ours.keys() == ref.keys(), step
        for name in ref:
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")
        # the MTP head's norm learns from the MTP loss alone: no gradient at weight 0 (the MoE balance losses
        # still reach the MTP blocks' other weights)
        assert (ours["mtp.layers.0.norm.weight"].abs().max() == 0) == (want == 0), step


def test_set_mtp_loss_weight_reaches_every_stage_module():
    stages = [CausalLM(config(1), vocab_multiple=8) for _ in range(2)]
    holder = torch.nn.Module()
    holder.stage_modules = stages  # a PipelinedModel holds its stage modules outside its module tree
    set_mtp_loss_weight(holder, 0.05)
    assert [stage.mtp_loss_weight for stage in stages] == [0.05, 0.05]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([[0, 0.1]], "step 0 .* must be >= 1: the weight of step 0 is mtp_loss_weight=0.3"),
        ([[5, 0.1], [5, 0.2]], "steps must increase: 5 .* follows 5"),
        ([[5, 0.1], [3, 0.2]], "steps must increase: 3 .* follows 5"),
        ([[5, -0.1]], "weight -0.1 .* must be a finite number >= 0"),
        ([[5, float("nan")]], "weight nan .* must be a finite number >= 0"),
        ([[2.5, 0.1]], "step 2.5 .* is not an integer"),
        ([[5, 0.1, 3]], r"entry \[5, 0.1, 3\] is not a \(step, weight\) pair"),
        ([5, 0.1], r"entry 5 is not a \(step, weight\) pair"),
        ("5:0.1", "is not a list of \\(step, weight\\) pairs"),
    ],
)
def test_mtp_loss_weight_schedule_refuses_malformed_schedules(schedule, message):
    with pytest.raises(ValueError, match=message):
        config(1, mtp_loss_weight_schedule=schedule)


def test_mtp_loss_weight_schedule_needs_mtp_modules():
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=0 .*set num_nextn_predict_layers >= 1"):
        config(0, mtp_loss_weight_schedule=[[5, 0.1]])


def test_main_loss_unchanged_by_mtp():
    plain, with_mtp = CausalLM(config(0), vocab_multiple=8), CausalLM(config(2), vocab_multiple=8)
    plain.init_weights(1)
    with_mtp.init_weights(1)  # per-FQN seeds: the shared parameters start equal
    for name, p in plain.state_dict().items():
        assert torch.equal(p, with_mtp.state_dict()[name]), name
    ids, labels = batch(61, seed=2)
    a = plain.loss_fn(plain(ids), labels)
    b = with_mtp.loss_fn(with_mtp(ids), labels)
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    assert not torch.equal(plain.embed_tokens.weight.grad, with_mtp.embed_tokens.weight.grad)  # MTP trains it


def test_mtp_labels_shift_and_mask():
    labels = torch.tensor([[1, 2, 3, -100, 5, 6]])
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert mtp_labels(labels, 1).tolist() == [[2, 3, -100, 5, 6, -100]]
    assert mtp_labels(labels, 2, seg).tolist() == [[3, -100, -100, 6, -100, -100]]
    assert mtp_labels(labels, 9).tolist() == [[-100] * 6]


def test_mtp_layout_and_sharing():
    model = CausalLM(config(2), vocab_multiple=8)
    assert model.mtp.embed_tokens.weight is model.embed_tokens.weight
    assert model.pipeline_units()[-1] == "mtp"
    assert (
        sum(p.numel() for p in model.parameters()) == model.config.num_params() + 2 * 3 * 32
    )  # 64 - 61 padded rows, embedding and head
    layer = model.mtp.layers["1"]
    assert layer.layer_idx == model.config.num_layers + 1 and layer.is_moe
    assert tuple(layer.eh_proj.weight.shape) == (32, 64)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        config(-1)


def test_deepseek_checkpoint_naming_round_trip(tmp_path):
    """MTP layers export as DeepSeek-V3's ``model.layers.{num_hidden_layers + k}.*`` (with the embedding and head
    copies) and import back bit-identical; a re-export writes the same tensors; the MTP logits survive."""
    from safetensors import safe_open

    from lightning_flagscale.convert import causal_lm_from_hf, export_hf

    model = CausalLM(config(2), vocab_multiple=8)
    model.init_weights(5)

    def tensors(folder):
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
        return out

    first = tensors(export_hf(model, tmp_path / "a", max_shard_size="40KB"))
    n = model.config.num_layers
    for k in range(2):
        p = f"model.layers.{n + k}."
        for key in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "input_layernorm", "self_attn.kv_b_proj"):
            assert p + key + ".weight" in first, p + key
        assert torch.equal(first[p + "embed_tokens.weight"], first["model.embed_tokens.weight"])
        assert torch.equal(first[p + "shared_head.head.weight"], first["lm_head.weight"])
        assert first[p + "embed_tokens.weight"].shape[0] == 61  # vocab padding dropped
    assert f"model.layers.{n + 2}.enorm.weight" not in first
    back = causal_lm_from_hf(tmp_path / "a", vocab_multiple=8)
    assert back.config.num_nextn_predict_layers == 2
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    second = tensors(export_hf(back, tmp_path / "b", max_shard_size="40KB"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    ids, _ = batch(61)
    with torch.no_grad():
        model(ids), back(ids)
        for a, b in zip(model.mtp_logits(), back.mtp_logits()):
            assert a.shape == (3, 13, 61) and torch.equal(a, b)


def test_transformers_checkpoint_without_mtp_layers_imports_without_mtp(tmp_path):
    """transformers writes num_nextn_predict_layers but no MTP layer: such a checkpoint has no MTP modules."""
    from lightning_flagscale.convert import causal_lm_from_hf, export_hf

    model = CausalLM(config(0), vocab_multiple=8)
    model.init_weights(2)
    out = export_hf(model, tmp_path / "a")
    cfg = (out / "config.json").read_text().replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    (out / "config.json").write_text(cfg)
    assert causal_lm_from_hf(out, vocab_multiple=8).config.num_nextn_predict_layers == 0


def test_mtp_loss_weight_schedule_in_tokens_parses_and_refuses_with_its_unit():
    # DeepSeek-V3's switch as written in YAML (1.0e13 reads as a float): kept as an int count of tokens
    cfg = config(1, mtp_loss_weight_schedule=[[1.0e13, 0.1]], mtp_loss_weight_schedule_unit="tokens")
    assert cfg.mtp_loss_weight_schedule == [[10_000_000_000_000, 0.1]]
    assert isinstance(cfg.mtp_loss_weight_schedule[0][0], int)
    assert [cfg.mtp_loss_weight_at(n) for n in (0, 10**13 - 1, 10**13)] == [0.3, 0.3, 0.1]
    with pytest.raises(ValueError, match=r"tokens must increase: 100 .* follows 200.* \[token, weight\] pairs"):
        config(1, mtp_loss_weight_schedule=[[200, 0.1], [100, 0.0]], mtp_loss_weight_schedule_unit="tokens")
    with pytest.raises(ValueError, match=r"token 2.5 .* is not an integer"):
        config(1, mtp_loss_weight_schedule=[[2.5, 0.1]], mtp_loss_weight_schedule_unit="tokens")
    with pytest.raises(ValueError, match=r"step 10000000000000.0 .* is not an integer"):  # steps stay integers
        config(1, mtp_loss_weight_schedule=[[1.0e13, 0.1]])
    with pytest.raises(ValueError, match="mtp_loss_weight_schedule_unit='samples' is unknown; use 'steps' or 'tokens'"):
        config(1, mtp_loss_weight_schedule_unit="samples")


def _token_schedule_fit(steps: int, ckpt_dir, ckpt_path=None) -> tuple[list[float], int, str]:
    """One process, Lightning's default strategy: a tiny llama with one MTP module, 2 samples of 16 tokens per batch
    and 2 batches per step (64 tokens a step), MTP weight 0.3 switching to 0.1 at 150 tokens (the start of step 3:
    192 tokens done). Returns each step's weight, ``tokens_trained`` and the checkpoint written at the end."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_flagscale.models import CausalLMModule
    from tests.strategies._lm import TokenDataset, tiny_config

    cfg = tiny_config(
        num_nextn_predict_layers=1, mtp_loss_weight=0.3, mtp_loss_weight_schedule=[[150, 0.1]],
        mtp_loss_weight_schedule_unit="tokens",
    )  # fmt: skip
    weights: list[float] = []

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            weights.append(pl_module.model.mtp_loss_weight)

    torch.manual_seed(0)
    module = CausalLMModule(cfg, optimizer="sgd", learning_rate=0.1, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(
        module,
        DataLoader(TokenDataset(cfg.vocab_size, num_samples=64), batch_size=2),
        ckpt_path=ckpt_path,
        weights_only=False,
    )
    path = str(ckpt_dir / f"step{steps}.ckpt")
    trainer.save_checkpoint(path)
    return weights, module.tokens_trained, path


def test_mtp_loss_weight_switches_at_tokens_and_the_count_resumes_exactly(tmp_path):
    # The count is the global batch's samples x sequence length, accumulation included (64 a step); it travels in
    # the checkpoint, so a run resumed after 2 steps (128 tokens) switches at step 3 as the uninterrupted one does.
    from lightning_flagscale.models.lightning import TOKENS_TRAINED_KEY

    weights, tokens, _ = _token_schedule_fit(5, tmp_path)
    assert weights == [0.3, 0.3, 0.3, 0.1, 0.1] and tokens == 5 * 64
    _, tokens, saved = _token_schedule_fit(2, tmp_path)
    assert tokens == 128 and torch.load(saved, weights_only=False)[TOKENS_TRAINED_KEY] == 128
    weights, tokens, _ = _token_schedule_fit(5, tmp_path, ckpt_path=saved)
    assert weights == [0.3, 0.1, 0.1] and tokens == 5 * 64
    # A checkpoint written before the count existed: the token schedule cannot know where it stands, and says so
    old = torch.load(saved, weights_only=False)
    del old[TOKENS_TRAINED_KEY]
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match=r"without 'tokens_trained'.*mtp_loss_weight_schedule_unit='steps'"):
        _token_schedule_fit(5, tmp_path, ckpt_path=str(tmp_path / "old.ckpt"))

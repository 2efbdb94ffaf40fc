"""The reference decoder against ``transformers`` (logit parity), and its layout-independence invariants."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.attention import check_backend_available, cu_seqlens_from_segments
from lightning_flagscale.models.layers import rope_inv_freq

transformers = pytest.importorskip("transformers")

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_attention_heads=4)

# family -> (our config, HF config class name, HF config kwargs)
_FAMILIES = {
    "llama": (
        dict(_COMMON, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
             rope_scaling={**_LLAMA3, "original_max_position_embeddings": 16}),
        "LlamaConfig",
        dict(rope_parameters={**_LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 16},
             tie_word_embeddings=False),
    ),
    "qwen2": (
        dict(_COMMON, num_key_value_heads=2, rope_theta=1e6, attention_bias=True, tie_word_embeddings=True),
        "Qwen2Config",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True),
    ),
    "qwen3": (
        dict(_COMMON, num_key_value_heads=1, head_dim=24, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True),
        "Qwen3Config",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, head_dim=24, tie_word_embeddings=True,
             attention_bias=False),
    ),
}  # fmt: skip


def _hf_model(family: str, cfg: TransformerConfig):
    _, cls_name, extra = _FAMILIES[family]
    hf_cfg = getattr(transformers, cls_name)(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=64, rms_norm_eps=cfg.rms_norm_eps,
        attn_implementation="eager", **extra,
    )  # fmt: skip
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    return model_cls(hf_cfg).eval()


def _load_from_hf(ours: CausalLM, hf) -> None:
    """Copy HF weights by name (``model.`` prefix dropped); padded vocab rows stay zero."""
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    with torch.no_grad():
        for name, param in ours.named_parameters():
            src = sd[name]
            param.zero_()
            param[: src.shape[0]].copy_(src)
    assert not ours.config.tie_word_embeddings or ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("family", list(_FAMILIES))
@pytest.mark.parametrize("vocab_multiple", [1, 8])
def test_logits_match_transformers(family, vocab_multiple):
    cfg = TransformerConfig(**_FAMILIES[family][0])
    hf = _hf_model(family, cfg)
    with torch.no_grad():  # HF initialises biases and norms to 0/1: randomise them so they are really compared
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    ours = CausalLM(cfg, vocab_multiple=vocab_multiple).eval()
    _load_from_hf(ours, hf)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))  # 40 > original_max_position_embeddings: scaled RoPE matters
    pos = torch.arange(40).unsqueeze(0).repeat(2, 1) + torch.tensor([[0], [7]])  # global positions, as under CP
    with torch.no_grad():
        expected = hf(input_ids=ids, position_ids=pos).logits
        got = ours.logits(ours(ids, position_ids=pos))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {**_LLAMA3, "original_max_position_embeddings": 64}
    hf_cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4,
                                      rope_parameters={**scaling, "rope_theta": 500000.0})  # fmt: skip
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert torch.equal(rope_inv_freq(128, 500000.0, scaling), expected)
    assert not torch.equal(rope_inv_freq(128, 500000.0, None), expected)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_meta_construction_and_init_are_deterministic(preset):
    cfg = TransformerConfig.from_preset(preset, num_layers=2, vocab_size=254)
    eager = CausalLM(cfg, vocab_multiple=4)
    eager.init_weights(seed=3)
    with torch.device("meta"):
        meta = CausalLM(cfg, vocab_multiple=4)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    assert meta.state_dict().keys() == eager.state_dict().keys()
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    if cfg.tie_word_embeddings:
        assert meta.lm_head.weight is meta.embed_tokens.weight
    other = CausalLM(cfg, vocab_multiple=4)
    other.init_weights(seed=4)
    assert not torch.equal(other.layers["0"].self_attn.q_proj.weight, eager.layers["0"].self_attn.q_proj.weight)
    assert eager.padded_vocab_size == 256 and torch.count_nonzero(eager.embed_tokens.weight[cfg.vocab_size :]) == 0


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "deepseek-v3-tiny"])
def test_init_does_not_depend_on_the_default_device(preset):
    """Issue 37: Lightning runs ``configure_model`` and the init under a default-device context (``cuda`` under
    ``Trainer(accelerator="gpu")``), which made ``torch.randn(..., generator=<cpu generator>)`` fail. The meta
    device stands in for that context on CPU: parameters live on CPU, the default device is elsewhere, and the init
    gives the very values it gives without the context."""
    cfg = TransformerConfig.from_preset(preset, num_layers=3, vocab_size=254)
    expected = CausalLM(cfg, vocab_multiple=4)
    expected.init_weights(seed=3)
    model = CausalLM(cfg, vocab_multiple=4)
    with torch.device("meta"):
        model.init_weights(seed=3)
    for (name, a), b in zip(expected.state_dict().items(), model.state_dict().values()):
        assert b.device.type == "cpu" and torch.equal(a, b), name


def test_padded_vocab_never_leaks():
    cfg = TransformerConfig.from_preset("llama-tiny", vocab_size=250, num_layers=2)
    plain, padded = CausalLM(cfg), CausalLM(cfg, vocab_multiple=16)
    assert (plain.padded_vocab_size, padded.padded_vocab_size) == (250, 256)
    plain.init_weights(seed=1)
    padded.init_weights(seed=1)
    assert torch.count_nonzero(padded.embed_tokens.weight[250:]) == 0
    with torch.no_grad():  # padding must not leak even when the padded rows are not zero
        padded.lm_head.weight[250:] = 5.0
    ids = torch.randint(0, 250, (2, 12))
    labels = torch.randint(0, 250, (2, 12))
    labels[0, :3] = -100
    losses = []
    for model in (plain, padded):
        out = model(ids)
        loss = model.loss_fn(out, labels)
        loss.backward()
        losses.append(loss)
        assert model.logits(out).shape == (2, 12, 250)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(plain.logits(plain(ids)), padded.logits(padded(ids)), rtol=0, atol=1e-6)
    torch.testing.assert_close(padded.lm_head.weight.grad[:250], plain.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(padded.lm_head.weight.grad[250:]) == 0


def test_packed_segments_equal_separate_sequences():
    cfg = TransformerConfig.from_preset("qwen3-tiny", num_layers=2)
    model = CausalLM(cfg)
    model.init_weights(seed=0)
    lengths = [5, 8, 3]
    docs = [torch.randint(0, cfg.vocab_size, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    segment_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        got = model(packed, position_ids=position_ids, segment_ids=segment_ids)
        expected = torch.cat([model(d) for d in docs], dim=1)
        unmasked = model(packed, position_ids=position_ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (unmasked - expected).abs().max() > 1e-3  # the mask really matters


def test_cu_seqlens_from_segments():
    seg = torch.tensor([[0, 0, 1, 1, 1], [2, 3, 3, 3, 3]])
    cu, max_len = cu_seqlens_from_segments(seg)
    assert cu.tolist() == [0, 2, 5, 6, 10] and cu.dtype == torch.int32 and max_len == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
@pytest.mark.parametrize("backend", ["flash_attn", "transformer_engine"])
def test_gpu_backend_errors_clearly_on_cpu(backend):
    with pytest.raises(RuntimeError, match=backend):
        check_backend_available(backend)
    cfg = TransformerConfig.from_preset("llama-tiny", num_layers=1, attn_backend=backend)
    model = CausalLM(cfg)
    with pytest.raises(RuntimeError, match="attn_backend"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_pipeline_units_and_partial_forward():
    cfg = TransformerConfig.from_preset("llama-tiny", num_layers=3)
    model = CausalLM(cfg)
    model.init_weights()
    assert model.pipeline_units() == ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    import copy

    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = first.lm_head = None
    del first.layers["2"]
    last.embed_tokens = None
    del last.layers["0"], last.layers["1"]
    assert last.pipeline_units() == ["embed_tokens", "layers.2", "norm", "lm_head"]
    with torch.no_grad():
        torch.testing.assert_close(last(first(ids)), model(ids), rtol=0, atol=1e-6)

"""DeepSeek-V3 (issue 39): multi-head latent attention and the ``deepseek_v3`` converter against ``transformers``'
``DeepseekV3ForCausalLM`` on odd tiny shapes, round trips, and MLA under tensor parallelism gradient by gradient.

Tiny random HF models are built from configs (nothing downloads); every weight and the routers' correction biases
are perturbed so that a mapping mix-up shows.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert import causal_lm_from_hf, config_from_hf, export_hf, family_for
from lightning_flagscale.convert.registry import HFConversionError
from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.layers import RotaryEmbedding

transformers = pytest.importorskip("transformers")

# Odd shapes: 3 heads, q/k heads 6 + 4 wide, values 10, latents 14 (kv) and 18 (q), 6 experts in 3 groups.
HF_BASE: dict[str, Any] = dict(
    vocab_size=50, hidden_size=36, intermediate_size=44, moe_intermediate_size=12, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1, n_routed_experts=6, num_experts_per_tok=2,
    routed_scaling_factor=2.5, kv_lora_rank=14, q_lora_rank=18, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
    n_group=3, topk_group=2, first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},  # cos/sin and softmax scale both change
)  # fmt: skip
CASES = {
    "q_lora-dense1-groups3": {},
    "no_q_lora-dense0": dict(q_lora_rank=None, first_k_dense_replace=0),
    "no_interleave-plain_rope-groups1": dict(rope_interleave=False, rope_scaling=None, n_group=1, topk_group=1),
}
IDS = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(0))


def make_hf(**overrides: Any):
    config = transformers.DeepseekV3Config(**{**HF_BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.add_(torch.randn(buf.shape, generator=gen) * 0.05)
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    model = make_hf(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return model, path


def test_import_logits_match_transformers(hf_case):
    hf_model, path = hf_case
    ours = causal_lm_from_hf(path, vocab_multiple=4)  # 50 -> 52 rows
    assert ours.config.is_mla and ours.config.v_head_dim == 10 and ours.config.head_dim == 10
    with torch.no_grad():
        logits = ours.logits(ours(IDS))
    torch.testing.assert_close(logits, hf_logits(hf_model, IDS), rtol=0, atol=1e-5)


def test_export_is_bit_identical_in_transformers(hf_case, tmp_path):
    hf_model, path = hf_case
    ours = causal_lm_from_hf(path, vocab_multiple=4)
    out = export_hf(ours, tmp_path / "export", max_shard_size="24KB")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(want) == sorted(got) and any(k.endswith("e_score_correction_bias") for k in want)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    torch.testing.assert_close(hf_logits(reloaded, IDS), hf_logits(hf_model, IDS), rtol=0, atol=0)


def test_config_round_trip(hf_case):
    _, path = hf_case
    config = config_from_hf(path)
    family = family_for({"model_type": "deepseek_v3"})
    assert family_for(config) is family  # our MLA configs export as deepseek_v3
    assert family.config_from_hf(family.config_to_hf(config), name=config.name, hf_source=config.hf_source) == config


def test_param_count_matches_transformers(hf_case):
    hf_model, path = hf_case
    assert config_from_hf(path).num_params() == sum(p.numel() for p in hf_model.parameters())


def test_native_preset_exports_to_transformers_with_our_logits(tmp_path):
    """Train-from-scratch: ``deepseek-v3-tiny`` (MLA, YaRN, interleaved RoPE, bias balancing) exported and reloaded."""
    model = CausalLM(TransformerConfig.from_preset("deepseek-v3-tiny"), vocab_multiple=3)
    model.init_weights(seed=7)
    with torch.no_grad():  # norms are ones and router biases zero at init: perturb them
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score" in name:
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    out = export_hf(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, ids), model.logits(model(ids)), rtol=0, atol=1e-5)


def test_yarn_tables_match_transformers():
    hf_config = transformers.DeepseekV3Config(**HF_BASE)
    hf_rope = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hf_config)
    ours = RotaryEmbedding(4, 10000.0, config_from_hf_dict(HF_BASE).rope_scaling)
    pos = torch.arange(40)[None]
    cos, sin = ours(pos, torch.float32)
    want_cos, want_sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert not torch.equal(cos, RotaryEmbedding(4, 10000.0)(pos, torch.float32)[0])  # YaRN really changed them


def config_from_hf_dict(hf: dict[str, Any]) -> TransformerConfig:
    return family_for({"model_type": "deepseek_v3"}).config_from_hf({"model_type": "deepseek_v3", **hf})


def test_mla_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        TransformerConfig.from_preset("deepseek-v3-tiny", num_key_value_heads=2)
    with pytest.raises(ValueError, match="must be even"):
        TransformerConfig.from_preset("deepseek-v3-tiny", qk_rope_head_dim=5)
    with pytest.raises(ValueError, match="head_dim=7"):
        TransformerConfig.from_preset("deepseek-v3-tiny", head_dim=7)
    with pytest.raises(HFConversionError, match="latent attention"):
        family_for({"model_type": "llama"}).config_to_hf(TransformerConfig.from_preset("deepseek-v3-tiny"))
    with pytest.raises(HFConversionError, match="num_key_value_heads"):
        config_from_hf_dict({**HF_BASE, "num_key_value_heads": 1})
    routing_only = TransformerConfig.from_preset("deepseek-v3-routing-tiny")
    assert not routing_only.is_mla and routing_only.router_type == "sigmoid"


def test_real_shape_preset_counts_deepseek_v3_parameters():
    # The model card: 671B main-model weights, 37B active per token, plus the MTP module the published checkpoint
    # holds (num_nextn_predict_layers=1: one more MoE block, 11.6B here, as the preset has it).
    config = TransformerConfig.from_preset("deepseek-v3")
    assert (config.num_layers, config.num_nextn_predict_layers) == (61, 1)
    main = TransformerConfig.from_preset("deepseek-v3", num_nextn_predict_layers=0)
    assert 670.5e9 < main.num_params() < 671.5e9
    assert 37e9 < main.num_params(active=True) < 38e9
    assert 682e9 < config.num_params() < 683e9  # + the MTP block, eh_proj and its norms (embedding and head shared)
    assert family_for(config).config_to_hf(config)["num_nextn_predict_layers"] == 1  # as in DeepSeek's config.json


# ---- MLA under tensor (+ sequence) parallelism: every gradient against one process ----
def _mla_tp_vs_single(sequence_parallel: bool, q_lora: bool) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    cfg = TransformerConfig.from_preset(
        "deepseek-v3-tiny", vocab_size=101, hidden_size=32, num_attention_heads=4, num_layers=2, intermediate_size=48,
        moe_intermediate_size=16, q_lora_rank=24 if q_lora else None, kv_lora_rank=16, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, attention_bias=True,
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    labels = torch.randint(0, cfg.vocab_size, (2, 8))
    labels[1, :3] = -100
    segment_ids = torch.tensor([[0] * 5 + [1] * 3, [0] * 8])
    position_ids = torch.tensor([list(range(5)) + list(range(3)), list(range(8))])

    ref = CausalLM(cfg)
    ref.init_weights(seed=7)
    ref_loss = ref.loss_fn(ref(ids, position_ids, segment_ids), labels)
    ref_loss.backward()
    with torch.device("meta"):
        model = CausalLM(cfg, vocab_multiple=2)
    apply_tp(model, mesh, sequence_parallel=sequence_parallel)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    loss = model.loss_fn(model(ids, position_ids, segment_ids), labels)
    loss.backward()
    errors = {"loss": float((loss - ref_loss).abs() / ref_loss.abs())}
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        rows = ref_params[name].shape[0]
        want = ref_params[name].grad
        errors[name] = float((grad[:rows] - want).norm() / want.norm().clamp_min(1e-30))
        assert torch.equal(full[:rows], ref_params[name].detach()), name
    return errors


@pytest.mark.parametrize("sequence_parallel,q_lora", [(False, True), (True, True), (True, False)],
                         ids=["tp2-q_lora", "tp2-sp-q_lora", "tp2-sp-no_q_lora"])  # fmt: skip
def test_mla_gradients_under_tensor_parallel(launcher, sequence_parallel, q_lora):
    errors = launcher(2, _mla_tp_vs_single, sequence_parallel, q_lora)
    for rank_errors in errors:
        assert rank_errors["layers.0.self_attn.kv_a_proj_with_mqa.weight"] <= 1e-5  # the shared rotary key's path
        bad = {k: v for k, v in rank_errors.items() if v > 1e-5}
        assert not bad, bad


def test_flops_per_token_counts_mla_widths():
    from lightning_flagscale.accounting.flops import flops_per_token

    config = TransformerConfig.from_preset("deepseek-v3-tiny")  # q/k heads 24 wide, values 12
    matmul = config.num_params(include_embedding=False, active=True) + config.vocab_size * config.hidden_size
    attention = 3 * config.num_layers * (2 * 2 * 128 * config.num_attention_heads * (24 + 12) // 2)
    assert flops_per_token(config, 128) == 6 * matmul + attention
    llama = TransformerConfig.from_preset("llama-tiny")  # equal widths: the PaLM term 12 L n d s unchanged
    llama_matmul = llama.num_params(include_embedding=False, active=True) + llama.vocab_size * llama.hidden_size
    assert flops_per_token(llama, 64) == 6 * llama_matmul + 12 * llama.num_layers * 4 * llama.head_dim * 64

"""Every invalid layout fails early (before any process group) with an error that names the value to change."""

from __future__ import annotations

import pytest

from lightning_flagscale import FlagScaleStrategy, ParallelConfig, TransformerConfig


def test_product_must_match_world_size():
    with pytest.raises(ValueError, match=r"World size 6 is not divisible by pipeline x context x tensor"):
        ParallelConfig(tensor_parallel_size=4).resolve(6)
    with pytest.raises(ValueError, match=r"set data_parallel_size=2"):
        ParallelConfig(tensor_parallel_size=2, data_parallel_size=3).resolve(4)
    assert ParallelConfig(tensor_parallel_size=2).resolve(8).data_parallel_size == 4


def test_heads_and_kv_heads_must_split_over_tp():
    model = TransformerConfig.from_preset("llama-tiny")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=8"):
        ParallelConfig(tensor_parallel_size=8).validate_model(model)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        ParallelConfig(tensor_parallel_size=4).validate_model(model)


def test_layers_must_cover_pipeline_stages():
    model = TransformerConfig.from_preset("llama-tiny")  # 4 layers
    with pytest.raises(ValueError, match=r"num_layers=4 is smaller than pipeline x virtual stages = 8"):
        ParallelConfig(
            pipeline_parallel_size=4, virtual_pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"
        ).validate_model(model)
    with pytest.raises(ValueError, match=r"pipeline_layers=\[3, 3\] sums to 6"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layers=[3, 3]).validate_model(model)
    with pytest.raises(ValueError, match=r"virtual_pipeline_parallel_size > 1 needs pipeline_parallel_size > 1"):
        ParallelConfig(virtual_pipeline_parallel_size=2)


def test_even_split_needs_a_virtual_size_that_divides_the_layer_slots_per_rank():
    # 6 layers on 2 pipeline ranks: 3 slots a rank, which 2 chunks cannot share; the strategy's stage plan would
    # refuse it at setup, so validating the layout against the model does already (and the tuner drops it)
    model = TransformerConfig.from_preset("llama-tiny", num_layers=6)
    interleaved = dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    with pytest.raises(
        ValueError, match=r"virtual_pipeline_parallel_size=2 does not divide the 3 layer slots.*\[1, 3\]"
    ):
        ParallelConfig(**interleaved, virtual_pipeline_parallel_size=2).validate_model(model)
    ParallelConfig(**interleaved, virtual_pipeline_parallel_size=3).validate_model(model)
    # explicit layers, or the cost-balanced split, are not bound to equal slots
    ParallelConfig(**interleaved, virtual_pipeline_parallel_size=2, pipeline_layers=[2, 1, 1, 2]).validate_model(model)
    ParallelConfig(**interleaved, virtual_pipeline_parallel_size=2, pipeline_balance="cost").validate_model(model)


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tensor_parallel_size > 1"):
        ParallelConfig(sequence_parallel=True)


def test_unknown_names_are_reported_with_a_suggestion():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tensor_paralel_size'"):
        FlagScaleStrategy(tensor_paralel_size=2)
    with pytest.raises(ValueError, match=r"Did you mean 'llama-tiny'"):
        TransformerConfig.from_preset("lama-tiny")
    with pytest.raises(TypeError, match=r"Did you mean 'hidden_size'"):
        TransformerConfig.from_preset("llama-tiny", hiden_size=8)


def test_bad_sizes_and_stages():
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(ValueError, match=r"ulysses_size=3 must divide context_parallel_size=4"):
        ParallelConfig(context_parallel_size=4, context_parallel_mode="hybrid", ulysses_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size x expert_tensor_parallel_size = 8 must divide"):
        ParallelConfig(expert_parallel_size=8).resolve(4)


def test_model_config_validation():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=4 is larger than num_experts=2"):
        TransformerConfig(num_experts=2, num_experts_per_tok=4)
    with pytest.raises(ValueError, match=r"multiple of num_key_value_heads"):
        TransformerConfig(num_attention_heads=4, num_key_value_heads=3)


def test_strategy_validates_before_any_process_group(monkeypatch):
    """The Trainer fails in setup_environment, before init_process_group is ever reached."""
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale.models import CausalLMModule

    def _never(*args, **kwargs):
        raise AssertionError("a process group was created before validation")

    monkeypatch.setattr(dist, "init_process_group", _never)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FlagScaleStrategy(tensor_parallel_size=2),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"World size 1 is not divisible"):
        trainer.fit(CausalLMModule("llama-tiny"))


def test_every_preset_builds_and_names_its_source():
    from lightning_flagscale.config import PRESETS

    for name in PRESETS:
        config = TransformerConfig.from_preset(name)
        assert config.name == name and config.hf_source, name
        assert config.num_params() > 0


def test_config_package_imports_no_model_and_no_torch():
    """Presets and configs are data: ``lightning_flagscale.config`` never imports models (no cycle) or torch."""
    import ast
    from pathlib import Path

    import lightning_flagscale.config as config_pkg

    for path in Path(config_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("torch", "lightning_flagscale.models")), (path.name, name)

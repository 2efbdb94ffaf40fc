"""``import lightning_flagscale`` is light (for a fast ``--help``), and every registration still happens where it is
needed: presets on the registry's first read, HF converters and weight sources with ``models``, the Lightning strategy
name with ``FlagScaleStrategy`` (issue 41 item 5)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_flagscale.config.presets import PresetRegistry


def _fresh(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.own_processes
def test_registrations_happen_where_they_are_needed():
    code = """
import json, sys
import lightning_flagscale
light = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
from lightning_flagscale.config import PRESETS, TransformerConfig
config_only = "lightning_flagscale.models" not in sys.modules
TransformerConfig.from_preset("mixtral-tiny")  # the registry's first read imports the families
from lightning_flagscale.convert import supported_model_types
from lightning_flagscale.models.weights import weight_source
sources = [callable(weight_source(name).build_module) for name in ("hf", "peft")]
from lightning.pytorch.strategies import StrategyRegistry
before = "flagscale" in StrategyRegistry
strategy = lightning_flagscale.FlagScaleStrategy
print(json.dumps({"light": light, "config_only": config_only, "presets": sorted(PRESETS), "sources": sources,
                  "types": sorted(supported_model_types()), "before": before,
                  "after": StrategyRegistry["flagscale"]["strategy"] is strategy,
                  "export_hf": callable(lightning_flagscale.convert.export_hf)}))
"""
    out = _fresh(code)
    assert out["light"] == [] and out["config_only"]
    assert {"llama-tiny", "mixtral-tiny", "qwen3-tiny", "deepseek-v3-tiny", "llama3-8b"} <= set(out["presets"])
    assert out["sources"] == [True, True] and {"llama", "mixtral", "qwen3"} <= set(out["types"])
    assert not out["before"] and out["after"] and out["export_hf"]


def test_the_registry_runs_its_loader_once_on_the_first_read():
    registry, calls = PresetRegistry(), []

    def load():
        calls.append(1)
        registry.register({"a-tiny": {"num_layers": 1}})  # a family registering while the loader runs

    registry.add_loader(load)
    assert calls == []
    assert "a-tiny" in registry and list(registry) == ["a-tiny"] and len(registry) == 1
    assert calls == [1]
    with pytest.raises(ValueError, match="Presets registered twice: a-tiny"):
        registry.register({"a-tiny": {}})


def test_a_failed_loader_runs_again_on_the_next_read():
    registry, calls = PresetRegistry(), []

    def load():
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("first try")
        registry.register({"b-tiny": {}})

    registry.add_loader(load)
    with pytest.raises(ImportError, match="first try"):
        registry["b-tiny"]
    assert registry["b-tiny"] == {} and calls == [1, 1]


def test_the_root_package_names_its_lazy_attributes():
    import lightning_flagscale

    assert set(lightning_flagscale.__all__) <= set(dir(lightning_flagscale))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        lightning_flagscale.nope  # noqa: B018

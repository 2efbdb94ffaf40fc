"""The Quickstart and the recipes print no notice the user cannot act on (issue 41 item 4): Lightning's and torch's
filtered by message and raising module only (a user's own warning with the same text still prints), what our code
triggered fixed where it calls, no second checkpoint from Lightning's default callback. The end-to-end run is
``tests/test_cli_own_data.py`` (a recipe on its workers, every warning recorded)."""

from __future__ import annotations

import ast
import logging
import types
import warnings
from pathlib import Path

import yaml

from lightning_flagscale._notices import filter_dependency_notices
from lightning_flagscale.recipe_files import RECIPES_DIR

PKG = Path(__file__).resolve().parents[1] / "lightning_flagscale"


def _recorded(fn) -> list[str]:
    """``fn()``'s warnings as a user running ``python -W always`` with the package imported would see them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_dependency_notices()  # in front of "always", as the package's import puts them
        fn()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_lightnings_notices_are_filtered_and_the_users_own_are_not(caplog):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
    from lightning.pytorch.utilities.model_summary import ModelSummary

    def lightning_calls():
        CombinedLoader([range(3)])  # Lightning's pytree helper builds a deprecated LeafSpec
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        model = BoringModel()
        model.trainer = trainer
        assert ModelSummary(model).model_size > 0  # "Precision bf16-mixed is not supported by the model summary"

    with caplog.at_level(logging.INFO):
        assert _recorded(lightning_calls) == []
    assert caplog.records and not [r for r in caplog.records if "litlogger" in r.getMessage()]  # Lightning's ad

    def user_code():
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("Precision bf16-mixed is not supported by the model summary", UserWarning, stacklevel=1)
        warnings.warn("my own deprecation", DeprecationWarning, stacklevel=1)

    assert len(_recorded(user_code)) == 3


def test_memory_snapshots_say_what_they_save():
    """An in-memory snapshot resumes training: it holds the optimizer state, and says so (Lightning logs "`weights_only`
    was not set" on every rank for each ``save_checkpoint`` that does not)."""
    from lightning_flagscale.strategies import _snapshots

    calls = []

    class _Trainer:
        global_step = 3
        strategy = types.SimpleNamespace(_snapshot_local=False)

        def save_checkpoint(self, path, weights_only=None, storage_options=None):
            calls.append((weights_only, self.strategy._snapshot_local))

    _snapshots.take(_Trainer(), Path("snapshots"))
    assert calls == [(False, True)]


def test_no_package_code_calls_the_collectives_torch_renamed():
    """torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the filter for the notice that torch's
    own calls raise cannot tell who called (torch's logging wrapper is its module), so our code must not call them."""
    renamed = {"all_gather_into_tensor", "reduce_scatter_tensor"}
    calls = [
        f"{path.relative_to(PKG)}:{node.lineno}"
        for path in PKG.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in renamed
    ]
    assert calls == []


def test_no_recipe_writes_a_second_checkpoint():
    """Lightning adds its default ``ModelCheckpoint`` (a full checkpoint every epoch under lightning_logs) unless the
    trainer turns checkpointing off or names its own: every recipe does one or the other."""
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        trainer = yaml.safe_load(path.read_text())["trainer"]
        own = [cb for cb in trainer.get("callbacks") or [] if cb["class_path"].endswith(".ModelCheckpoint")]
        assert trainer.get("enable_checkpointing") is False or own, path.name
        assert not (trainer.get("enable_checkpointing") is False and own), path.name  # Lightning would refuse it

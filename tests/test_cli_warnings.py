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


def _failing_fit(tmp_path: Path, *, callbacks: list, write_first: bool = False) -> Path:
    """A fit whose data ``setup`` fails (as a corpus too small to split does on the workers), after writing a file into
    the log folder with ``write_first`` (as LightningCLI's config callback does later in a run)."""
    import lightning as L
    import pytest
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
    from lightning.pytorch.loggers import CSVLogger

    class Data(BoringDataModule):
        def setup(self, stage: str) -> None:
            if write_first:
                (Path(self.trainer.log_dir) / "config.yaml").write_text("{}\n")
            raise ValueError("'tiny.txt' holds 1 document(s); at least 2 are needed for train/val.")

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=CSVLogger(tmp_path / "logs", name="run"),
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.raises(ValueError, match="at least 2 are needed"):
        trainer.fit(BoringModel(), datamodule=Data())
    return tmp_path / "logs"


def test_a_run_failing_before_it_logs_leaves_no_empty_log_folder(tmp_path):
    from lightning_flagscale.callbacks import DropEmptyLogDir

    assert (_failing_fit(tmp_path / "a", callbacks=[]) / "run" / "version_0").is_dir()  # what Lightning leaves
    assert not _failing_fit(tmp_path / "b", callbacks=[DropEmptyLogDir()]).exists()  # version_0, run/, logs/
    (tmp_path / "d" / "logs" / "other").mkdir(parents=True)
    assert list(_failing_fit(tmp_path / "d", callbacks=[DropEmptyLogDir()]).iterdir()) == [
        tmp_path / "d" / "logs" / "other"
    ]
    kept = _failing_fit(tmp_path / "c", callbacks=[DropEmptyLogDir()], write_first=True)
    assert (kept / "run" / "version_0" / "config.yaml").is_file()  # a folder holding anything stays

"""The shipped recipes on one's own small text file (issue #17, item 5 first half).

With fewer training batches per epoch than ``val_check_interval`` Lightning used to refuse to start; the recipes
now validate every N batches counted across epochs (``check_val_every_n_epoch: null``). The main-job callbacks
write the loss curve next to the CSV. The run prints no warning under ``-W default`` but our notice about the
small corpus, and no Lightning notice about ``weights_only`` or its cloud logger (issue 41 item 4).
"""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path


def _write_corpus(path: Path) -> None:
    lines = [f"document {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(120)]
    path.write_text("\n".join(lines) + "\n")  # ~8 KB


class _Notices(logging.Handler):
    """Lightning's log lines a user cannot act on: the ``weights_only`` default, the cloud-logger advertisement."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "weights_only" in record.getMessage() or "litlogger" in record.getMessage():
            self.lines.append(record.getMessage())


def _fit(corpus: str, logs: str):
    from lightning_flagscale._notices import filter_dependency_notices
    from tests._cli import run_cli

    notices, lightning_log = _Notices(), logging.getLogger("lightning")
    lightning_log.addHandler(notices)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # as `python -W default`: deprecations included, once per place
            filter_dependency_notices()  # ahead of it, as importing the package puts them
            cli = run_cli([
                "fit", "--config", "zero1", "--data.source", corpus, "--data.seq_len", "64", "--data.batch_size", "16",
                "--trainer.max_steps", "8", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1",
                "--trainer.log_every_n_steps", "1", "--trainer.logger.init_args.save_dir", logs,
            ])  # fmt: skip
    finally:
        lightning_log.removeHandler(notices)
    trainer = cli.trainer
    printed = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught] + notices.lines
    return trainer.num_training_batches, trainer.global_step, trainer.current_epoch, trainer.loggers[0].log_dir, printed


def test_zero1_recipe_runs_on_a_small_text_file(launcher, tmp_path):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus)
    results = launcher(2, _fit, str(corpus), str(tmp_path / "logs"))
    # the one notice printed is ours, about this corpus, on rank 0 (which shows that the run's warnings are recorded)
    about_the_corpus = "gives 116 training samples, fewer than num_train_samples=4096; epochs will be shorter"
    assert [[line for line in printed if about_the_corpus not in line] for *_, printed in results] == [[], []]
    assert [len(printed) for *_, printed in results] == [1, 0]
    batches, steps, epoch, log_dir, _ = results[0]
    assert batches < 4, f"the corpus must be smaller than one validation interval ({batches} batches)"
    assert steps == 8 and epoch >= 2
    rows = list(csv.DictReader((Path(log_dir) / "metrics.csv").read_text().splitlines()))
    val_steps = [int(r["step"]) for r in rows if r.get("val_loss")]
    assert val_steps == [3, 7]  # after batches 4 and 8 of the run, whatever epoch they fell in
    assert (Path(log_dir) / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"

"""The shipped recipes on one's own small text file (issue #17, item 5 first half).

With fewer training batches per epoch than ``val_check_interval`` Lightning used to refuse to start; the recipes
now validate every N batches counted across epochs (``check_val_every_n_epoch: null``). The main-job callbacks
write the loss curve next to the CSV.
"""

from __future__ import annotations

import csv
from pathlib import Path


def _write_corpus(path: Path) -> None:
    lines = [f"document {i}: the quick brown fox number {i} jumps over the lazy dog." for i in range(120)]
    path.write_text("\n".join(lines) + "\n")  # ~8 KB


def _fit(corpus: str, logs: str):
    from tests._cli import run_cli

    cli = run_cli([
        "fit", "--config", "zero1", "--data.source", corpus, "--data.seq_len", "64", "--data.batch_size", "16",
        "--trainer.max_steps", "8", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1",
        "--trainer.log_every_n_steps", "1", "--trainer.logger.init_args.save_dir", logs,
    ])  # fmt: skip
    trainer = cli.trainer
    return trainer.num_training_batches, trainer.global_step, trainer.current_epoch, trainer.loggers[0].log_dir


def test_zero1_recipe_runs_on_a_small_text_file(launcher, tmp_path):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus)
    batches, steps, epoch, log_dir = launcher(2, _fit, str(corpus), str(tmp_path / "logs"))[0]
    assert batches < 4, f"the corpus must be smaller than one validation interval ({batches} batches)"
    assert steps == 8 and epoch >= 2
    rows = list(csv.DictReader((Path(log_dir) / "metrics.csv").read_text().splitlines()))
    val_steps = [int(r["step"]) for r in rows if r.get("val_loss")]
    assert val_steps == [3, 7]  # after batches 4 and 8 of the run, whatever epoch they fell in
    assert (Path(log_dir) / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"

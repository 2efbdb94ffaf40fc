"""The options of every ``lightning-flagscale`` subcommand, importing neither torch nor Lightning.

``--help`` answers from here in a fraction of a second; each command's code (``convert/cli.py``, ``tune/cli.py``)
builds its parser with these functions, so the help and the command cannot disagree. ``fit``/``validate``/``test``/
``predict`` are LightningCLI's: their ``--help`` is :data:`FIT_HELP` (the options a user sets first), and
``--help-all`` prints LightningCLI's full list (which needs Lightning imported, a few seconds).
"""

from __future__ import annotations

import argparse

from lightning_flagscale.config.attention import ATTENTION_BACKENDS
from lightning_flagscale.config.parallel import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.config.schedules import SCHEDULE_NAMES

__all__ = [
    "CONVERT_DTYPES",
    "FIT_HELP",
    "HELP_ALL",
    "LIST_PRESETS",
    "add_convert_parsers",
    "recipes_parser",
    "tune_parser",
]

HELP_ALL = "--help-all"
"""``fit --help-all``: LightningCLI's full option list."""

FIT_HELP = f"""\
usage: lightning-flagscale fit --config RECIPE [--section.option VALUE ...]

  -c, --config RECIPE         a shipped recipe's name (`lightning-flagscale recipes` lists them) or a YAML path
  The options set first (every recipe field can be overridden the same way):
  --data.source FILE|GLOB|DIR your own .txt/.jsonl/.parquet text (default: the embedded synthetic corpus)
  --data.tokenizer byte|model|DIR   'byte' needs no files; 'model' takes the tokenizer of --model.hf_dir
  --data.seq_len N, --data.batch_size N
  --model.config PRESET       a preset (llama-tiny, qwen3-tiny, ...) or a dict of TransformerConfig fields
  --model.hf_dir DIR_OR_ID    start from a Hugging Face model folder or Hub id (recipe finetune_hf)
  --trainer.max_steps N, --trainer.devices N
  --trainer.strategy.init_args.zero_stage 0-3, ...tensor_parallel_size N, ...pipeline_parallel_size N
  --ckpt_path PATH            resume from (fit) or evaluate (validate/test/predict) a checkpoint
  --print_config              the full resolved configuration, then exit

Full lists: `lightning-flagscale fit {HELP_ALL}` (every LightningCLI option), `--model.help CausalLMModule`,
`--data.help LMDataModule`, `--trainer.strategy.help FlagScaleStrategy`.
Mistakes found before the workers start are one `error:` line (FLAGSCALE_TRACEBACK=1 shows the traceback).
"""
"""What ``fit --help`` (and ``validate``/``test``/``predict``) prints: the options set first and where the rest are."""

LIST_PRESETS = "help"
"""``tune --preset help`` (or ``--preset`` alone, or ``--list-presets``) lists the presets."""

CONVERT_DTYPES = ("bfloat16", "float16", "float32")
"""``convert ckpt-to-hf --dtype`` choices (torch dtype names)."""


def add_convert_parsers(subparsers: argparse._SubParsersAction) -> tuple[argparse.ArgumentParser, ...]:
    """Add ``convert {hf-to-ckpt,ckpt-to-hf}``; returns the ``convert``, ``hf-to-ckpt`` and ``ckpt-to-hf`` parsers."""
    convert = subparsers.add_parser(
        "convert",
        help="Hugging Face <-> lightning-flagscale checkpoint conversion",
        description="Hugging Face <-> lightning-flagscale checkpoint conversion. Run `convert COMMAND --help` for"
        " the options of a command.",
    )
    sub = convert.add_subparsers(dest="convert_command", required=True, metavar="COMMAND", title="commands")
    a = sub.add_parser(
        "hf-to-ckpt",
        help="HF safetensors folder or Hub repo id -> sharded DCP checkpoint",
        description="HF safetensors folder or Hub repo id -> weights-only DCP checkpoint folder (resumable by `fit"
        " --ckpt_path` under any layout), with model_config.json, the HF config and the tokenizer files.",
    )
    a.add_argument("hf_dir", metavar="HF_DIR_OR_REPO_ID", help="a local HF model folder or a Hugging Face Hub repo id")
    a.add_argument("out", help="the checkpoint folder to write (must not exist; written atomically)")
    a.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo id")
    a.add_argument("--max-seq-len", type=int, default=None, help="override max_position_embeddings")
    b = sub.add_parser(
        "ckpt-to-hf",
        help="sharded DCP checkpoint -> HF safetensors folder",
        description="Sharded DCP checkpoint (any parallel layout, LoRA runs merged) -> HF safetensors folder"
        " loadable by transformers' AutoModelForCausalLM.",
    )
    b.add_argument("ckpt", help="the checkpoint folder (a `fit` checkpoint or `convert hf-to-ckpt` output)")
    b.add_argument("out", help="the HF folder to write (must not exist; written atomically)")
    b.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB or 5GB (default 2GB)")
    b.add_argument("--tokenizer-dir", default=None, help="copy the tokenizer files from this folder")
    b.add_argument("--dtype", choices=CONVERT_DTYPES, default=None,
                   help="cast the weights (default: as stored in the checkpoint)")  # fmt: skip
    b.add_argument("--model-type", default=None, help="HF family to export as (default: inferred)")
    b.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="then upload the folder to this Hub repo")
    return convert, a, b


def recipes_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="lightning-flagscale recipes",
        description="List the shipped recipes: name, then what each sets (devices, layout, model, data), read from"
        " the YAML itself. Use a name as `lightning-flagscale fit --config NAME`.",
    )


def tune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-flagscale tune",
        description="Rank parallel layouts for a model on a cluster (memory model + cost model); --calibrate measures"
        " this machine, --run K trains the top K here, --hetero plans mixed device groups.",
    )
    p.add_argument("--preset", nargs="?", const=LIST_PRESETS, default="llama3-8b",
                   help="the model: a TransformerConfig preset name (default llama3-8b); `--preset` alone or"
                   f" `--preset {LIST_PRESETS}` lists them")  # fmt: skip
    p.add_argument("--list-presets", action="store_true", help="list the presets, one line each, and exit")
    p.add_argument("--devices", type=int, help="number of devices (required unless --calibrate or --hetero)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step (default 256)")
    p.add_argument("--profile", help="h100 (default) | h200 | a100 | a profile JSON path (written by --calibrate)")
    p.add_argument("--memory-gb", type=float, help="override the profile's device memory")
    p.add_argument("--attn-backend", choices=ATTENTION_BACKENDS,
                   help="attention backend to plan for (default: the preset's); the profile prices its kernel")  # fmt: skip
    p.add_argument("--top", "--top-k", dest="top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.add_argument("--schedules", help=f"comma-separated pipeline schedules to search, of {', '.join(SCHEDULE_NAMES)}"
                   " (default: all)")  # fmt: skip
    p.add_argument("--grad-bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL,
                   help="the strategy's grad_bucket_numel (DDP / ZeRO: one collective per bucket); written into the"
                   " recipe when not the default")  # fmt: skip
    p.add_argument("--calibrate", action="store_true", help="measure this machine and write a profile JSON")
    p.add_argument("--calibrate-out", default="hardware_profile.json", metavar="PATH",
                   help="with --calibrate: the profile JSON to write (default hardware_profile.json)")  # fmt: skip
    p.add_argument("--calibrate-groups", default="2,4", metavar="N,N",
                   help="with --calibrate: process-group sizes for the collective benchmarks (default 2,4)")  # fmt: skip
    p.add_argument("--calibrate-dtype", choices=("fp32", "bf16"),
                   help="dtype of the GEMM/attention/memory benchmarks: the one training computes in (default: fp32"
                   " on CPU processes, bf16 on GPUs)")  # fmt: skip
    p.add_argument("--calibrate-device", choices=("cpu", "cuda"),
                   help="measure CPU processes (gloo) or CUDA devices (NCCL, one a rank; flash-attn and Transformer"
                   " Engine kernels when installed); default: cuda when this machine has a GPU")  # fmt: skip
    p.add_argument(
        "--calibrate-threads", type=int, help="intra-op threads of one rank (1 for CPU ranks that share a host)"
    )
    p.add_argument("--run", type=int, default=0, metavar="K", help="train the top K layouts for a few steps here")
    p.add_argument("--run-steps", type=int, default=5, metavar="N",
                   help="with --run: steps per trained layout, the first one warm-up (default 5, at least 3)")  # fmt: skip
    p.add_argument("--run-dir", default="tune_runs", metavar="DIR",
                   help="with --run: folder for each run's recipe and logs, and best.yaml (default tune_runs)")  # fmt: skip
    p.add_argument("--write-recipe", metavar="PATH",
                   help="write the best layout as a `fit --config` recipe (with --run: default RUN_DIR/best.yaml)")  # fmt: skip
    p.add_argument("--refit-profile", metavar="PATH",
                   help="with --run: write the profile with compute_scale refitted on the measured runs "
                        "(least squares in log step time) for later `tune --profile PATH` searches")  # fmt: skip
    p.add_argument("--recipe-steps", type=int, default=100, metavar="N",
                   help="trainer.max_steps of the written recipe (default 100)")  # fmt: skip
    p.add_argument(
        "--hetero",
        metavar="TYPE:COUNT:PROFILE,...",
        help="device groups in rank order (plans hetero meshes and hetero-DP; --write-recipe writes the fastest plan)",
    )
    return p

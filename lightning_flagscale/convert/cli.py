"""``lightning-flagscale convert hf-to-ckpt|ckpt-to-hf``: plain functions plus an argparse wiring helper.

``hf_to_ckpt`` writes a weights-only DCP checkpoint (keys ``state_dict.model.<FQN>``, the layout the strategy
saves and can reshard on load) plus ``model_config.json``, the original ``config.json`` as ``hf_config.json``
and the tokenizer / generation files, so ``ckpt_to_hf`` of it (or of any later training checkpoint in the same
folder layout) restores a complete HF folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_flagscale.cli_parsers import CONVERT_DTYPES, add_convert_parsers
from lightning_flagscale.convert.hf_export import HF_CONFIG_FILE, TOKENIZER_FILES, export_hf, write_model_config
from lightning_flagscale.convert.hf_import import causal_lm_from_hf
from lightning_flagscale.convert.hub import resolve_hf_dir
from lightning_flagscale.convert.registry import HFConversionError, read_hf_config
from lightning_flagscale.convert.safetensors_io import CheckpointFormatError, atomic_output_dir

__all__ = ["add_convert_subcommands", "ckpt_to_hf", "convert_main", "hf_to_ckpt"]

_DTYPES = {name: getattr(torch, name) for name in CONVERT_DTYPES}


def hf_to_ckpt(
    hf_dir: str | os.PathLike, out: str | os.PathLike, *, max_seq_len: int | None = None, revision: str | None = None
) -> Path:
    """Convert an HF folder or Hub repo id into a DCP checkpoint folder ``out`` (refused if it exists; atomic)."""
    import torch.distributed.checkpoint as dcp

    if Path(out).exists():  # before a possible download
        raise FileExistsError(f"Output folder {str(out)!r} already exists; remove it or choose another path.")
    hf_dir = resolve_hf_dir(hf_dir, revision=revision)
    overrides = {"max_seq_len": max_seq_len} if max_seq_len else {}
    model = causal_lm_from_hf(hf_dir, **overrides)
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    if model.config.tie_word_embeddings:
        state["state_dict"].pop("model.lm_head.weight", None)  # the same tensor as the embedding
    with atomic_output_dir(out) as tmp:
        with warnings.catch_warnings():  # single-process on purpose: silence DCP's "assuming no_dist" warning
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        write_model_config(tmp, model.config)
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(read_hf_config(hf_dir), indent=2) + "\n")
        for file in (*TOKENIZER_FILES, "generation_config.json"):
            if (Path(hf_dir) / file).is_file():
                shutil.copy2(Path(hf_dir) / file, tmp / file)
    return Path(out)


def ckpt_to_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_size: str = "2GB",
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: str | None = None,
    model_type: str | None = None,
    push_to_hub: str | None = None,
) -> Path:
    """Convert a DCP checkpoint folder (any parallel layout) into an HF folder ``out`` (optionally pushed)."""
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    return export_hf(
        ckpt,
        out,
        max_shard_size=max_shard_size,
        tokenizer_dir=tokenizer_dir,
        dtype=_DTYPES[dtype] if dtype else None,
        model_type=model_type,
        push_to_hub=push_to_hub,
    )


def add_convert_subcommands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``convert {hf-to-ckpt,ckpt-to-hf}`` to an argparse subparsers object; returns the ``convert`` parser.

    The options are ``cli_parsers.add_convert_parsers``' (shared with ``lightning-flagscale convert --help``, which
    answers without importing torch); each command's parser gets the function it runs as ``convert_fn``."""
    convert, to_ckpt, to_hf = add_convert_parsers(subparsers)
    to_ckpt.set_defaults(
        convert_fn=lambda ns: hf_to_ckpt(ns.hf_dir, ns.out, max_seq_len=ns.max_seq_len, revision=ns.revision)
    )
    to_hf.set_defaults(
        convert_fn=lambda ns: ckpt_to_hf(
            ns.ckpt,
            ns.out,
            max_shard_size=ns.max_shard_size,
            tokenizer_dir=ns.tokenizer_dir,
            dtype=ns.dtype,
            model_type=ns.model_type,
            push_to_hub=ns.push_to_hub,
        )
    )
    return convert


def convert_main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``lightning-flagscale convert ...`` (``argv`` without the leading ``convert``)."""
    parser = argparse.ArgumentParser(prog="lightning-flagscale")
    add_convert_subcommands(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["convert", *(argv or [])])
    try:
        out = ns.convert_fn(ns)
    except (HFConversionError, CheckpointFormatError, FileExistsError, FileNotFoundError) as err:
        parser.exit(2, f"lightning-flagscale convert: error: {err}\n")  # user errors: the message, no traceback
    print(f"wrote {out}")  # CLI output, not library logging
    return 0

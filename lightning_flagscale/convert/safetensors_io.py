"""Streaming safetensors: a lazy reader over single-file or sharded HF folders, and a sharded atomic writer.

The reader never loads a whole file: ``safe_open(...).get_slice(name)[...]`` memory-maps the header and reads
only the requested region, which is what lets each rank read just its TP/PP/EP shard (issue 6). Files are
opened on first use, so a pipeline stage touches only the shards that hold its layers.

The writer streams tensors into ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes
(plus ``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits), inside a temporary
folder that is renamed into place at the end, so an interrupted export never leaves a half-written model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "CheckpointFormatError",
    "HFCheckpointReader",
    "ShardedSafetensorsWriter",
    "atomic_output_dir",
    "parse_size",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFormatError(ValueError):
    """A checkpoint folder or file is missing, malformed, truncated or inconsistent; the message names it."""


def parse_size(size: int | str) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"500MiB"`` -> 524_288_000, ints pass through (HF's convention)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}.")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size; use an int of bytes or e.g. '2GB', '500MiB'.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    powers.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    return int(number * powers[unit])


class HFCheckpointReader:
    """Lazy, slice-wise access to the tensors of a Hugging Face safetensors folder.

    Use as a context manager (or call ``close``). ``keys()``/``shape()`` come from headers only;
    ``read(name, box)`` returns ``tensor[box]`` reading just that region from disk.
    """

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.root = Path(hf_dir)
        if not self.root.is_dir():
            raise CheckpointFormatError(f"Hugging Face checkpoint folder {str(self.root)!r} does not exist.")
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0
        """Tensor bytes returned by ``read`` so far (to check that a rank reads only its shard)."""
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointFormatError(f"{index}: not a valid safetensors index ({err}).") from err
            self.weight_map: dict[str, str] = dict(weight_map)
            for file in sorted(set(self.weight_map.values())):
                if not (self.root / file).is_file():
                    raise CheckpointFormatError(f"{index} lists shard {file!r}, which is missing from {self.root}.")
        elif (self.root / SINGLE_FILE).is_file():
            self.weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            present = sorted(p.name for p in self.root.iterdir())
            raise CheckpointFormatError(
                f"{self.root} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {present}); only safetensors "
                "checkpoints are supported (re-save with save_pretrained(safe_serialization=True))."
            )

    # ---- lookup ----
    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        return self.root / self.weight_map[name]

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            # Keep one file mapped at a time: pages touched through the mmap count towards RSS until the handle
            # is dropped, so holding every shard open would let peak memory grow to the whole checkpoint.
            self._handles.clear()
            try:
                self._handles[file] = safe_open(str(self.root / file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointFormatError(
                    f"{self.root / file}: cannot read safetensors file (truncated or corrupt?): {err}"
                ) from err
        return self._handles[file]

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise CheckpointFormatError(f"Tensor {name!r} is not in the checkpoint at {self.root}.")
        file = self.weight_map[name]
        handle = self._open(file)
        try:
            return handle.get_slice(name)
        except SafetensorError as err:
            raise CheckpointFormatError(
                f"{self.root / file}: tensor {name!r} (listed in the index) cannot be read: {err}"
            ) from err

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
        """``tensor[box]`` (the whole tensor when ``box`` is None), reading only that region."""
        sl = self._slice(name)
        try:
            if box is None or len(box) == 0:
                out = self._open(self.weight_map[name]).get_tensor(name)
            else:
                out = sl[tuple(slice(a, b) for a, b in box)]
        except SafetensorError as err:
            raise CheckpointFormatError(f"{self.file_of(name)}: tensor {name!r} cannot be read: {err}") from err
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mmap when collected

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedSafetensorsWriter:
    """Append tensors; shards are flushed when the next tensor would exceed ``max_shard_size`` bytes.

    Shards are written under provisional names and renamed to ``model-0000i-of-0000N`` in ``finish`` once N is
    known, which keeps the export single-pass (peak memory: one shard plus the tensor being produced).
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_size: int | str = "2GB") -> None:
        self.out_dir = Path(out_dir)
        self.limit = parse_size(max_shard_size)
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if any(name in shard for shard in self._shards) or name in self._current:
            raise ValueError(f"Tensor {name!r} written twice.")
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + nbytes > self.limit:
            self._flush()
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes:
            # A view into a bigger storage (unbound experts, vocab rows without padding): safetensors refuses
            # tensors sharing storage, so copy it; whole tensors (live parameters) are referenced, not copied.
            tensor = tensor.clone()
        self._current[name] = tensor
        self._current_bytes += nbytes
        self.total_bytes += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._current, str(self.out_dir / f".shard-{index:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._current))
        self._current, self._current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, the final names and the index; returns the file names."""
        if self._current or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            os.replace(self.out_dir / ".shard-00000.tmp", self.out_dir / SINGLE_FILE)
            return [SINGLE_FILE]
        files, weight_map = [], {}
        for i, names in enumerate(self._shards):
            file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.out_dir / f".shard-{i:05d}.tmp", self.out_dir / file)
            files.append(file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``out_dir``, renamed to ``out_dir`` only if the block succeeds."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"Output folder {str(out)!r} already exists; remove it or choose another path.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():  # someone else created it meanwhile: never overwrite
            raise FileExistsError(f"Output folder {str(out)!r} appeared during the export; not overwriting it.")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

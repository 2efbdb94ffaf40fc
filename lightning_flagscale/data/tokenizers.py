"""Tokenizers behind one small protocol: a dependency-free byte tokenizer and a wrapper for local HF tokenizers.

The byte tokenizer is what the embedded synthetic corpus and the ``*-tiny`` presets (``vocab_size=256``) use: it needs
no file, no download and no ``transformers``. ``HFTokenizer`` wraps any tokenizer folder that
``transformers.AutoTokenizer.from_pretrained`` can read, so a run on a real corpus can use the tokenizer of the model it
was converted from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["TOKENIZER_FILES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "check_tokenizer", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A folder holding none of these has no tokenizer ``transformers`` can load without guessing (a ``save_pretrained``
model folder alone): refused by name up front instead of failing inside ``AutoTokenizer`` after the workers started."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the datasets need from a tokenizer. ``encode`` never adds special tokens: the datasets add them."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids ``0..255`` (``vocab_size == 256``).

    Special ids reuse byte values that never occur in text rather than growing the vocabulary past 256 (which would
    break the ``vocab_size=256`` presets):

    - ``eos_id = 0`` (NUL): ends every document; ``decode`` drops it.
    - ``pad_id = 0``: padding is always masked (``labels == -100``, ``attention_mask == 0``), so it may share EOS.
    - ``bos_id = None``: documents are separated by EOS alone, as in GPT-2 style packing.
    """

    vocab_size: int = 256
    eos_id: int = 0
    bos_id: int | None = None
    pad_id: int = 0

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text``. A NUL character in the text would alias EOS, so it is rejected."""
        data = text.encode("utf-8")
        if b"\x00" in data:
            raise ValueError("ByteTokenizer reserves byte 0 (NUL) as EOS; remove NUL characters from the text.")
        return list(data)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; EOS/padding (0) is dropped and invalid UTF-8 (e.g. a cut multi-byte char) replaced."""
        values = [int(i) for i in ids]
        bad = [i for i in values if not 0 <= i < 256]
        if bad:
            raise ValueError(f"ByteTokenizer ids must be in [0, 256), got {bad[:5]}.")
        return bytes(i for i in values if i != self.eos_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face tokenizer folder (``tokenizer.json`` / ``tokenizer_config.json``) behind ``Tokenizer``.

    ``eos_id`` is the tokenizer's EOS token and is required (it separates packed documents). ``pad_id`` falls back to
    EOS when the tokenizer defines no padding token, as is usual for decoder-only models. ``vocab_size`` is
    ``len(tokenizer)``, i.e. it counts added tokens, so it is the smallest embedding that can hold every id.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFTokenizer needs `transformers`: pip install 'lightning-flagscale[hf]' (or use tokenizer='byte')."
            ) from err
        check_tokenizer(os.fspath(path))
        self.path = os.fspath(path)
        self._tok: Any = AutoTokenizer.from_pretrained(self.path)
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"The tokenizer in {self.path!r} defines no EOS token; set `eos_token` in its tokenizer_config.json."
            )

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_id if pad is None else int(pad)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def check_tokenizer(name_or_path: str) -> None:
    """Raise ``ValueError`` naming the fix unless ``name_or_path`` is ``"byte"`` or a folder with tokenizer files.

    Cheap (file names only, no ``transformers``): the CLI runs it before any worker process starts.
    """
    if name_or_path == "byte":
        return
    if not os.path.isdir(name_or_path):
        raise ValueError(
            f"Unknown tokenizer {name_or_path!r}: use 'byte' or the path of a local Hugging Face tokenizer folder "
            "(downloads are not attempted)."
        )
    if not any(os.path.isfile(os.path.join(name_or_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"{name_or_path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the folder that has them,"
            " or tokenizer='byte' (--data.tokenizer byte: UTF-8 bytes as ids 0-255, no files needed)."
        )


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """``"byte"`` for :class:`ByteTokenizer`, else a local HF tokenizer folder for :class:`HFTokenizer`."""
    check_tokenizer(name_or_path)
    if name_or_path == "byte":
        return ByteTokenizer()
    return HFTokenizer(name_or_path)

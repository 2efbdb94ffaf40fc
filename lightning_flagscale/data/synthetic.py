"""An embedded, procedurally generated English-like corpus that a tiny byte-level model learns within ~100 steps.

No download, no file: document ``i`` of a split is a pure function of ``(seed, split, i)``, so every rank, every run
and every resume sees the same text, and the corpus can be indexed at random (map-style) or streamed without end.

What there is to learn, from easy to hard (so the loss falls early and keeps falling):

- a closed vocabulary of about a hundred lowercase words and numbers in a handful of sentence templates
  (spelling, spacing, punctuation: the first nats of loss);
- **facts that recur**: a small fixed "world" of people (made-up names, drawn once from ``seed``) each with a city,
  a pet, a colour and a food; every mention of ``mira`` says she lives in the same city, in train and validation
  alike, so the facts can be memorised;
- **counting** ("count from 12: 12 13 14 15.") and **arithmetic** ("17 + 5 = 22."), whose continuations are fully
  determined by the prefix;
- **in-context recall**: key/value pairs followed by a question about one of them, and **spelling**
  ("spell garden: g a r d e n.") which needs copying from context.

Each document is one paragraph of one kind, 20-360 characters long (about 120 on average), so packing at ``seq_len=128`` produces blocks that
hold one to three documents and exercises the document-boundary masking.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from torch.utils.data import Dataset

__all__ = ["SyntheticTextDataset", "SyntheticWorld"]

Split = Literal["train", "validation"]

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "th"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CITIES = ["paris", "lima", "oslo", "cairo", "tokyo", "rome", "quito", "dakar", "perth", "kyiv", "delhi", "bern"]
_PETS = ["cat", "dog", "fox", "owl", "hen", "bat", "yak", "eel"]
_COLOURS = ["red", "blue", "green", "black", "white", "grey", "pink", "gold"]
_FOODS = ["rice", "bread", "soup", "figs", "plums", "cheese", "beans", "honey", "apples", "noodles"]
_WORDS = [
    "garden", "river", "window", "pencil", "planet", "forest", "silver", "winter", "rocket", "castle",
    "bridge", "candle", "island", "market", "mirror", "orange", "pocket", "thunder", "valley", "yellow",
]  # fmt: skip


@dataclass(frozen=True)
class Person:
    """One recurring entity of the world and its fixed facts."""

    name: str
    city: str
    pet: str
    colour: str
    food: str


class SyntheticWorld:
    """The fixed facts shared by every document (and both splits) of a corpus with this ``seed``."""

    def __init__(self, seed: int, num_people: int = 16) -> None:
        rng = random.Random(f"world-{seed}")
        names: list[str] = []
        while len(names) < num_people:
            name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2)) + rng.choice(["", "n", "l"])
            if name not in names:
                names.append(name)
        self.people = [
            Person(n, rng.choice(_CITIES), rng.choice(_PETS), rng.choice(_COLOURS), rng.choice(_FOODS)) for n in names
        ]


def _facts(rng: random.Random, world: SyntheticWorld) -> str:
    sentences = []
    for p in rng.sample(world.people, rng.randint(2, 4)):
        templates = [
            f"{p.name} lives in {p.city}.",
            f"{p.name} has a {p.colour} {p.pet}.",
            f"{p.name} likes {p.food}.",
            f"where does {p.name} live? {p.name} lives in {p.city}.",
            f"what does {p.name} eat? {p.name} eats {p.food}.",
        ]
        sentences += rng.sample(templates, rng.randint(1, 3))
    return " ".join(sentences)


def _arithmetic(rng: random.Random, world: SyntheticWorld) -> str:
    sentences = []
    for _ in range(rng.randint(3, 8)):
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(0, 12), rng.randint(0, 12)
            sentences.append(f"{a} * {b} = {a * b}.")
        else:
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            if op == "-" and b > a:
                a, b = b, a
            sentences.append(f"{a} {op} {b} = {a + b if op == '+' else a - b}.")
    return " ".join(sentences)


def _counting(rng: random.Random, world: SyntheticWorld) -> str:
    sentences = []
    for _ in range(rng.randint(1, 3)):
        start, length, step = rng.randint(0, 90), rng.randint(4, 10), rng.choice([1, 1, 1, 2, 5])
        if rng.random() < 0.3:
            values = [start + step * (length - 1) - step * k for k in range(length)]
            head = f"count down from {values[0]} by {step}:" if step > 1 else f"count down from {values[0]}:"
        else:
            values = [start + step * k for k in range(length)]
            head = f"count from {start} by {step}:" if step > 1 else f"count from {start}:"
        sentences.append(head + " " + " ".join(map(str, values)) + ".")
    return " ".join(sentences)


def _recall(rng: random.Random, world: SyntheticWorld) -> str:
    keys = rng.sample(_WORDS, rng.randint(3, 5))
    values = {k: rng.randint(0, 99) for k in keys}
    pairs = ", ".join(f"{k} is {v}" for k, v in values.items())
    questions = " ".join(f"what is {k}? {k} is {values[k]}." for k in rng.sample(keys, rng.randint(1, len(keys))))
    return f"remember: {pairs}. {questions}"


def _spelling(rng: random.Random, world: SyntheticWorld) -> str:
    words = rng.sample(_WORDS + [p.name for p in world.people], rng.randint(2, 5))
    return " ".join(f"spell {w}: {' '.join(w)}." for w in words)


_KINDS: list[Callable[[random.Random, SyntheticWorld], str]] = [
    _facts,
    _facts,
    _arithmetic,
    _counting,
    _recall,
    _spelling,
]


class SyntheticTextDataset(Dataset[str]):
    """Documents (``str``) of the embedded synthetic corpus; see the module docstring for what they contain.

    Args:
        num_documents: size of the map-style dataset; ``None`` for an unbounded corpus that supports indexing at any
            non-negative index and iteration without end (``len()`` then raises ``TypeError``).
        seed: picks the world (the recurring facts) and the documents. Train and validation of one seed share the
            world and have disjoint document streams.
        split: ``"train"`` or ``"validation"``.
    """

    def __init__(self, num_documents: int | None = None, *, seed: int = 1234, split: Split = "train") -> None:
        if num_documents is not None and num_documents < 0:
            raise ValueError(f"num_documents must be >= 0 or None, got {num_documents}.")
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}.")
        self.num_documents = num_documents
        self.seed = seed
        self.split = split
        self.world = SyntheticWorld(seed)

    def document(self, index: int) -> str:
        """Document ``index``: a pure function of ``(seed, split, index)`` (string seeds hash with SHA-512)."""
        rng = random.Random(f"{self.seed}-{self.split}-{index}")
        return rng.choice(_KINDS)(rng, self.world)

    def __getitem__(self, index: int) -> str:
        if index < 0 or (self.num_documents is not None and index >= self.num_documents):
            raise IndexError(f"document index {index} out of range for {self.num_documents} documents.")
        return self.document(index)

    def __len__(self) -> int:
        if self.num_documents is None:
            raise TypeError("an unbounded SyntheticTextDataset (num_documents=None) has no length; iterate it instead.")
        return self.num_documents

    def __iter__(self) -> Iterator[str]:
        index = 0
        while self.num_documents is None or index < self.num_documents:
            yield self.document(index)
            index += 1

"""The embedded synthetic corpus: deterministic by seed, recurring facts, and learnable structure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_flagscale.data import SyntheticTextDataset


def test_documents_are_a_pure_function_of_seed_split_and_index():
    a = SyntheticTextDataset(50, seed=3)
    b = SyntheticTextDataset(50, seed=3)
    assert list(a) == list(b) == [a[i] for i in range(50)]
    assert b[17] == a[17]  # random access does not depend on what was generated before
    assert list(SyntheticTextDataset(50, seed=4)) != list(a)
    assert list(SyntheticTextDataset(50, seed=3, split="validation")) != list(a)
    assert all(d and d.isascii() and "\x00" not in d for d in a)
    with pytest.raises(IndexError):
        a[50]


def test_unbounded_corpus_streams_and_has_no_length():
    corpus = SyntheticTextDataset(None, seed=0)
    it = iter(corpus)
    assert [next(it) for _ in range(5)] == [corpus[i] for i in range(5)]
    assert corpus[10**6]
    with pytest.raises(TypeError):
        len(corpus)


def test_facts_recur_consistently_across_splits():
    train = SyntheticTextDataset(400, seed=11)
    val = SyntheticTextDataset(100, seed=11, split="validation")
    for person in train.world.people[:4]:
        stated = [d for d in [*train, *val] if f"{person.name} lives in" in d]
        assert len(stated) >= 3
        assert all(f"{person.name} lives in {person.city}." in d for d in stated)


def _bytes(dataset: SyntheticTextDataset) -> np.ndarray:
    return np.frombuffer(b"\x00".join(d.encode() for d in dataset), dtype=np.uint8).astype(np.int64)


def test_bigram_model_fitted_on_train_beats_uniform_on_validation():
    """Cheap learnability proxy: a byte bigram model (add-0.01 smoothing) fitted on train must compress val far
    below the 8 bits/byte of the uniform model, and clearly below the unigram model."""
    train, val = (
        _bytes(SyntheticTextDataset(2000, seed=5)),
        _bytes(SyntheticTextDataset(200, seed=5, split="validation")),
    )
    unigram = np.bincount(train, minlength=256) + 0.01
    unigram_bits = -np.log2(unigram[val] / unigram.sum()).mean()
    counts = np.full((256, 256), 0.01)
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    probs = counts / counts.sum(axis=1, keepdims=True)
    bigram_bits = -np.log2(probs[val[:-1], val[1:]]).mean()
    uniform_bits = math.log2(256)
    assert bigram_bits < 0.5 * uniform_bits, bigram_bits
    assert bigram_bits < unigram_bits - 1.0, (bigram_bits, unigram_bits)

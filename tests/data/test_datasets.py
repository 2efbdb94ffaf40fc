"""Packing/padding layout (exact, on hand-checked streams and randomised) and local text/jsonl/parquet loading."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lightning_flagscale.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    PackedDataset,
    PaddedDataset,
    load_text_documents,
    resolve_data_files,
)

TOK = ByteTokenizer()


def _ids(text: str) -> list[int]:
    return list(text.encode())


def test_packing_hand_checked_layout():
    # stream: a b <eos> c d e <eos> f <eos> g h <eos>  (12 tokens, blocks of 5 starting every 4)
    ds = PackedDataset(["ab", "cde", "", "f", "gh"], TOK, seq_len=4)
    assert len(ds) == 3 and ds.num_documents_used == 5
    a, b, c, d, e, f, g, h = _ids("abcdefgh")
    x = IGNORE_INDEX
    expected = [
        ([a, b, 0, c], [b, 0, x, d], [0, 1, 2, 0], [0, 0, 0, 1]),
        ([d, e, 0, f], [e, 0, x, 0], [0, 1, 2, 0], [0, 0, 0, 1]),
        ([0, g, h, 0], [x, h, 0, x], [0, 0, 1, 2], [0, 1, 1, 1]),  # last block: one padded target
    ]
    for sample, (inputs, labels, positions, segments) in zip(ds, expected):
        assert sample["input_ids"].tolist() == inputs
        assert sample["labels"].tolist() == labels
        assert sample["position_ids"].tolist() == positions
        assert sample["segment_ids"].tolist() == segments
        assert all(v.dtype == torch.int64 and v.shape == (4,) for v in sample.values())


def test_packing_with_cross_document_attention_only_masks_padding():
    ds = PackedDataset(["ab", "cde", "f", "gh"], TOK, seq_len=4, cross_document_attention=True)
    assert set(ds[0]) == {"input_ids", "labels", "position_ids"}
    assert ds[0]["labels"].tolist() == [*_ids("b"), 0, *_ids("cd")]
    assert ds[2]["labels"].tolist() == [*_ids("gh"), 0, IGNORE_INDEX]
    assert ds[2]["position_ids"].tolist() == [0, 1, 2, 3]


def test_packing_invariants_on_random_documents():
    rng = random.Random(0)
    docs = ["".join(rng.choice("xyz ") for _ in range(rng.randint(1, 30))) for _ in range(40)]
    seq_len = 16
    ds = PackedDataset(docs, TOK, seq_len)
    stream = [t for doc in docs for t in [*_ids(doc), 0]]
    doc_of = [i for i, doc in enumerate(docs) for _ in range(len(doc) + 1)]
    assert len(ds) == -(-(len(stream) - 1) // seq_len)
    kept_targets = 0
    for k, sample in enumerate(ds):
        for j in range(seq_len):
            pos = k * seq_len + j
            if pos >= len(stream):  # padding
                assert sample["labels"][j] == IGNORE_INDEX
                continue
            assert sample["input_ids"][j] == stream[pos]
            crosses = pos + 1 >= len(stream) or doc_of[pos + 1] != doc_of[pos]
            label = sample["labels"][j].item()
            assert label == (IGNORE_INDEX if crosses else stream[pos + 1])
            kept_targets += label != IGNORE_INDEX
            # position = distance to the document start, clipped at the block start
            doc_start = doc_of.index(doc_of[pos])
            assert sample["position_ids"][j] == pos - max(doc_start, k * seq_len)
            first_doc = doc_of[k * seq_len]
            assert sample["segment_ids"][j] == doc_of[pos] - first_doc
    # every token except the last of each document (its EOS) is a target exactly once
    assert kept_targets == len(stream) - len(docs)


def test_packing_max_samples_consumes_documents_lazily():
    consumed = []

    def docs():
        for i in range(10**9):
            consumed.append(i)
            yield "hello world"  # 12 tokens with EOS

    ds = PackedDataset(docs(), TOK, seq_len=8, max_samples=3)  # needs 3 * 8 + 1 = 25 tokens -> 3 documents
    assert len(ds) == 3 and len(consumed) == 3 and ds.num_documents_used == 3
    assert all(s["labels"].ne(IGNORE_INDEX).any() for s in ds)
    assert len(PackedDataset(docs(), TOK, seq_len=8, max_samples=0)) == 0


def test_padded_dataset_truncates_pads_and_masks():
    ds = PaddedDataset(["abc", "", "abcdefghij"], TOK, seq_len=6)
    assert len(ds) == 2
    a, b, c = _ids("abc")
    short, long = ds[0], ds[1]
    assert short["input_ids"].tolist() == [a, b, c, 0, 0, 0]
    assert short["labels"].tolist() == [b, c, 0, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert short["attention_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert short["position_ids"].tolist() == list(range(6))
    assert long["input_ids"].tolist() == _ids("abcdef")
    assert long["labels"].tolist() == _ids("bcdefg")
    assert long["attention_mask"].tolist() == [1] * 6
    assert len(PaddedDataset(iter(["x"] * 100), TOK, seq_len=4, max_samples=7)) == 7


DOCS = ["the first document.", "second one, with ünïcode ✓", "third"]


def _write(tmp_path, fmt: str, name: str = "part") -> str:
    if fmt == "text":
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    elif fmt == "json":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"content": DOCS, "id": list(range(len(DOCS)))}), path)
    return str(path)


@pytest.mark.parametrize("fmt", ["text", "json", "parquet"])
def test_local_files_round_trip(tmp_path, fmt):
    pytest.importorskip("datasets")
    data = tmp_path / "data"
    data.mkdir()
    path = _write(data, fmt)
    field = "text" if fmt == "text" else "content"
    cache = str(tmp_path / "cache")
    for source in (path, str(data), str(data / "*")):
        docs = load_text_documents(source, text_field=field, cache_dir=cache)
        assert list(docs) == DOCS
    packed = PackedDataset(docs, TOK, seq_len=8)
    stream = [t for s in packed for t in s["input_ids"].tolist()]
    assert TOK.decode(stream) == "".join(DOCS)  # inputs of consecutive blocks tile the stream; EOS/pad decode to ""


def test_resolve_data_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="synthetic"):
        resolve_data_files(str(tmp_path / "nothing*.jsonl"))
    _write(tmp_path, "text")
    _write(tmp_path, "json")
    with pytest.raises(ValueError, match="mix formats"):
        resolve_data_files(str(tmp_path))
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="Unknown data file type"):
        resolve_data_files(str(tmp_path / "notes.csv"))
    assert resolve_data_files(str(tmp_path / "*.jsonl"))[0] == "json"


def test_missing_text_field_is_a_clear_error(tmp_path):
    pytest.importorskip("datasets")
    path = _write(tmp_path, "json")
    with pytest.raises(ValueError, match=r"Column 'text' not found.*content"):
        load_text_documents(path, cache_dir=str(tmp_path / "cache"))

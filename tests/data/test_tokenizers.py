"""Tokenizers: the byte tokenizer and a locally built HF tokenizer folder behind the same protocol."""

from __future__ import annotations

import pytest

from lightning_flagscale.data import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_special_ids():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (256, 0, 0, None)
    text = "count from 3: 3 4 5. héllo ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 < i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text  # EOS/padding dropped
    with pytest.raises(ValueError, match="NUL"):
        tok.encode("a\x00b")
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([300])


def test_load_tokenizer_rejects_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="local Hugging Face tokenizer folder"):
        load_tokenizer(str(tmp_path / "missing"))


def _save_word_level_tokenizer(path, with_bos: bool) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "</s>"] + (["<s>"] if with_bos else [])
    raw = RawTokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the cat sat on the mat", "the dog ate the bone", "a cat and a dog"]
    raw.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    kwargs = {"bos_token": "<s>"} if with_bos else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", **kwargs
    )
    fast.save_pretrained(path)


@pytest.mark.parametrize("with_bos", [False, True])
def test_hf_tokenizer_from_local_folder(tmp_path, with_bos):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    _save_word_level_tokenizer(tmp_path, with_bos)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.encode("the cat sat")
    assert len(ids) == 3 and tok.eos_id not in ids  # no special tokens added by encode
    assert tok.decode([*ids, tok.eos_id]) == "the cat sat"
    assert tok.vocab_size == (4 if with_bos else 3) + 10  # special tokens + the 10 distinct words
    assert tok.pad_id == 1 and tok.eos_id == 2
    assert tok.bos_id == (3 if with_bos else None)

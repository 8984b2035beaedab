"""Tokenizers: NullTokenizer, sentencepiece trained for code (exact round trip), local HF tokenizers."""
import json
import sys

import pytest
from testlib import TOOLS

from megatron_cai.training.tokenizer import (
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)

sys.path.insert(0, TOOLS)

CODE = [
    "def f(x):\n\tif x:\n        return [i ** 2 for i in range(x)]  # squares\n\n\n",
    "class A:\n    '''Doc with unicode: café, naïve, 日本語, emoji 😀.'''\n    pass\r\n",
    "   leading spaces and trailing spaces   \n\n  \t mixed \t whitespace\n",
    "x = {'a': 1,   'b': [1, 2, 3]}\nprint(x['a'] + 12345678)\n",
]


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.tokenize(" 1 2\n 99 ") == [1, 2, 99]
    assert tok.detokenize([3, 4]) == "3 4"
    assert tok.eod == 100 and tok.vocab_size == 101 and tok.pad is None
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("1 x")


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        build_tokenizer("BertWordPieceCase")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        build_tokenizer("HuggingFaceTokenizer", "gpt2")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", str(bad))


def test_vocab_size_with_padding():
    assert vocab_size_with_padding(50257, 128, 1) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(256, 128, 1) == 256


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    from train_tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "code.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(200):
            for doc in CODE:
                f.write(json.dumps({"text": doc.replace("x", f"x{i % 7}")}) + "\n")
    summary = train_tokenizer([str(corpus)], str(d / "tok"), vocab_size=400, verify_docs=50,
                              log=lambda m: None)
    assert summary["roundtrip_failures"] == 0 and summary["roundtrip_checked"] == 50
    return str(d / "tok.model")


def test_sentencepiece_code_round_trip_and_special_ids(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 400
    assert (tok.eod, tok.bos, tok.pad) == (2, 1, 3)
    assert tok.id_to_piece(tok.eod) == "</s>"
    unseen = "def g(y):\n\n    while y > 0:\n\t\ty -= 1  # Ωmega ✓\n    return 'done'\r\n"
    for text in CODE + [unseen, "", " ", "\n\n\n"]:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # A newline is a single piece; indentation is kept as whitespace pieces.
    newline = tok.tokenize("\n")
    assert len(newline) == 1 and tok.id_to_piece(newline[0]) == "\n"
    assert tok.eod not in tok.tokenize(CODE[0])


def test_huggingface_tokenizer_json_and_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "!": 5}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = build_tokenizer("HuggingFaceTokenizer", path)
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.tokenize("hello world !") == [3, 4, 5]
    assert tok.eod == 1 and tok.pad == 2 and tok.vocab_size == 6
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "dir"))
    tok2 = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "dir"))
    assert tok2.tokenize("hello world") == [3, 4]
    assert tok2.eod == 1 and tok2.pad == 2 and tok2.vocab_size == 6


def test_train_tokenizer_input_errors(tmp_path):
    from train_tokenizer import TrainTokenizerError, train_tokenizer

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a b"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(TrainTokenizerError, match=r"bad.jsonl:2: missing key 'text'"):
        train_tokenizer([str(bad)], str(tmp_path / "t"), vocab_size=300, log=lambda m: None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(TrainTokenizerError, match="no documents"):
        train_tokenizer([str(empty)], str(tmp_path / "t"), vocab_size=300, log=lambda m: None)
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "tiny corpus"}) + "\n")
    with pytest.raises(TrainTokenizerError, match="Vocabulary size too high"):
        train_tokenizer([str(small)], str(tmp_path / "t"), vocab_size=5000, log=lambda m: None)
    assert not (tmp_path / "t.model").exists()

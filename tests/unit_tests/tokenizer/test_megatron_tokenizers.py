"""Megatron's tokenizer types: GPT2BPETokenizer (ids equal to transformers' GPT2Tokenizer on the same files),
Llama2Tokenizer / GPTSentencePieceTokenizer (against sentencepiece), TikTokenizer (against megatron-core's own
TikTokenTokenizer), and preprocess_data.py writing them."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from testlib import ROOT

from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
from megatron_cai.training.tokenizer import build_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026!",
    "def main():\n    return 42  # answer\n\n\tTabs and  double  spaces",
    "Ünïcödé façade — naïve café; 東京 and emoji 🙂 too",
    "numbers 1234567 and punctuation?!... (parentheses) [brackets] {braces}",
    "  leading spaces, trailing spaces   ",
] * 20
TEXTS = CORPUS[:5] + ["", " ", "unseen wordz: zyxwv qqq", "<|endoftext|> literal", "line\r\nbreaks\n\n\n"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny byte-level BPE trained with `tokenizers`, saved as GPT-2's vocab.json / merges.txt."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def _byte_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (encoder.py's bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _openai_gpt2_encode(text: str, vocab: dict, merges: list[tuple[str, str]]) -> list[int]:
    """OpenAI's GPT-2 encoder.py algorithm written out: regex split, bytes -> unicode, lowest-rank merge first."""
    import regex

    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    table, ranks, ids = _byte_unicode(), {m: i for i, m in enumerate(merges)}, []
    for piece in pat.findall(text):
        word = [table[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            rank, _ = min(pairs)
            if rank == 1 << 30:
                break
            first, second = merges[rank]
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    out.append(first + second)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        ids += [vocab[w] for w in word]
    return ids


def test_gpt2bpe_ids_match_transformers_gpt2_tokenizer(gpt2_files):
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ref = GPT2Tokenizer.from_pretrained(os.path.dirname(vocab), local_files_only=True)
    merge_list = [tuple(line.split(" ")) for line in open(merges, encoding="utf-8").read().splitlines()[1:] if line]
    vocab_map = json.load(open(vocab))
    assert ours.vocab_size == len(json.load(open(vocab)))
    assert ours.eod == json.load(open(vocab))["<|endoftext|>"]
    for text in TEXTS:
        if "<|endoftext|>" in text:
            continue  # transformers splits its registered special token out; Megatron's GPT-2 BPE does not
        ids = ours.tokenize(text)
        assert ids == ref.encode(text, add_special_tokens=False), repr(text)
        assert ids == _openai_gpt2_encode(text, vocab_map, merge_list), repr(text)
        assert ours.detokenize(ids) == text
    assert len(ours.tokenize(CORPUS[0])) < len(CORPUS[0].encode())  # merges are applied


def test_gpt2bpe_missing_files_are_named(tmp_path, gpt2_files):
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0])
    with pytest.raises(FileNotFoundError, match="--vocab-file .*nope.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file=gpt2_files[1])


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 5), model_prefix=str(d / "m"), vocab_size=80,
                                   character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    return str(d / "m.model")


def test_llama2_prepends_bos_and_gpt_sentencepiece_is_plain(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    llama = build_tokenizer("Llama2Tokenizer", sp_model)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    for text in TEXTS:
        assert llama.tokenize(text) == [sp.bos_id()] + sp.encode(text)
        assert gpt.tokenize(text) == sp.encode(text)
    assert llama.eod == gpt.eod == sp.eos_id() and llama.vocab_size == sp.get_piece_size()


def _tiktoken_json(path, gpt2_files):
    """Megatron's tiktoken vocabulary JSON: the 256 bytes, then the BPE merges in rank order."""
    _, merges = gpt2_files
    unicode_to_byte = {u: b for b, u in _byte_unicode().items()}
    entries = [bytes([i]) for i in range(256)]
    for line in open(merges, encoding="utf-8").read().splitlines()[1:]:
        a, b = line.split(" ")
        merged = bytes(unicode_to_byte[ch] for ch in a + b)
        if merged not in entries:
            entries.append(merged)
    with open(path, "w") as f:
        json.dump([{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
                   for i, t in enumerate(entries)], f)
    return len(entries)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_megatron_core(tmp_path, gpt2_files, pattern):
    pytest.importorskip("tiktoken")
    mod = pytest.importorskip("megatron.core.tokenizers.text.libraries.tiktoken_tokenizer")
    path = str(tmp_path / "tiktoken.json")
    n = _tiktoken_json(path, gpt2_files)
    theirs = mod.TikTokenTokenizer(path, num_special_tokens=100, pattern=pattern, vocab_size=n + 100)
    ours = build_tokenizer("TikTokenizer", path, tiktoken_pattern=pattern, tiktoken_num_special_tokens=100)
    assert ours.vocab_size == n + 100
    assert (ours.eod, ours.bos, ours.pad) == (theirs.eos_id, theirs.bos_id, theirs.pad_id)
    for text in TEXTS + ["<s> and </s> as text"]:
        assert ours.tokenize(text) == theirs.text_to_ids(text), repr(text)
        assert ours.detokenize(ours.tokenize(text)) == text


def test_preprocess_data_writes_gpt2bpe_ids(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:5]))
    out = str(tmp_path / "out")
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", out,
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                    "--append-eod", "--no-progress"], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": ROOT})
    ds = IndexedDataset(out + "_text_document")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert ds.dtype == np.uint16
    for i, text in enumerate(CORPUS[:5]):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]

#!/usr/bin/env python
"""Train a sentencepiece tokenizer on a JSONL corpus, with settings that suit source code.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --vocab-size 4096 --model-prefix data/tok

Writes ``<model-prefix>.model`` and ``<model-prefix>.vocab``. Defaults: BPE, byte fallback (no
unknown tokens), identity normalization, whitespace and newlines kept (``"\\n"`` is its own piece,
runs of spaces become pieces), no dummy prefix, digits split. Ids 0-3 are ``<unk> <s> </s> <pad>``;
``</s>`` (id 2) is the EOD token. After training, documents are checked to round-trip through
tokenize/detokenize exactly; a mismatch fails the run. The one known exception is text containing
U+2581 ("▁"), sentencepiece's whitespace marker, which detokenizes to a space.

Each document is one sentencepiece "sentence". Corpora larger than ``--max-train-mb`` are sampled
deterministically (``--seed``) so training stays fast.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from preprocess_data import BadLine, iter_jsonl_lines, parse_json_line  # noqa: E402

from megatron_cai.training.tokenizer import SentencePieceTokenizer  # noqa: E402

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


class TrainTokenizerError(RuntimeError):
    """Bad input or a failed training run."""


def iter_documents(paths: Sequence[str], keys: Sequence[str], skip_bad_lines: bool = False,
                   stats: dict | None = None) -> Iterator[str]:
    """Every non-empty string under ``keys`` in the JSONL files (bad lines raise or are counted)."""
    stats = stats if stats is not None else {}
    stats.setdefault("bad_lines", 0)
    for path in paths:
        if not os.path.isfile(path):
            raise TrainTokenizerError(f"--input {path}: file not found")
        for line_no, raw in iter_jsonl_lines(path):
            try:
                fields = parse_json_line(raw, keys)
            except BadLine as e:
                if not skip_bad_lines:
                    raise TrainTokenizerError(f"{path}:{line_no}: {e}") from None
                stats["bad_lines"] += 1
                continue
            for text in (fields or {}).values():
                if text:
                    yield text


def sample_documents(docs: Iterator[str], keep_fraction: float, seed: int) -> Iterator[str]:
    """Keep each document with probability ``keep_fraction`` (deterministic for a seed)."""
    if keep_fraction >= 1.0:
        yield from docs
        return
    rng = np.random.RandomState(seed)
    for doc in docs:
        if rng.random_sample() < keep_fraction:
            yield doc


def train_tokenizer(inputs: Sequence[str], model_prefix: str, vocab_size: int = 8192,
                    json_keys: Sequence[str] = ("text",), model_type: str = "bpe",
                    character_coverage: float = 0.9995, max_train_mb: float = 64.0, seed: int = 1234,
                    max_sentence_length: int = 1 << 20, num_threads: int | None = None,
                    verify_docs: int = 1000, skip_bad_lines: bool = False, log=print) -> dict:
    """Train ``<model_prefix>.model`` and verify the round trip; returns a summary dict."""
    import sentencepiece as spm

    t0 = time.time()
    total_bytes = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p))
    keep = min(1.0, max_train_mb * 1e6 / max(total_bytes, 1))
    stats: dict = {}
    counted = {"docs": 0, "bytes": 0}

    input_error: list[TrainTokenizerError] = []

    def training_docs() -> Iterator[str]:
        try:
            for doc in sample_documents(iter_documents(inputs, json_keys, skip_bad_lines, stats), keep, seed):
                counted["docs"] += 1
                counted["bytes"] += len(doc.encode("utf-8"))
                yield doc
        except TrainTokenizerError as e:  # re-raised below, not as a sentencepiece failure
            input_error.append(e)
            raise

    model = io.BytesIO()
    log(f"training a {model_type} sentencepiece model (vocab {vocab_size}) on {total_bytes / 1e6:.2f} MB "
        f"of JSONL" + (f", sampling {keep:.1%} of documents" if keep < 1 else ""))
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_docs(), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=["\n"],
            max_sentence_length=max_sentence_length, input_sentence_size=0,
            num_threads=num_threads or min(os.cpu_count() or 1, 16), minloglevel=2, **SPECIAL_IDS,
        )
    except (RuntimeError, TrainTokenizerError) as e:
        if input_error:
            raise input_error[0] from None
        if counted["docs"] == 0:
            raise TrainTokenizerError(f"no documents with keys {list(json_keys)} in {list(inputs)}") from None
        raise TrainTokenizerError(f"sentencepiece training failed: {e}") from None
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{model_prefix}.model.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, model_prefix + ".model")
    tok = SentencePieceTokenizer(model_prefix + ".model")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with open(model_prefix + ".vocab", "w", encoding="utf-8") as f:  # piece<TAB>score, as spm writes it
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i).replace(chr(10), chr(92) + 'n')}\t{sp.get_score(i):g}\n")
    train_seconds = time.time() - t0

    checked = failures = chars = tokens = 0
    first_failure = None
    for doc in iter_documents(inputs, json_keys, skip_bad_lines=True):
        if checked >= verify_docs:
            break
        ids = tok.tokenize(doc)
        checked += 1
        chars += len(doc)
        tokens += len(ids)
        if tok.detokenize(ids) != doc:
            failures += 1
            first_failure = first_failure or doc[:80]
    summary = {
        "model": model_prefix + ".model", "vocab_size": tok.vocab_size, "eod": tok.eod,
        "train_docs": counted["docs"], "train_mb": counted["bytes"] / 1e6, "bad_lines": stats["bad_lines"],
        "seconds": train_seconds, "roundtrip_checked": checked, "roundtrip_failures": failures,
        "chars_per_token": chars / max(tokens, 1),
    }
    log(f"wrote {summary['model']} (vocab {tok.vocab_size}, EOD id {tok.eod}) from {counted['docs']} docs "
        f"({summary['train_mb']:.2f} MB, {stats['bad_lines']} bad lines skipped) in {train_seconds:.1f} s; "
        f"{summary['chars_per_token']:.2f} chars/token; round trip exact on {checked - failures}/{checked} "
        f"documents")
    if failures:
        raise TrainTokenizerError(
            f"{failures}/{checked} documents do not round-trip through tokenize/detokenize "
            f"(first: {first_failure!r}); text containing U+2581 cannot round-trip with sentencepiece"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL file(s)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--max-train-mb", type=float, default=64.0,
                        help="sample documents (deterministically) down to about this many MB")
    parser.add_argument("--seed", type=int, default=1234, help="document sampling seed")
    parser.add_argument("--max-sentence-length", type=int, default=1 << 20,
                        help="documents longer than this many bytes are left out of training")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--verify-docs", type=int, default=1000,
                        help="documents checked for an exact round trip")
    parser.add_argument("--skip-bad-lines", action="store_true")
    args = parser.parse_args(argv)
    try:
        train_tokenizer(args.input, args.model_prefix, args.vocab_size, args.json_keys, args.model_type,
                        args.character_coverage, args.max_train_mb, args.seed, args.max_sentence_length,
                        args.num_threads, args.verify_docs, args.skip_bad_lines)
    except TrainTokenizerError as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

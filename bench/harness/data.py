"""The data the benches train on, built once per cache folder with the repository's own tools.

- ``demo_corpus``: ``tools/make_demo_corpus.py`` (the Python standard library's sources, no download) ->
  ``tools/train_tokenizer.py`` (sentencepiece BPE) -> ``tools/preprocess_data.py`` (Megatron's .bin/.idx);
- ``demo_trees``: the same sources as trees (module header -> top-level definitions -> methods), split
  into header-sharing trees of about ``max_tree_kb``, preprocessed with ``--tree`` (a ``.tree`` sidecar).

Files are keyed by their inputs (corpus size, vocabulary), so benches sharing a cache share the data and
never read data built with other settings. ``QUICK`` is the size every ``--quick`` mode uses; a corpus under
1 MB is cut into documents of about 1 KB (``make_demo_corpus.py --max-doc-kb 1``), so that even its small
validation and test splits hold documents.
"""
from __future__ import annotations

import os
import subprocess
import sys

from harness.flags import BENCH

ROOT = os.path.dirname(BENCH)
QUICK = {"corpus_mb": 0.3, "vocab": 512}


def tool(name: str, *args) -> str:
    """Run ``tools/NAME`` with this interpreter; its output, or an error with the end of its log."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tools/{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def demo_corpus(cache: str, vocab: int = 4096, max_mb: float = 4.0) -> tuple[str, str]:
    """(data prefix, tokenizer model) of the demo corpus of ``max_mb`` MB with a ``vocab`` tokenizer."""
    os.makedirs(cache, exist_ok=True)
    corpus = os.path.join(cache, f"demo_{max_mb:g}mb.jsonl")
    tok = os.path.join(cache, f"tok_{max_mb:g}mb_{vocab}")
    prefix = os.path.join(cache, f"demo_{max_mb:g}mb_{vocab}")
    if not os.path.exists(corpus):
        short = ["--max-doc-kb", 1] if max_mb < 1 else []
        tool("make_demo_corpus.py", "--output", corpus, "--max-mb", max_mb, *short)
    if not os.path.exists(tok + ".model"):
        tool("train_tokenizer.py", "--input", corpus, "--vocab-size", vocab, "--model-prefix", tok)
    if not os.path.exists(prefix + "_text_document.idx"):
        tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", tok + ".model", "--append-eod", "--workers", 2,
             "--no-progress")
    return prefix + "_text_document", tok + ".model"


def demo_trees(cache: str, max_mb: float = 2.0, vocab: int = 2048, max_tree_kb: float | None = None) -> dict:
    """Paths of the tree JSONL, the tokenizer (trained on the plain corpus) and the preprocessed tree prefix.

    ``max_tree_kb``: split modules into header-sharing trees of about that size, so that trees fit training
    rows; None keeps one tree per module."""
    os.makedirs(cache, exist_ok=True)
    split = "" if max_tree_kb is None else f"_split{max_tree_kb:g}kb"
    trees = os.path.join(cache, f"trees_{max_mb:g}mb{split}.jsonl")
    prefix = os.path.join(cache, f"trees_{max_mb:g}mb{split}_{vocab}")
    _, tok = demo_corpus(cache, vocab, max_mb)
    if not os.path.exists(trees):
        extra = [] if max_tree_kb is None else ["--max-tree-kb", max_tree_kb]
        tool("make_demo_corpus.py", "--tree", "--output", trees, "--max-mb", max_mb, *extra)
    if not os.path.exists(prefix + "_text_document.idx"):
        print(tool("preprocess_data.py", "--tree", "--input", trees, "--output-prefix", prefix, "--tokenizer-type",
                   "SentencePieceTokenizer", "--tokenizer-model", tok, "--append-eod", "--workers", 2), end="")
    return {"jsonl": trees, "tokenizer": tok, "prefix": prefix + "_text_document"}

"""Build (or reuse) the demo tree corpus through the real CLIs, for the tree benchmarks.

    tools/make_demo_corpus.py            plain stdlib corpus  -> tokenizer training text
    tools/train_tokenizer.py             sentencepiece BPE (EOD = </s>)
    tools/make_demo_corpus.py --tree     module header -> top-level definitions -> methods
    tools/preprocess_data.py --tree      <workdir>/trees_text_document.{bin,idx,tree}, EOD ending every leaf

``python bench/tree_corpus.py --workdir DIR`` prints the prefix; the files are reused when present.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str, *args) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def build_demo_tree_data(workdir: str, max_mb: float = 2.0, vocab_size: int = 2048,
                         max_tree_kb: float | None = None) -> dict[str, str]:
    """Paths of the tree JSONL, the tokenizer model and the preprocessed tree prefix (built once).

    ``max_tree_kb``: split modules into header-sharing trees of about that size (make_demo_corpus.py
    --max-tree-kb), so that trees fit training rows; None keeps one tree per module.
    """
    os.makedirs(workdir, exist_ok=True)
    plain = os.path.join(workdir, "stdlib.jsonl")
    trees = os.path.join(workdir, "stdlib_trees.jsonl")
    tok = os.path.join(workdir, "tok")
    prefix = os.path.join(workdir, "trees_text_document")
    if not os.path.exists(plain):
        _tool("make_demo_corpus.py", "--output", plain, "--max-mb", max_mb)
    if not os.path.exists(trees):
        extra = [] if max_tree_kb is None else ["--max-tree-kb", max_tree_kb]
        _tool("make_demo_corpus.py", "--tree", "--output", trees, "--max-mb", max_mb, *extra)
    if not os.path.exists(tok + ".model"):
        _tool("train_tokenizer.py", "--input", plain, "--vocab-size", vocab_size, "--model-prefix", tok)
    if not os.path.exists(prefix + ".idx"):
        print(_tool("preprocess_data.py", "--tree", "--input", trees, "--output-prefix", os.path.join(workdir, "trees"),
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok + ".model",
                    "--append-eod", "--workers", 2), end="")
    return {"jsonl": trees, "tokenizer": tok + ".model", "prefix": prefix}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/megatron_cai_tree_bench")
    ap.add_argument("--max-mb", type=float, default=2.0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--max-tree-kb", type=float, default=None)
    args = ap.parse_args()
    print(build_demo_tree_data(args.workdir, args.max_mb, args.vocab_size, args.max_tree_kb)["prefix"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build (once) and cache the demo corpus, tokenizer and .bin/.idx that the benchmarks train on."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("BENCH_CACHE", os.path.join(ROOT, "bench", ".cache"))


def ensure_demo_data(vocab_size: int = 4096, cache: str = CACHE) -> tuple[str, str]:
    """Return (data prefix, tokenizer model), building them with the repo's tools if missing."""
    os.makedirs(cache, exist_ok=True)
    jsonl = os.path.join(cache, "demo.jsonl")
    tok = os.path.join(cache, f"tok{vocab_size}")
    prefix = os.path.join(cache, f"demo{vocab_size}")
    py = sys.executable
    if not os.path.exists(jsonl):
        subprocess.run([py, "tools/make_demo_corpus.py", "--output", jsonl], cwd=ROOT, check=True)
    if not os.path.exists(tok + ".model"):
        subprocess.run([py, "tools/train_tokenizer.py", "--input", jsonl, "--vocab-size", str(vocab_size),
                        "--model-prefix", tok], cwd=ROOT, check=True)
    if not os.path.exists(prefix + "_text_document.idx"):
        subprocess.run([py, "tools/preprocess_data.py", "--input", jsonl, "--output-prefix", prefix,
                        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok + ".model",
                        "--append-eod", "--workers", "2", "--no-progress"], cwd=ROOT, check=True)
    return prefix + "_text_document", tok + ".model"

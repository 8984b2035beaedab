"""Fixtures for the distillation tests: a tiny preprocessed corpus, a teacher checkpoint, a dump."""
from __future__ import annotations

import os
import sys

import numpy as np

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder
from testlib import TOOLS

if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import dump_teacher_samples as dump_tool  # noqa: E402

VOCAB = 99  # NullTokenizer ids [0, 99) and EOD 99: a vocabulary of 100, padded to 104 (or 112 under TP=2)
SEQ = 16
MODEL = ["--squared-relu",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0",
         "--make-vocab-size-divisible-by", "8", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]
DATA = ["--split", "90,10,0", "--seq-length", str(SEQ), "--seed", "11", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB)]


def write_corpus(prefix: str, num_docs: int = 60, seed: int = 0, vocab: int = VOCAB) -> str:
    """Arithmetic token sequences with 10% noise, each document ending with EOD (= vocab); returns prefix."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(10, 40))
        a, b = int(rng.integers(1, 6)), int(rng.integers(0, vocab))
        doc = (a * np.arange(n) + b) % vocab
        noise = rng.random(n) < 0.1
        doc[noise] = rng.integers(0, vocab, int(noise.sum()))
        builder.add_document(np.append(doc, vocab))
    builder.finalize(prefix + ".idx")
    return prefix


def train_argv(prefix: str, iters: int, extra: list[str] = (), gbs: int = 4, mbs: int = 2) -> list[str]:
    return MODEL + DATA + ["--data-path", prefix, "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
                           "--train-iters", str(iters), "--lr", "3e-3", "--log-interval", "100",
                           "--eval-interval", "0", "--eval-iters", "0", *extra]


def make_teacher(prefix: str, save: str) -> str:
    """Train the tiny teacher a few iterations on the corpus (in this process) and save it."""
    from testlib.train import train

    train(train_argv(prefix, 4, ["--save", save, "--lr", "1e-2"]))
    ps.destroy_model_parallel()
    return save


def dump_argv(teacher: str, prefix: str, out: str, iters: int, extra: list[str] = (), gbs: int = 4) -> list[str]:
    """Flags of tools/dump_teacher_samples.py for a student run of ``iters`` x ``gbs`` samples."""
    return ["--load", teacher, "--output", out, "--data-path", prefix, *DATA, "--train-iters", str(iters),
            "--global-batch-size", str(gbs), "--k", "8", "--shard-size", "5", "--micro-batch-size", "3",
            "--no-progress", *extra]


def run_dump(argv: list[str]) -> int:
    return dump_tool.main(argv)

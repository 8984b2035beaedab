"""Acceptance: fp16 with the dynamic loss scaler ends within 1% of bf16's loss after 200 iterations on the demo
corpus (slow: run with -m slow; bench/fp16_training.py gives the same comparison as a table)."""
import argparse
import os
import sys

import pytest
from testlib import ROOT


@pytest.mark.slow
def test_fp16_within_one_percent_of_bf16(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from fp16_training import run_one
    from harness.data import demo_corpus

    opts = argparse.Namespace(layers=2, hidden=64, heads=4, seq=64, batch=8, iters=200, lr=1e-3, vocab=4096,
                              final_eval_iters=10, cache_dir=str(tmp_path))
    data, tok = demo_corpus(str(tmp_path), opts.vocab, 4.0)
    bf16 = run_one("bf16", opts, data, tok, 1234)
    fp16 = run_one("fp16", opts, data, tok, 1234)
    assert fp16["skipped"] > 0  # the scaler started at 2**32 and backed off
    assert fp16["final_valid_loss"] == pytest.approx(bf16["final_valid_loss"], rel=0.01)

"""examples/quickstart_summary.py reads the quickstart's logs as the Trainer writes them (the real log-line
formatters), and its figures match hand computations and a brute-force count of documents per row."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from testlib import ROOT

from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_cai.training.logging import parameter_count_line, training_log_line, validation_log_lines

sys.path.insert(0, os.path.join(ROOT, "examples"))

import quickstart_summary as S  # noqa: E402


def _log(path, iterations, losses, nbytes, params=None, valid=None):
    lines = [parameter_count_line(params)] if params else []
    for it, loss in zip(iterations, losses):
        lines.append(training_log_line(iteration=it, train_iters=20, consumed=8 * it, ms_per_iter=50.0, lr=1e-3,
                                       global_batch=8, losses={"lm loss": loss}, grad_norm=1.0, skipped=0,
                                       tokens_per_sec=1000.0, grad_comm_bytes=nbytes, loss_scale=1.0, nan_iters=0))
    if valid:
        lines.append(validation_log_lines(valid[0], {"lm loss": valid[1]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_summary_from_real_log_lines(tmp_path):
    a = _log(tmp_path / "a.log", [5, 10], [8.0, 6.5], 62113, params=165632)
    b = _log(tmp_path / "b.log", [15, 20], [5.0, 4.0], 62113, valid=(20, 4.25))
    logs = S.parse_logs([a, b])
    assert logs["params"] == 165632 and logs["valid"] == [(20, 4.25)]
    assert [t[:2] for t in logs["train"]] == [(5, 8.0), (10, 6.5), (15, 5.0), (20, 4.0)]
    text = "\n".join(S.summary(logs, 2, "reduce-scatter", (10, 1000, 3.55), 256, "def f(): pass", 123))
    assert "8.000 at iteration 5 -> 4.000 at iteration 20 (50% lower)" in text
    assert "validation lm loss at iteration 20: 4.250" in text
    # bf16 reduce-scatter at DP = 2: (2 - 1) / 2 x 2 bytes x 165,632 = 165,632 bytes; 62,113 / 165,632 = 0.375.
    assert "62,113 sent with Squinch" in text
    assert "sends 165,632:\n  Squinch sends 0.375 of that (2.67x fewer bytes)" in text
    assert "10 documents of 100 tokens on average" in text and "holds 3.5 of them" in text
    assert text.rstrip().endswith("123 s (installs included)")


def test_bf16_bytes_by_hand():
    assert S.bf16_bytes(1000, 4, "reduce-scatter") == 0.75 * 2 * 1000
    assert S.bf16_bytes(1000, 4, "all-reduce") == 2 * 0.75 * 2 * 1000
    assert S.bf16_bytes(1000, 1, "all-reduce") == 0


def test_a_log_without_training_lines_is_an_error(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no training log line"):
        S.parse_logs([str(empty)])


def test_documents_per_row_against_every_window(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=400)
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for n in lengths:
        builder.add_item(np.zeros(n, dtype=np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    docs, tokens, per_row = S.documents_per_row(prefix, 32)
    assert (docs, tokens) == (400, int(lengths.sum()))
    owner = np.repeat(np.arange(len(lengths)), lengths)  # the document of every token
    touched = [len(set(owner[s:s + 32])) for s in range(tokens - 32 + 1)]
    assert per_row == pytest.approx(np.mean(touched), rel=0.02)

"""What every bench in bench/ shares, so that a bench is only its measurement and its report.

- ``flags``: the parser (``--quick``, ``--out``, ``--cache-dir``, ``--from-json``) and the shared model-size
  and run flags (``add``), each defined once;
- ``results``: ``Results`` writes ``PREFIX.json`` + ``PREFIX.md`` (+ ``PREFIX.png``) with the machine's load
  recorded, keeps every finished row in ``PREFIX.rows.json`` as it finishes (an interrupted run keeps its
  rows and resumes), and rewrites the markdown from a saved JSON (``--from-json``);
- ``stats``: alternation of configurations, medians with their spread, means over seeds and paired gaps;
- ``data``: the demo corpus, tokenizer and ``.bin/.idx`` (plain or trees), built once per cache;
- ``training``: a ``Trainer`` from Megatron flags through ``pretrain_gpt``'s public pieces, evaluation on
  fixed batches, training in chunks;
- ``runcache``: one JSON per finished (configuration, seed), shared by concurrent processes;
- ``quick``: runs every bench's ``--quick`` mode in one process (what CI runs).

Importing it puts the repository root on ``sys.path`` (benches import ``megatron_cai`` and ``pretrain_gpt``).
"""
from __future__ import annotations

import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")
for _path in (ROOT, BENCH):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from harness.flags import add, parse, parser  # noqa: E402
from harness.results import Results, machine  # noqa: E402
from harness.stats import (  # noqa: E402
    alternate,
    count_spikes,
    fmt_pm,
    mean_std,
    paired_gap,
    seed_summary,
    spread,
)

__all__ = ["BENCH", "RESULTS", "ROOT", "Results", "add", "alternate", "count_spikes", "fmt_pm", "machine",
           "mean_std", "paired_gap", "parse", "parser", "seed_summary", "spread"]

"""The benches' command lines: one parser shape, and every flag that several benches share defined once.

    p = H.parser(__doc__, "zreg_bf16")                       # --quick, --out, --cache-dir, --from-json
    H.add(p, layers=2, hidden=32, heads=2, seq=64, seeds=[1, 2, 3])   # shared flags, this bench's defaults
    p.add_argument(...)                                      # what only this bench has
    opts = H.parse(p, argv, quick=dict(layers=1, seq=32))    # --quick: these values, and output off results/

A bench's ``--quick`` mode runs every part of it at toy size in seconds (CI runs them all); unless ``--out``
is given it writes under ``bench/.cache/quick/``, never into ``bench/results/``.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(BENCH, "results")
QUICK_OUT = os.path.join(BENCH, ".cache", "quick")
CACHE = "/tmp/megatron_cai_bench"

# name: (type, nargs, help). Flags are --name-with-dashes.
SHARED: dict[str, tuple[type, str | None, str]] = {
    "layers": (int, None, "transformer layers"),
    "hidden": (int, None, "hidden size"),
    "heads": (int, None, "attention heads"),
    "seq": (int, None, "sequence length"),
    "seq_length": (int, None, "sequence length"),
    "batch": (int, None, "global (= micro) batch size"),
    "vocab": (int, None, "demo tokenizer vocabulary"),
    "vocab_size": (int, None, "demo tokenizer vocabulary"),
    "corpus_mb": (float, None, "demo corpus size in MB (the standard library's sources)"),
    "iters": (int, None, "training iterations"),
    "lr": (float, None, "peak learning rate (cosine decay to a tenth)"),
    "seed": (int, None, "random seed"),
    "seeds": (int, "+", "seeds: each sets the initialisation (and the data order where the bench says so)"),
    "eval_interval": (int, None, "iterations between validation evaluations"),
    "eval_iters": (int, None, "validation batches per evaluation"),
    "final_eval_iters": (int, None, "validation batches of the final evaluation (fixed batches)"),
    "repeats": (int, None, "alternated repeats per configuration; figures are medians with min-max"),
    "steps": (int, None, "timed steps per repeat"),
    "rounds": (int, None, "alternated timing rounds"),
    "dp": (int, "*", "data-parallel sizes"),
    "threads": (int, None, "torch intra-op threads (default: torch's)"),
    "teacher": (str, None, "teacher shape: layers,hidden,heads"),
    "student": (str, None, "student shape: layers,hidden,heads"),
    "teacher_iters": (int, None, "teacher training iterations"),
    "student_iters": (int, None, "student training iterations"),
    "alpha": (float, None, "KD weight in (1 - alpha) CE + alpha KD"),
}


def parser(doc: str | None, name: str, *, from_json: bool = True) -> argparse.ArgumentParser:
    """The parser of ``bench/NAME.py``: its docstring as help, ``--quick``, ``--out`` (bench/results/NAME),
    ``--cache-dir`` (built data, finished runs, scratch files) and ``--from-json`` (rewrite the report,
    measure nothing). Every bench takes these four."""
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(bench=name)
    p.add_argument("--quick", action="store_true",
                   help="every part at toy size, in seconds (what CI runs); writes under bench/.cache/quick/ "
                        "unless --out")
    p.add_argument("--out", default=os.path.join(RESULTS, name),
                   help="output prefix: PREFIX.json, PREFIX.md (and PREFIX.png) (default: bench/results/NAME)")
    p.add_argument("--cache-dir", default=os.path.join(CACHE, name),
                   help="where built data, finished runs and scratch files are kept between runs")
    if from_json:
        p.add_argument("--from-json", "--replot", dest="from_json", action="store_true",
                       help="measure nothing: rewrite PREFIX.md (and PREFIX.png) from PREFIX.json")
    return p


def add(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add the shared flags named by ``defaults`` (see ``SHARED``), with these defaults."""
    for name, default in defaults.items():
        kind, nargs, text = SHARED[name]
        p.add_argument("--" + name.replace("_", "-"), type=kind, nargs=nargs, default=default, help=text)


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None,
          quick: dict[str, Any] | Callable[[argparse.Namespace], None] | None = None) -> argparse.Namespace:
    """Parse; under ``--quick`` apply ``quick`` (values, or a function of the options) and move the default
    output to bench/.cache/quick/NAME."""
    opts = p.parse_args(argv)
    if opts.quick:
        if callable(quick):
            quick(opts)
        else:
            for key, value in (quick or {}).items():
                setattr(opts, key, value)
        if opts.out == p.get_default("out"):
            opts.out = os.path.join(QUICK_OUT, opts.bench)
    return opts

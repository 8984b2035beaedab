#!/usr/bin/env python
"""Write a JSONL corpus from the Python standard library's own source files (no download).

Each line is ``{"text": <file contents>, "path": <path relative to the stdlib>}``. Files come from
``sysconfig.get_paths()["stdlib"]`` of the running interpreter (site-packages, test suites and
caches excluded), ordered by the MD5 of their relative path (a deterministic mix of modules,
independent of file-system order) and taken until ``--max-mb`` is reached. The same interpreter
version always gives the same corpus.

    python tools/make_demo_corpus.py --output data/stdlib.jsonl --max-mb 4
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                 "lib2to3", "ensurepip", "turtledemo"}


def stdlib_dir() -> str:
    """The interpreter's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str, max_file_kb: int) -> list[str]:
    """Relative paths of ``*.py`` files under ``root`` (excluded dirs pruned), in MD5 order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("."))
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or os.path.getsize(full) > max_file_kb * 1024:
                continue
            found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(found, key=lambda p: (hashlib.md5(p.encode()).hexdigest(), p))


def file_records(root: str, relpath: str) -> Iterator[dict]:
    """The JSONL records of one source file: one ``{"text", "path"}`` document.

    This is the hook for a later ``--tree`` mode (documents as trees of nested code blocks for the
    tree-structured visibility masks); it would yield tree-shaped records here instead.
    """
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        text = f.read()
    if text.strip():
        yield {"text": text, "path": relpath}


def make_corpus(output: str, max_mb: float = 4.0, max_file_kb: int = 256, root: str | None = None) -> dict:
    """Write the corpus to ``output``; returns ``{"files", "bytes", "skipped"}``."""
    root = root or stdlib_dir()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory {root} not found")
    budget = int(max_mb * 1e6)
    written = skipped = files = 0
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out:
        for rel in list_source_files(root, max_file_kb):
            if written >= budget:
                break
            try:
                records = list(file_records(root, rel))
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            for rec in records:
                line = json.dumps(rec, ensure_ascii=False) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
            files += bool(records)
    os.replace(tmp, output)
    return {"files": files, "bytes": written, "skipped": skipped, "root": root}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after about this many MB")
    parser.add_argument("--max-file-kb", type=int, default=256, help="skip source files larger than this")
    # A future --tree flag plugs in at file_records().
    args = parser.parse_args(argv)
    stats = make_corpus(args.output, args.max_mb, args.max_file_kb)
    print(f"wrote {args.output}: {stats['files']} files, {stats['bytes'] / 1e6:.2f} MB from {stats['root']} "
          f"(Python {sys.version.split()[0]}; {stats['skipped']} unreadable files skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

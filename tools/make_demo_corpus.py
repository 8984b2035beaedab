#!/usr/bin/env python
"""Write a JSONL corpus from the Python standard library's own source files (no download).

Each line is ``{"text": <file contents>, "path": <path relative to the stdlib>}``. Files come from
``sysconfig.get_paths()["stdlib"]`` of the running interpreter (site-packages, test suites and
caches excluded), ordered by the MD5 of their relative path (a deterministic mix of modules,
independent of file-system order) and taken until ``--max-mb`` is reached. The same interpreter
version always gives the same corpus.

    python tools/make_demo_corpus.py --output data/stdlib.jsonl --max-mb 4
    python tools/make_demo_corpus.py --tree --output data/stdlib_trees.jsonl --max-mb 4

``--tree`` writes each file as a tree in the format of ``tools/preprocess_data.py --tree``: the root
is the module header (every line outside top-level ``def``/``class`` blocks: docstring, imports,
constants, trailing code), its children the top-level definitions in source order (decorators
included), and a class's children its methods (the class node keeps the rest of the class body).
Each node's text is its source lines verbatim, so root + definition (+ method) reads as real code.
Files that do not parse become single-node trees. ``--max-tree-kb K`` splits a module whose tree
exceeds K KB into several trees that repeat the header over consecutive groups of top-level
definitions (a class too large is split the same way over groups of its methods; a node whose own
text exceeds the budget stays whole), so that trees fit training rows.

``--max-doc-kb K`` (plain documents) cuts each file into consecutive documents of at most about K KB at
top-level statement boundaries, and a class larger than K between its statements (a function larger than
K stays whole; the documents of a file concatenate back to it), so that a training row of packed
documents holds several of them.
"""
from __future__ import annotations

import argparse
import ast
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


def _span(node: ast.AST) -> tuple[int, int]:
    """0-based [first, last) source lines of a definition, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first - 1, node.end_lineno


def _cut(lines: list[str], begin: int, end: int, holes: list[tuple[int, int]]) -> str:
    """Lines [begin, end) without the line ranges in ``holes``."""
    keep, pos = [], begin
    for a, b in sorted(holes):
        keep.extend(lines[pos:a])
        pos = max(pos, b)
    keep.extend(lines[pos:end])
    return "".join(keep)


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def code_tree(text: str) -> dict:
    """Module header -> top-level definitions -> methods, as a tree of ``{"text", "children"}`` nodes."""
    lines = text.splitlines(keepends=True)
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return {"text": text}
    top = [n for n in module.body if isinstance(n, _DEFS)]
    children = []
    for node in top:
        a, b = _span(node)
        methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))] \
            if isinstance(node, ast.ClassDef) else []
        spans = [_span(m) for m in methods]
        child = {"text": _cut(lines, a, b, spans)}
        if methods:
            child["children"] = [{"text": "".join(lines[ma:mb])} for ma, mb in spans]
        children.append(child)
    root = {"text": _cut(lines, 0, len(lines), [_span(n) for n in top])}
    if children:
        root["children"] = children
    return root


def _tree_bytes(node: dict) -> int:
    return len(node["text"].encode()) + sum(_tree_bytes(c) for c in node.get("children", []))


def split_tree(tree: dict, max_bytes: int | None) -> list[dict]:
    """The tree, or copies of it over consecutive groups of its children of <= max_bytes each.

    Applied recursively (a class too large for the budget left under the header becomes several
    copies of the class over groups of methods); a node whose own text leaves no budget stays whole.
    """
    children = tree.get("children", [])
    if max_bytes is None or _tree_bytes(tree) <= max_bytes or not children:
        return [tree]
    header = len(tree["text"].encode())
    if header >= max_bytes:
        return [tree]
    pieces = [p for c in children for p in split_tree(c, max_bytes - header)]
    groups: list[list[dict]] = [[]]
    size = header
    for piece in pieces:
        n = _tree_bytes(piece)
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = header
        groups[-1].append(piece)
        size += n
    return [{**tree, "children": g} for g in groups]


def split_documents(text: str, max_bytes: int | None) -> list[str]:
    """``text`` cut at top-level statement boundaries (and between the statements of a class larger than
    ``max_bytes``) into consecutive pieces of <= max_bytes each; a statement larger than that is one piece.
    ``"".join`` of the pieces is ``text``. A file that does not parse is one piece."""
    if max_bytes is None or len(text.encode()) <= max_bytes:
        return [text]
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return [text]
    lines = text.splitlines(keepends=True)
    cuts = {_span(n)[0] for n in module.body}
    for node in module.body:  # a class too large for one document is cut between its statements too
        a, b = _span(node)
        if isinstance(node, ast.ClassDef) and len("".join(lines[a:b]).encode()) > max_bytes:
            cuts |= {_span(n)[0] for n in node.body[1:]}
    starts = sorted(cuts - {0})
    blocks = ["".join(lines[a:b]) for a, b in zip([0, *starts], [*starts, len(lines)])]
    pieces: list[str] = []
    for block in blocks:
        if pieces and len((pieces[-1] + block).encode()) <= max_bytes:
            pieces[-1] += block
        else:
            pieces.append(block)
    return pieces


def file_records(root: str, relpath: str, tree: bool = False, max_tree_kb: float | None = None,
                 max_doc_kb: float | None = None) -> Iterator[dict]:
    """The JSONL records of one source file: one ``{"text", "path"}`` document (several with
    ``max_doc_kb``), or with ``tree`` one ``{"text", "children", "path"}`` tree, or several with
    ``max_tree_kb`` (see the module docstring)."""
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        return
    if not tree:
        for piece in split_documents(text, None if max_doc_kb is None else int(max_doc_kb * 1024)):
            yield {"text": piece, "path": relpath}
        return
    limit = None if max_tree_kb is None else int(max_tree_kb * 1024)
    for part in split_tree(code_tree(text), limit):
        yield {**part, "path": relpath}


def make_corpus(output: str, max_mb: float = 4.0, max_file_kb: int = 256, root: str | None = None,
                tree: bool = False, max_tree_kb: float | None = None, max_doc_kb: float | None = None) -> dict:
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
                records = list(file_records(root, rel, tree, max_tree_kb, max_doc_kb))
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
    parser.add_argument("--tree", action="store_true",
                        help="one tree per file: module header -> top-level definitions -> methods")
    parser.add_argument("--max-tree-kb", type=float, default=None,
                        help="--tree: split larger modules into trees that repeat the header over groups of "
                             "top-level definitions")
    parser.add_argument("--max-doc-kb", type=float, default=None,
                        help="cut each file into documents of about this size at top-level statement boundaries")
    args = parser.parse_args(argv)
    if args.max_doc_kb is not None and args.tree:
        parser.error("--max-doc-kb cuts plain documents; with --tree use --max-tree-kb")
    stats = make_corpus(args.output, args.max_mb, args.max_file_kb, tree=args.tree, max_tree_kb=args.max_tree_kb,
                        max_doc_kb=args.max_doc_kb)
    print(f"wrote {args.output}: {stats['files']} files, {stats['bytes'] / 1e6:.2f} MB from {stats['root']} "
          f"(Python {sys.version.split()[0]}; {stats['skipped']} unreadable files skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

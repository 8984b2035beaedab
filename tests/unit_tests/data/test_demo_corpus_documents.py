"""tools/make_demo_corpus.py --max-doc-kb: files cut into short documents at top-level statement boundaries."""
from __future__ import annotations

import ast
import json
import sys

from testlib import TOOLS

sys.path.insert(0, TOOLS)

import make_demo_corpus  # noqa: E402

SOURCE = '''#!/usr/bin/env python
"""Module docstring."""
import os

X = 1


@decorator
def f(a):
    return a + 1


class C:
    """A class."""

    def m(self):
        return 2
''' + "".join(f"\n\ndef g{i}():\n    return {i}\n" for i in range(30))


def _statement_starts(text: str) -> set[int]:
    """Character offsets where a top-level statement, or a statement of a class after its first, begins
    (decorators included): the only legal cuts."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    nodes = list(ast.parse(text).body)
    nodes += [s for n in nodes if isinstance(n, ast.ClassDef) for s in n.body[1:]]
    firsts = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) - 1 for n in nodes]
    return {offsets[i] for i in firsts} | {0, len(text)}


def test_documents_concatenate_back_to_the_file_and_cut_only_between_statements():
    budget = 200
    pieces = make_demo_corpus.split_documents(SOURCE, budget)
    assert "".join(pieces) == SOURCE
    assert len(pieces) > 3
    cuts, pos = set(), 0
    for p in pieces:
        cuts.add(pos)
        pos += len(p)
    assert cuts <= _statement_starts(SOURCE)  # never inside a statement: the decorator stays with f
    assert all(len(p.encode()) <= budget for p in pieces)
    # Greedy: no two neighbours would have fitted together.
    assert all(len((a + b).encode()) > budget for a, b in zip(pieces, pieces[1:]))
    # At a budget of one byte every statement is a document of its own, decorators included.
    singles = make_demo_corpus.split_documents(SOURCE, 1)
    ends = {0}
    for p in singles:
        ends.add(max(ends) + len(p))
    assert ends == _statement_starts(SOURCE)
    assert "@decorator\ndef f(a):\n    return a + 1\n\n\n" in singles


def test_a_class_larger_than_the_budget_is_cut_between_its_statements():
    methods = "".join(f"\n    def m{i}(self):\n        return {i}\n" for i in range(12))
    cls = 'class Big:\n    """Doc."""\n' + methods
    text = "import os\n\n\n" + cls + "\n\nsmall = 1\n"
    pieces = make_demo_corpus.split_documents(text, 80)
    assert "".join(pieces) == text
    assert len(pieces) > 4 and all(len(p.encode()) <= 80 for p in pieces)
    assert any(p.lstrip().startswith("def m5(self)") for p in pieces)  # cut between methods
    # A class within the budget is never cut.
    assert make_demo_corpus.split_documents(text, len(cls.encode()) + 1)[1].startswith("class Big")


def test_a_statement_larger_than_the_budget_stays_whole_and_bad_files_are_one_document():
    big = "def big():\n" + "".join(f"    x{i} = {i}\n" for i in range(40)) + "\n\ny = 2\n"
    pieces = make_demo_corpus.split_documents(big, 64)
    assert pieces == [big[: big.index("\n\ny = 2")] + "\n\n", "y = 2\n"]
    assert make_demo_corpus.split_documents("def (:\n" * 50, 10) == ["def (:\n" * 50]
    assert make_demo_corpus.split_documents(SOURCE, None) == [SOURCE]


def test_corpus_with_max_doc_kb(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "mod.py").write_text(SOURCE)
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    make_demo_corpus.make_corpus(str(whole), root=str(root))
    make_demo_corpus.make_corpus(str(cut), root=str(root), max_doc_kb=0.25)
    docs = [json.loads(line) for line in cut.read_text().splitlines()]
    assert [json.loads(line)["text"] for line in whole.read_text().splitlines()] == [SOURCE]
    assert len(docs) > 3 and {d["path"] for d in docs} == {"mod.py"}
    assert "".join(d["text"] for d in docs) == SOURCE
    assert all(len(d["text"].encode()) <= 256 for d in docs)

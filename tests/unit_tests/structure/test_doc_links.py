"""Every relative link in the repository's Markdown (README, docs/, bench/, examples/, tests/) resolves: the
file exists inside the repository, and a `#fragment` names a heading of its target (GitHub's anchors)."""
from __future__ import annotations

import os
import re

import pytest
from testlib import ROOT

SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".cache", "build", "dist"}
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files(root: str = ROOT) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".md")]
    return out


def _without_fences(text: str) -> list[str]:
    keep, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            keep.append(line)
    return keep


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are examples, not links)."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in _without_fences(text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _without_fences(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _anchors_of(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return anchors(f.read())


def broken_links(path: str, root: str = ROOT) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    bad = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        where = f"{os.path.relpath(path, root)}: ({target})"
        if os.path.commonpath([os.path.abspath(root), os.path.abspath(dest)]) != os.path.abspath(root):
            bad.append(f"{where} points outside the repository")
        elif not os.path.exists(dest):
            bad.append(f"{where} does not exist")
        elif fragment and dest.endswith(".md") and fragment not in _anchors_of(dest):
            bad.append(f"{where} names no heading of {os.path.relpath(dest, root)}")
    return bad


def test_every_relative_link_in_the_markdown_resolves():
    files = markdown_files()
    assert os.path.join(ROOT, "README.md") in files and len(files) > 20
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "\n".join(bad)


def test_the_readme_is_read_in_one_sitting_and_links_every_doc():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 250
    linked = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(prose(readme))}
    docs = {os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")}
    assert docs - linked == set(), f"docs the README does not link: {sorted(docs - linked)}"


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## The `x` flag: why\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok anchor](docs/a.md#the-x-flag-why) [self](#top) [web](https://example.com/x)\n"
        "[missing](docs/b.md) [bad anchor](docs/a.md#nowhere) [outside](../elsewhere/notes.md)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)`\n# Top\n")
    bad = broken_links(str(page), str(tmp_path))
    assert [b.split(": ", 1)[1] for b in bad] == [
        "(docs/b.md) does not exist", "(docs/a.md#nowhere) names no heading of docs/a.md",
        "(../elsewhere/notes.md) points outside the repository"]


@pytest.mark.parametrize("heading, slug", [
    ("## Benchmark: `bench/attention.py`", "benchmark-benchattentionpy"),
    ("## Megatron-LM checkpoints (import and export)", "megatron-lm-checkpoints-import-and-export"),
    ("### 1. DP = 2, one rank per namespace", "1-dp--2-one-rank-per-namespace"),
])
def test_anchor_slugs_follow_github(heading, slug):
    assert slug in anchors(heading)

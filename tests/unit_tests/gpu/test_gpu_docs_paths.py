"""docs/gpu.md and bench/gpu/RUNBOOK.md cite only files that exist (issue 40: docs/gpu.md cited a results
file nobody had written). A cited path is a backticked token naming a .py / .md / .json / .sh file;
the pages abbreviate, so it may be relative to the repository, to megatron_cai/ or to tests/unit_tests/."""
from __future__ import annotations

import os
import re

import pytest
from testlib import ROOT

BASES = ("", "megatron_cai", os.path.join("tests", "unit_tests"))
PAGES = (os.path.join("docs", "gpu.md"), os.path.join("bench", "gpu", "RUNBOOK.md"))


def _cited(page: str) -> list[str]:
    text = open(os.path.join(ROOT, page)).read()
    paths = []
    for token in re.findall(r"`([^`\s]+)`", text):
        path = token.split("::")[0]
        if re.fullmatch(r"[\w./-]+\.(py|md|json|sh)", path) and "/" in path and not path.startswith("$"):
            paths.append(path)
    return paths


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_file_exists(page) -> None:
    cited = _cited(page)
    assert len(cited) >= 5, cited  # the pattern finds the page's citations
    missing = [p for p in cited if not any(os.path.isfile(os.path.join(ROOT, base, p)) for base in BASES)]
    assert not missing, missing

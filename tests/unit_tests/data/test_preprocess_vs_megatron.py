"""tools/preprocess_data.py with Megatron-LM's flags writes byte-identical .bin/.idx files to Megatron-LM's own
tool (a verbatim copy in tests/fixtures/megatron_tools, run on the installed megatron-core 0.19.2) on the same
input: with --partitions 2 (round robin), --partitions 2 --keep-sequential-samples, and --keep-newlines (without
--split-sentences, as in Megatron-LM, no effect: the plain output).
--split-sentences without nltk is one error naming what is missing, and downloads nothing.

The tokenizer is NullTokenizer (whitespace-separated ids): megatron-core 0.19.2's GPT2BPETokenizer needs the
Hugging Face hub, which the tests cannot reach. Megatron's NullTokenizer puts EOD at vocab - 1, ours at vocab,
so Megatron's run gets a vocabulary one larger (same EOD id, same dtype)."""
from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys

import pytest
from testlib import ROOT, TOOLS

pytest.importorskip("megatron.core.tokenizers")
MEGATRON_TOOL = os.path.join(ROOT, "tests", "fixtures", "megatron_tools", "preprocess_data.py")
VOCAB = 500
_RUN_MEGATRON = """
import runpy, sys, typing
if not hasattr(typing, "override"):
    typing.override = lambda f: f
sys.argv = ["preprocess_data.py", *sys.argv[1:]]
runpy.run_path({tool!r}, run_name="__main__")
"""


def _corpus(path, n: int = 23) -> None:
    rng = random.Random(3)
    with open(path, "w") as f:
        for i in range(n):
            ids = " ".join(str(rng.randrange(VOCAB)) for _ in range(rng.randrange(1, 40)))
            f.write(json.dumps({"text": ids, "other": f"{i} {i + 1}"}) + "\n")


def _megatron(tmp, argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", _RUN_MEGATRON.format(tool=MEGATRON_TOOL), *argv], cwd=tmp,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _tool():
    """tools/preprocess_data.py as a module: the one other tests import (a second copy under the same name
    would make the copies' worker functions unpicklable for the spawned pools)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return importlib.import_module("preprocess_data")


def _ours(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "preprocess_data.py"), *argv], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("extra", [["--partitions", "2"], ["--partitions", "2", "--keep-sequential-samples"],
                                   ["--keep-newlines"]], ids=["partitions", "sequential", "keep_newlines"])
def test_outputs_are_megatrons_bytes(tmp_path, extra):
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    common = ["--input", str(corpus), "--tokenizer-type", "NullTokenizer", "--json-keys", "text", "other",
              "--append-eod", "--workers", "2"]
    _megatron(tmp_path, [*common, "--vocab-size", str(VOCAB + 1), "--output-prefix", str(tmp_path / "meg"), *extra])
    _ours([*common, "--vocab-size", str(VOCAB), "--output-prefix", str(tmp_path / "ours"), "--no-progress", *extra])
    for key in ("text", "other"):
        for ext in ("bin", "idx"):
            theirs = (tmp_path / f"meg_{key}_document.{ext}").read_bytes()
            assert (tmp_path / f"ours_{key}_document.{ext}").read_bytes() == theirs, f"{key} .{ext}"


def test_round_robin_partitions_reorder_the_documents_as_megatron_does(tmp_path):
    """The comparison above would pass for a tool that ignored --partitions only if the order did not change."""
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    common = ["--input", str(corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
              "--no-progress", "--workers", "1"]
    _ours([*common, "--output-prefix", str(tmp_path / "plain")])
    _ours([*common, "--output-prefix", str(tmp_path / "rr"), "--partitions", "2"])
    assert (tmp_path / "plain_text_document.bin").read_bytes() != (tmp_path / "rr_text_document.bin").read_bytes()


def test_split_sentences_without_nltk_is_one_error(tmp_path, capsys):
    if importlib.util.find_spec("nltk") is not None:
        pytest.skip("nltk is installed")
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    tool = _tool()
    assert tool.main(["--input", str(corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                      "--output-prefix", str(tmp_path / "s"), "--split-sentences", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--split-sentences needs nltk" in err[0] and "nothing is downloaded" in err[0]
    assert not list(tmp_path.glob("s_*"))

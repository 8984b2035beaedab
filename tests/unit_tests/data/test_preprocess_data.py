"""tools/preprocess_data.py: output contents, order with workers, bad input, skipping, CLI behaviour."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from testlib import ROOT

from megatron_cai.core.datasets.indexed_dataset import IndexedDataset

sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_data  # noqa: E402
from preprocess_data import PreprocessError, preprocess  # noqa: E402

SCRIPT = os.path.join(ROOT, "tools", "preprocess_data.py")


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return str(path)


def doc_line(ids, key="text", **extra):
    return json.dumps({key: " ".join(map(str, ids)), **extra})


def run_null(tmp_path, lines, vocab=1000, **kw):
    path = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out" / "corpus")
    kw.setdefault("append_eod", True)
    stats = preprocess(path, out, "NullTokenizer", vocab_size=vocab, progress=False, log=lambda m: None, **kw)
    return stats, out + "_text_document"


@pytest.mark.parametrize("workers", [1, 2])
def test_documents_in_order_with_eod(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(preprocess_data, "CHUNK_LINES", 7)  # many chunks in flight
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=rng.integers(1, 20)).tolist() for _ in range(100)]
    stats, prefix = run_null(tmp_path, [doc_line(d) for d in docs], workers=workers)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 100
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d + [1000]  # NullTokenizer's EOD is vocab_size
    assert stats.documents["text"] == 100
    assert stats.tokens["text"] == sum(len(d) + 1 for d in docs)


def test_large_vocab_uses_int32_and_no_eod(tmp_path):
    stats, prefix = run_null(tmp_path, [doc_line([69999, 5])], vocab=70000, append_eod=False)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and ds[0].tolist() == [69999, 5]


def test_empty_documents_and_blank_lines_are_counted(tmp_path):
    lines = [doc_line([1]), doc_line([]), "", "   ", doc_line([2, 3]), json.dumps({"text": "  \n "})]
    stats, prefix = run_null(tmp_path, lines)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 1000], [2, 3, 1000]]
    assert stats.empty_documents["text"] == 2 and stats.blank_lines == 2 and stats.lines == 6
    assert "2 empty documents skipped" in stats.summary("in.jsonl")


def test_multiple_json_keys(tmp_path):
    lines = [json.dumps({"text": "1 2", "code": "3"}), json.dumps({"text": "4", "code": ""})]
    path = write_lines(tmp_path / "k.jsonl", lines)
    out = str(tmp_path / "k")
    stats = preprocess(path, out, "NullTokenizer", vocab_size=10, json_keys=["text", "code"],
                       progress=False)
    assert [IndexedDataset(out + "_text_document")[i].tolist() for i in range(2)] == [[1, 2], [4]]
    code = IndexedDataset(out + "_code_document")
    assert len(code) == 1 and code[0].tolist() == [3]
    assert stats.empty_documents == {"text": 0, "code": 1}


BAD_LINES = {
    "malformed JSON": b'{"text": "1 2"',
    "missing key 'text'": json.dumps({"body": "1"}).encode(),
    "holds int, expected a string": json.dumps({"text": 5}).encode(),
    "invalid UTF-8": b'{"text": "1 \xff\xfe 2"}',
    "expected a JSON object": b"[1, 2]",
    "outside": json.dumps({"text": "1 5000"}).encode(),
}


@pytest.mark.parametrize("reason", list(BAD_LINES))
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_stops_with_file_and_line_and_leaves_no_output(tmp_path, reason, workers):
    lines = [doc_line([1, 2])] * 3 + [BAD_LINES[reason]] + [doc_line([3])]
    with pytest.raises(PreprocessError) as info:
        run_null(tmp_path, lines, workers=workers)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "in.jsonl") + ":4: ")
    assert reason in message
    assert os.listdir(tmp_path / "out") == []


def test_skip_bad_lines_counts_and_reports_first_line_numbers(tmp_path):
    lines = []
    for i in range(20):
        lines.append(doc_line([i]) if i % 3 else b'{"text": broken')
    stats, prefix = run_null(tmp_path, lines, skip_bad_lines=True, workers=2)
    bad = [i + 1 for i in range(20) if i % 3 == 0]  # 1-based line numbers
    assert stats.bad_lines == len(bad)
    assert [n for n, _ in stats.first_bad_lines] == bad[:5]
    ds = IndexedDataset(prefix)
    assert [ds[j].tolist()[0] for j in range(len(ds))] == [i for i in range(20) if i % 3]
    summary = stats.summary("in.jsonl")
    assert f"bad lines skipped: {len(bad)}" in summary and "line 4: malformed JSON" in summary


def _cli(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_cli_error_is_one_clear_line_and_exit_code(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [doc_line([1]), b'{"text": "\xc3\x28"}'])
    out = str(tmp_path / "o")
    proc = _cli("--input", path, "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "10", "--workers", "2")
    assert proc.returncode == 1
    assert f"{path}:2: invalid UTF-8" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out + "_text_document.idx") and not os.path.exists(out + "_text_document.bin")
    proc = _cli("--input", path, "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "10", "--skip-bad-lines", "--append-eod")
    assert proc.returncode == 0, proc.stderr
    assert "bad lines skipped: 1 (first: line 2: invalid UTF-8" in proc.stdout
    assert IndexedDataset(out + "_text_document")[0].tolist() == [1, 10]
    proc = _cli("--input", str(tmp_path / "nope.jsonl"), "--output-prefix", out, "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "10")
    assert proc.returncode == 1 and "nope.jsonl: file not found" in proc.stderr
    assert "Traceback" not in proc.stderr

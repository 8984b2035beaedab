"""tools/preprocess_data.py under attack (issue 39, point 6): invalid Unicode, a full disk, SIGTERM / SIGINT /
SIGKILL mid-run and a rerun. Each leaves no partial output, no temporary file (after the rerun) and no live
worker process; a bad line is one error naming the line, or a counted skip with --skip-bad-lines."""
from __future__ import annotations

import errno
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from testlib import ROOT

from megatron_cai.core.datasets import indexed_dataset
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset

SCRIPT = os.path.join(ROOT, "tools", "preprocess_data.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_data  # noqa: E402


def _cli(*args, **popen):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, SCRIPT, *args, "--no-progress"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _alive(pid: int) -> bool:
    """A live process (a zombie, already dead but not reaped by its new parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _workers(pid: int) -> list[int]:
    """The tokenizer worker processes (multiprocessing spawn children) of ``pid``."""
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat, "rb").read().rsplit(b")", 1)[1].split()
            cmdline = open(stat[:-4] + "cmdline", "rb").read()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            kids.append(int(stat.split("/")[2]))
    return kids


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ------------------------------------------------------------------------------------------- invalid Unicode
def _hf_tokenizer(tmp_path) -> str:
    """A tiny word-level tokenizer.json (the Hugging Face tokenizers library raises TypeError on a lone
    surrogate, which used to escape as a traceback)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "a", "b", "c"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


@pytest.mark.parametrize("skip", [False, True])
def test_lone_surrogate_is_a_bad_line(tmp_path, skip):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "a \\ud800 b"}\n{"text": "c a"}\n', encoding="ascii")
    out = str(tmp_path / "out" / "corpus")
    flags = ["--input", str(path), "--output-prefix", out, "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", _hf_tokenizer(tmp_path), "--append-eod", "--workers", "2"]
    code, stdout, stderr = _finish(_cli(*flags, *(["--skip-bad-lines"] if skip else [])))
    assert "Traceback" not in stderr, stderr[-3000:]
    if not skip:
        assert code == 1, stderr[-3000:]
        lines = [x for x in stderr.splitlines() if "error:" in x]
        assert len(lines) == 1 and f"{path}:2: invalid Unicode in key 'text': lone surrogate U+D800" in lines[0], stderr
        assert _files(tmp_path / "out") == []
        return
    assert code == 0, stderr[-3000:]
    assert "bad lines skipped: 1 (first: line 2: invalid Unicode in key 'text': lone surrogate U+D800" in stdout
    ds = IndexedDataset(out + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[2, 3, 1], [4, 2, 1]]  # lines 1 and 3, EOD = 1


# ------------------------------------------------------------------------------------------------ disk full
class _FullDisk:
    """``open`` for the writers of indexed_dataset: files whose name holds ``which`` take 4 KiB, then ENOSPC."""

    def __init__(self, which: str) -> None:
        self.which = which

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115 - handed to the caller
        if "w" not in mode or self.which not in os.path.basename(str(path)):
            return f
        real_write, budget = f.write, {"left": 4096}

        def write(data):
            if len(data) > budget["left"]:
                real_write(bytes(data)[:budget["left"]])
                budget["left"] = 0
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            budget["left"] -= len(data)
            return real_write(data)

        f.write = write
        return f


@pytest.mark.parametrize("which", [".bin", ".idx"])
def test_disk_full_publishes_neither_file(tmp_path, monkeypatch, which):
    """A full disk while the .bin (mid-run) or the .idx (at the end) is written: the pair from an earlier run
    at the same output stays byte-identical, and nothing else is left, temporary files included."""
    out = str(tmp_path / "out" / "corpus")
    prefix = out + "_text_document"

    def corpus(n: int) -> str:
        path = tmp_path / f"in{n}.jsonl"
        path.write_text("".join(json.dumps({"text": " ".join(str((i * 7 + j) % 1000) for j in range(30))}) + "\n"
                                for i in range(n)))
        return str(path)

    def run(n: int):
        return preprocess_data.preprocess(corpus(n), out, "NullTokenizer", vocab_size=1000, append_eod=True,
                                          progress=False, log=lambda m: None)

    run(10)  # an earlier good pair at the output paths
    before = {f: open(os.path.join(tmp_path, "out", f), "rb").read() for f in _files(tmp_path / "out")}
    assert sorted(before) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    monkeypatch.setattr(indexed_dataset, "open", _FullDisk(which), raising=False)
    with pytest.raises(preprocess_data.DiskFull, match=f"{tmp_path / 'out'}: no space left on device .ENOSPC. "
                       f"while writing {prefix}.bin/.idx .after \\d+ input lines.; nothing was published"):
        run(2000)  # 2000 * 31 * 2 bytes of .bin, 2000 * 12 + 34 bytes of .idx: both past 4 KiB
    monkeypatch.undo()
    after = {f: open(os.path.join(tmp_path, "out", f), "rb").read() for f in _files(tmp_path / "out")}
    assert after == before, sorted(after)
    assert len(IndexedDataset(prefix)) == 10


# ----------------------------------------------------------------------------------- signals, then a rerun
def _big_corpus(tmp_path, lines: int = 300_000) -> str:
    path = str(tmp_path / "big.jsonl")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(lines, 20))
    with open(path, "w") as f:
        f.writelines('{"text": "' + " ".join(map(str, row)) + '"}\n' for row in ids.tolist())
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_mid_run_then_rerun_leaves_no_partial_output(tmp_path, sig):
    out_dir = tmp_path / "out"
    out = str(out_dir / "corpus")
    proc = _cli("--input", _big_corpus(tmp_path), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "1000", "--workers", "2")
    tmp_bin = f"{out}_text_document.bin.tmp-{proc.pid}"
    t0 = time.time()
    while not (os.path.exists(tmp_bin) and os.path.getsize(tmp_bin) > 0 and len(_workers(proc.pid)) == 2):
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
        time.sleep(0.05)
    workers = _workers(proc.pid)
    proc.send_signal(sig)
    code, _, stderr = _finish(proc)
    t0 = time.time()
    while any(_alive(w) for w in workers) and time.time() - t0 < 15:
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)], "worker processes outlived the run"
    assert "Traceback" not in stderr, stderr[-3000:]
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        assert _files(out_dir) == [os.path.basename(tmp_bin)]  # what a kill cannot clean: the rerun does
    else:
        assert code == 128 + sig, stderr[-3000:]
        assert f"stopped by {sig.name}" in stderr
        assert _files(out_dir) == []  # no output, no temporary file
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    code, _, stderr = _finish(_cli("--input", str(small), "--output-prefix", out, "--tokenizer-type",
                                   "NullTokenizer", "--vocab-size", "1000", "--workers", "2"))
    assert code == 0, stderr[-3000:]
    if sig == signal.SIGKILL:
        assert f"removed {tmp_bin}" in stderr
    assert _files(out_dir) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    ds = IndexedDataset(out + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4, 5]]


def test_worker_whose_parent_died_while_it_started_exits():
    """A worker that starts after its parent was killed (SIGKILL while the pool was starting) exits at once,
    instead of waiting forever on a queue whose other ends its siblings hold."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import preprocess_data, numpy; "
            "preprocess_data._init_worker(-1, ['text'], {'tokenizer_type': 'NullTokenizer', 'vocab_size': 10}, "
            "False, numpy.uint16); time.sleep(60)")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tools")], timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert proc.returncode == 1 and time.time() - t0 < 50, proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr[-2000:]  # its own exit, not a failure

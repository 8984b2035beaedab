"""bench/gpu/validate.sh --dry-run: every step of the GPU validation runs at toy sizes on the CPU (Triton
interpreter) and writes its results where the validation machine returns them: at most 8 files, all in
$OUT, nothing in bench/results/. The training step goes through pretrain_gpt's Trainer and its packed-
document rows call our Triton visibility kernels (counted). A step stopped by its time limit keeps the
rows it finished."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from testlib import ROOT

GPU = os.path.join(ROOT, "bench", "gpu")
FILES = {"gpu_env.json", "gpu_codec.json", "gpu_attention.json", "gpu_train.json", "gpu_qat.json",
         "gpu_pytest.json", "gpu_summary.md", "gpu_log.txt"}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env.update(PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), PYTHONWARNINGS="ignore",
               **extra)
    return env


def _snapshot(folder: str) -> dict:
    return {name: (os.path.getsize(os.path.join(folder, name)), os.path.getmtime(os.path.join(folder, name)))
            for name in os.listdir(folder)}


TRITON_36 = os.environ.get("MEGATRON_CAI_TRITON_36") or os.path.join(ROOT, ".ci", "triton-3.6.0")


def _triton_36_path() -> str:
    """The folder holding the validation machine's triton 3.6.0 (tests/run.sh installs it)."""
    if not os.path.isdir(os.path.join(TRITON_36, "triton")):
        if os.environ.get("MEGATRON_CAI_TRITON_36"):
            pytest.fail(f"MEGATRON_CAI_TRITON_36={TRITON_36} holds no triton package")
        pytest.skip("triton 3.6.0 is not installed in .ci/triton-3.6.0 (tests/run.sh installs it)")
    return TRITON_36


def test_validate_dry_run_on_triton_36_with_numpy_24(tmp_path) -> None:
    """The validation machine's leg (issue 40): triton 3.6.0's interpreter with numpy >= 2.4, where
    ``int()`` of a 1-element array raises (the machine has numpy 2.5; this venv's Python 3.11 gets 2.4,
    which fails alike; CPU torch is enough, the failure is triton + numpy). ~70 s on 2 idle cores."""
    import numpy as np

    assert tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4), np.__version__  # tests/run.sh
    _assert_dry_run(tmp_path, pythonpath_first=_triton_36_path(), triton="3.6.0")


@pytest.mark.slow  # the same on this venv's Triton; CI runs the triton 3.6.0 leg above
def test_validate_dry_run(tmp_path) -> None:
    _assert_dry_run(tmp_path)


def _assert_dry_run(tmp_path, pythonpath_first: str | None = None, triton: str | None = None) -> None:
    pytest.importorskip("triton")
    results = os.path.join(ROOT, "bench", "results")
    before = _snapshot(results)
    env = _env(OUT=str(tmp_path))
    if pythonpath_first:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath_first, env["PYTHONPATH"]])
    proc = subprocess.run(["bash", os.path.join(GPU, "validate.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=2400)
    tail = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert _snapshot(results) == before  # nothing written to bench/results
    found = [os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert set(found) == FILES and len(found) <= 8, found
    summary = (tmp_path / "gpu_summary.md").read_text()
    for step in ("env", "codec", "attention", "training", "qat", "pytest"):
        assert f"| {step} | ok |" in summary, summary
        assert f"summary: {step} ok in " in proc.stdout  # each step's line, printed as it ended
    assert "step limits add up to 1680 s" in summary  # 420 s x 4 for the interpreter
    assert summary.strip()[-200:] in proc.stdout  # the summary is the end of the output tail
    res = {n: json.loads((tmp_path / f"gpu_{n}.json").read_text()) for n in ("env", "codec", "attention", "train",
                                                                              "qat", "pytest")}
    if triton:
        assert res["env"]["environment"]["triton"] == triton
    assert all(r["status"] == "ok" for n, r in res.items() if n != "pytest") and res["pytest"]["status"] == "finished"
    assert res["env"]["ceilings"]["copy_GBps"] > 0 and res["env"]["modules"]["numpy"]
    assert res["codec"]["all_identical"] and all(res["codec"]["byte_checks"].values()) and res["codec"]["rows"]
    ours = [r for r in res["attention"]["rows"] if r["method"] == "ours (triton)"]
    assert {r["layout"] for r in ours} == {"plain causal", "packed documents", "packed trees"}
    assert all("_fwd_kernel" in r["kernels"] and "_bwd_dkdv_kernel" in r["kernels"] for r in ours)
    errs = [r["max_err_vs_ours"] for r in res["attention"]["rows"] if r.get("max_err_vs_ours") is not None]
    assert len(errs) == 3 and max(errs) < 1e-2  # ours vs SDPA / flex at the toy sizes (fp16)
    train = {(r["row"], r["kind"]): r for r in res["train"]["rows"]}
    assert len(train) == 10 and not any(r.get("error") for r in train.values()), train
    decode = {name: r for (name, kind), r in train.items() if kind == "decode"}
    base, kaiju = decode["decode: baseline, bf16 cache"], decode["decode: Kaiju pattern, int8 cache"]
    assert base["timed_iterations"] == kaiju["timed_iterations"] == 4
    assert base["tokens_per_s"] > 0 and kaiju["tokens_per_s"] > 0 and base["context"] == kaiju["context"] == 60
    # the toy model (2 layers, 2 heads of 32, fp32) after 60 tokens: 2 layers x K and V x 2 heads x 32 x 4 bytes per
    # token; Kaiju: one shared group of one KV head, 3 int8 blocks of 16 tokens with an fp32 scale each (K and V),
    # and a tail of 12 fp32 tokens
    assert base["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4
    assert kaiju["kv_bytes_per_token"] == pytest.approx((48 * 2 * 32 + 3 * 2 * 4 + 12 * 2 * 32 * 4) / 60)
    assert kaiju["calls"]["attend"] > 0 and "attend" not in base["calls"]  # windows take our interval kernels
    for (name, kind), r in train.items():
        launches, calls = r["kernel_launches"], r["calls"]
        if kind == "decode":
            continue
        if "packed" in name or "Kaiju" in name:  # through the Trainer into attend and our visibility kernels
            assert calls["attend"] > 0 and launches["_fwd_kernel"] == calls["attend"], r
            assert launches["_bwd_dq_kernel"] == launches["_bwd_dkdv_kernel"] == calls["attend"], r
        elif kind != "megatron-core":  # plain causal: SDPA, never attend
            assert calls.get("scaled_dot_product_attention", 0) > 0 and not calls.get("attend"), r
        assert r["tokens_per_s"] > 0 and r["MFU_measured"] > 0
    assert train[("ours: plain causal (SDPA)", "ours")]["log_line"].strip().startswith("[")  # the Trainer's line
    assert train[("ours: plain causal (SDPA)", "ours")]["vs_peer"] > 0
    peer = train[("peer: AdamW(fused) + SDPA + torch.compile", "peer-compiled")]
    assert peer["compile"]["unique_graphs"] == 1 and peer["compile"]["graph_breaks"] == 0, peer["compile"]
    # the megatron-core row: both models' step times side by side, in the JSON, the summary and the output
    mine = train[("ours: plain causal (SDPA), alternated with megatron-core", "ours-alternated")]
    theirs = next(r for (_, kind), r in train.items() if kind == "megatron-core")
    assert mine["timed_iterations"] == theirs["timed_iterations"] == 3  # 3 alternated windows of 1 each
    assert mine["vs_megatron_core"] == pytest.approx(theirs["step_ms"] / mine["step_ms"])
    assert theirs["params_M"] == mine["params_M"]  # the same model on both sides
    assert abs(theirs["first_loss"] - mine["first_loss"]) < 0.1  # both start at ~ln(vocabulary)
    assert "ours vs megatron-core GPTModel, alternated" in summary
    assert f"vs megatron-core {theirs['step_ms']:.1f} ms" in proc.stdout
    assert res["pytest"]["counts"].get("skipped", 0) > 0 and not res["pytest"]["collection_errors"]


# codec.py run as its own __main__, except that it waits once its first row is on disk: the SIGTERM that a
# step's time limit sends then lands mid-step every time (a polled kill raced the step's last row).
_WAIT_AFTER_FIRST_ROW = """
import runpy, sys, time
sys.path.insert(0, sys.argv[1])
import common
add = common.StepResults.add
def add_then_wait(self, row):
    add(self, row)
    time.sleep(600)
common.StepResults.add = add_then_wait
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_step_stopped_by_its_time_limit_keeps_its_rows(tmp_path) -> None:
    """The codec step, stopped (SIGTERM, as `timeout` does) once it has written a row: its JSON parses,
    holds the finished rows and says it was killed; the summary reports the step's state."""
    pytest.importorskip("triton")
    out = tmp_path / "gpu_codec.json"
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_AFTER_FIRST_ROW, GPU, os.path.join(GPU, "codec.py"),
                             "--dry-run", "--out", str(out)],
                            env=_env(TRITON_INTERPRET="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        rows = []
        while time.time() < deadline and proc.poll() is None and not rows:
            time.sleep(0.5)
            try:
                rows = json.loads(out.read_text())["rows"]
            except (OSError, ValueError, KeyError):
                rows = []
        assert rows, "no row was written before the deadline"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    data = json.loads(out.read_text())
    assert data["status"] == "killed" and len(data["rows"]) >= 1 and data["rows"][0]["op"] == "d2d copy"
    assert data["stopped_by"] == "SIGTERM"
    subprocess.run([sys.executable, os.path.join(GPU, "summary.py"), "--out", str(tmp_path), "--steps",
                    "codec:TIMEOUT:160:160"], check=True, capture_output=True, timeout=60)
    summary = (tmp_path / "gpu_summary.md").read_text()
    assert f"| codec | TIMEOUT | 160 | 160 | {len(data['rows'])} |" in summary
    assert "status killed" in summary and "d2d copy" in summary

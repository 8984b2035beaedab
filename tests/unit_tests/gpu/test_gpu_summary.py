"""bench/gpu/summary.py and the end states of a step (issue 40): gpu_summary.md of a full-size GPU run fits
in 10 KB (the output tail that comes back is 12 KB); a step that crashed or was killed says so in its JSON
instead of ``running``; validate.sh's per-step line names the step's status and figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from testlib import ROOT

GPU = os.path.join(ROOT, "bench", "gpu")
sys.path.insert(0, GPU)

import attention  # noqa: E402
import codec  # noqa: E402
import qat  # noqa: E402
import summary  # noqa: E402
import train  # noqa: E402

LONG_ERROR = "RuntimeError: " + "CUDA out of memory. Tried to allocate 2.00 GiB " * 10
KERNELS = "; ".join(["_fwd_kernel x5", "_bwd_dq_kernel x5", "_bwd_dkdv_kernel x5"]
                    + ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>" * 2] * 4)


def _value(column: str, i: int):
    """A cell as wide as the GPU run writes it: full-precision floats, long names and kernel lists."""
    texts = {"kernels": KERNELS, "attention": "attend x48, _bwd_delta_kernel x48, _bwd_dkdv_kernel x48, "
             "_bwd_dq_kernel x48, _fwd_kernel x48", "layout": "packed documents", "method": "ours (triton)",
             "op": "wire encode + feedback, 8 rows", "path": "quantized_linear fp8_e4m3", "shape": "8192x4096x4096",
             "row": "ours: packed docs (Triton visibility kernel)", "model": "1.3B",
             "timing": "CUDA graph of 10 calls"}
    if column in texts:
        return texts[column]
    if column in ("seq", "elements", "batch"):
        return 268435456 if column == "elements" else 16384
    if column == "error":
        return LONG_ERROR if i < 2 else None  # a row that failed has no figures: the first two of each step
    return None if i < 2 else 1234.56789 + i / 7
def _full_size_run(out) -> None:
    """The step JSONs of a full GPU run: every row the benches can write, every column filled, the rows'
    names, layouts and kinds as the benches write them (so every goal line is there too)."""
    def write(name: str, columns: list[str], labels: list[dict], **extra) -> None:
        rows = [{**{c: _value(c, i) for c in columns}, **label} for i, label in enumerate(labels)]
        (out / summary.STEP_FILES[name]).write_text(json.dumps(
            {"title": f"{name} step", "columns": columns, "status": "ok", "rows": rows, "skipped": [], **extra}))

    env = {"device": "NVIDIA H200", "capability": 90, "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
           "python": "3.12.3", "date": "2026-12-06 05:00:00", "loadavg": [1.5, 1.2, 1.1]}
    (out / "gpu_env.json").write_text(json.dumps({"status": "ok", "environment": env, "rows": [], "modules": {},
                                                 "ceilings": {"copy_GBps": 4300.0, "bf16_matmul_TFLOPs": 790.0,
                                                              "matmul_size": 8192, "datasheet_bf16_TFLOPs": 989.4}}))
    ops = ["d2d copy", "encode", "encode + error feedback", "decode-accumulate (W=8)",
           "wire encode + feedback, 8 rows", "wire decode-sum of 8 rows"]
    write("codec", codec.COLUMNS, [{"op": op} for _ in range(3) for op in ops], all_identical=True,
          encode_ef_ratio_min=0.8)  # 3 sizes x 6 ops
    layouts, methods = ("plain causal", "packed documents", "packed trees"), ("ours (triton)", "sdpa flash", "flex")
    labels = [{"seq": seq, "layout": layout, "method": method} for seq in (8192, 2048, 16384) for layout in layouts
              for method in methods]
    labels += [{"seq": 8192, "layout": layout, "method": alternative} for layout in ("plain causal", "packed trees")
               for alternative in attention.ALTERNATIVES]
    write("attention", attention.COLUMNS, labels)
    labels = [{"row": name, "model": model, "kind": kind, "flags": " ".join(extra),
               **({"compile": {"unique_graphs": 1, "graph_breaks": 0}} if kind == "peer-compiled" else {})}
              for name, model, kind, extra in train.ROWS if kind != "vs-mcore"]
    labels += [{"row": "ours: plain causal (SDPA), alternated with megatron-core", "model": "350M",
                "kind": "ours-alternated"},
               {"row": "megatron-core 0.19.2 GPTModel, local spec, DDP + distributed optimizer, bf16",
                "model": "350M", "kind": "megatron-core"}]
    write("training", train.COLUMNS, labels)
    for r in json.loads((out / "gpu_train.json").read_text())["rows"]:
        assert r["kind"] in ("ours", "ours-alternated", "megatron-core", "peer-compiled", "peer-eager", "decode")
    write("qat", qat.COLUMNS, [{"path": p} for p in ("quantized_linear int8", "quantized_linear fp8_e4m3",
                                                      "transformer_engine fp8 Linear")])
    problems = [{"nodeid": f"tests/unit_tests/attention/test_attention.py::test_cuda_backends_vs_reference[{i}]",
                 "outcome": "failed", "seconds": 12.5, "message": LONG_ERROR} for i in range(14)]
    (out / "gpu_pytest.json").write_text(json.dumps({"status": "finished", "counts": {"passed": 30, "failed": 14},
                                                     "problems": problems, "collection_errors": []}))


def test_full_size_summary_fits_in_10_kb(tmp_path) -> None:
    _full_size_run(tmp_path)
    steps = " ".join(f"{name}:ok:100:{limit}" for name, limit in
                     (("env", 20), ("codec", 36), ("attention", 104), ("training", 160), ("qat", 32), ("pytest", 68)))
    assert summary.main(["--out", str(tmp_path), "--steps", steps, "--total-s", "410"]) == 0
    text = (tmp_path / "gpu_summary.md").read_text()
    assert len(text.encode()) <= 10_000, len(text.encode())
    assert "summary cut" not in text  # it fits by itself, not by the last-resort cut
    for section in ("## Goals", "## codec", "## attention", "## training", "## qat", "## pytest -m gpu"):
        assert section in text
    training = text.split("## training")[1].split("## qat")[0]
    assert training.count("\n| ") == 1 + len(train.ROWS) + 1  # the header, every row (megatron-core's: two)
    assert "ours vs megatron-core GPTModel, alternated" in text and "compiled peer 350M" in text  # goal lines
    assert "and 8 more (gpu_pytest.json)" in text


def test_fit_cuts_at_a_line_end_with_a_note() -> None:
    text = "".join(f"line {i:05d} " + "x" * 90 + "\n" for i in range(200))
    cut = summary.fit(text, 5000)
    assert len(cut.encode()) <= 5000 and cut.endswith("gpu_log.txt hold the rest)\n")
    kept = cut.split("\n(summary cut")[0]
    assert text.startswith(kept) and kept.endswith("\n")
    assert summary.fit("short\n", 5000) == "short\n"


_CRASHING_STEP = """
import sys
sys.path.insert(0, sys.argv[1])
import common
res = common.StepResults(sys.argv[2], "a step", ["a"])
res.add({"a": 1})
raise RuntimeError("the device fell off the bus")
"""


def test_crashed_step_records_crashed(tmp_path) -> None:
    out = tmp_path / "gpu_codec.json"
    proc = subprocess.run([sys.executable, "-c", _CRASHING_STEP, GPU, str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    data = json.loads(out.read_text())
    assert data["status"] == "crashed" and data["rows"] == [{"a": 1}]
    assert data["error"] == "RuntimeError: the device fell off the bus"


def test_validate_settles_a_step_left_running(tmp_path, capsys) -> None:
    """A step killed by SIGKILL (timeout's --kill-after) or dead in native code never wrote its end: the
    per-step call of validate.sh marks it killed or crashed, and prints the step's summary line."""
    for name, rc, want in (("codec", 137, "killed"), ("qat", 124, "killed"), ("attention", 139, "crashed"),
                           ("training", 1, "ok")):
        status = "ok" if want == "ok" else "running"
        (tmp_path / summary.STEP_FILES[name]).write_text(json.dumps({"status": status, "rows": [{}], "skipped": []}))
        assert summary.main(["--out", str(tmp_path), "--step", f"{name}:X:5:10", "--rc", str(rc)]) == 0
        assert json.loads((tmp_path / summary.STEP_FILES[name]).read_text())["status"] == want
        assert f"summary: {name} X in 5/10 s, file status {want}, 1 rows, 0 skipped" in capsys.readouterr().out
    assert summary.main(["--out", str(tmp_path), "--step", "pytest:X:5:10", "--rc", "137"]) == 0  # no file
    assert "file status missing" in capsys.readouterr().out

"""Ahead-of-time compile check of the Triton kernels (tools/compile_kernels.py) with the real compiler,
on this CPU machine: the CI subset passes on sm_89 (pinning the bf16 head-dim-128 dK/dV shared-memory
fix), the Hopper subset passes on sm_90 with the validation machine's Triton (3.6.0, installed by
tests/run.sh into .ci/triton-3.6.0, which shadows the venv's Triton on PYTHONPATH) and compiles the
sm_90 table rows and 16-byte Squinch accesses, and the check fails on a broken table row (an oversized
block; a spilling configuration).

Runs in subprocesses without TRITON_INTERPRET (the kernels must be real JIT functions). Compiled
kernels and ptxas results are cached by Triton (TRITON_CACHE_DIR), so reruns take seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testlib import ROOT

TOOL = os.path.join(ROOT, "tools", "compile_kernels.py")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *sys.path])
    env["PYTHONWARNINGS"] = "ignore"
    return env


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("ck") / "compile_kernels"
    proc = subprocess.run([sys.executable, TOOL, "--targets", "sm_89", "--subset", "ci", "--out", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=600)
    return proc, json.loads((out.with_suffix(".json")).read_text()) if out.with_suffix(".json").exists() else None


def test_ci_subset_compiles_without_spills_within_sm89_limits(ci_run) -> None:
    proc, result = ci_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = {r["kernel"]: r for r in result["kernels"]}
    assert set(kernels) >= {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_encode_kernel", "_decode_kernel"}
    for r in result["kernels"]:
        assert r["problems"] == [] and r["spill_bytes"] == 0 and 0 < r["registers"] <= 255
        assert r["shared_bytes"] <= 101376
    dkdv = kernels["_bwd_dkdv_kernel"]
    # the table row the launcher chose is what was compiled, and it fits sm_89 (was 107,520 B at 64x64 w4 s3)
    import torch

    from megatron_cai.core import kernel_configs as kc

    tiles = kc.attention_tiles("bwd_dkdv", torch.bfloat16, 128, kc.Target.for_capability(89))
    assert dkdv["config"] == f"bf16 d128 {tiles}"
    assert dkdv["shared_bytes"] <= dkdv["declared_smem"] <= 101376


TRITON_36 = os.environ.get("MEGATRON_CAI_TRITON_36") or os.path.join(ROOT, ".ci", "triton-3.6.0")


def test_hopper_subset_compiles_for_sm90_with_the_validation_machines_triton(tmp_path) -> None:
    pytest.importorskip("triton")
    if not os.path.isdir(os.path.join(TRITON_36, "triton")):
        if os.environ.get("MEGATRON_CAI_TRITON_36"):
            pytest.fail(f"MEGATRON_CAI_TRITON_36={TRITON_36} holds no triton package")
        pytest.skip("triton 3.6.0 is not installed in .ci/triton-3.6.0 (tests/run.sh installs it)")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([TRITON_36, env["PYTHONPATH"]])
    out = tmp_path / "hopper"
    proc = subprocess.run([sys.executable, TOOL, "--targets", "sm_90", "--subset", "hopper", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["summary"]["triton"] == "3.6.0"
    kernels = result["kernels"]
    assert {r["kernel"] for r in kernels} == {"_fwd_kernel", "_bwd_delta_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel",
                                              "_encode_kernel", "_decode_kernel"}
    for r in kernels:  # every head dim here is <= 128: no spill anywhere
        assert r["problems"] == [] and r["spill_bytes"] == 0 and r["shared_bytes"] <= 232448, r
    configs = {r["config"] for r in kernels}
    import torch

    from megatron_cai.core import kernel_configs as kc

    for dim in (64, 128):  # the Hopper rows of the table are what compiled, with and without a window
        for name in kc.ATTENTION_KERNELS:
            tiles = kc.attention_tiles(name, torch.bfloat16, dim, kc.Target.for_capability(90))
            assert f"bf16 d{dim} {tiles}" in configs and f"bf16 d{dim} {tiles} window" in configs
    # full blocks unmasked: 16-byte loads of the gradient and residual, 16-byte residual / decode stores
    enc = next(r for r in kernels if r["kernel"] == "_encode_kernel" and "g_ptr:fp32,r_ptr:fp32" in r["config"]
               and "HAS_RES=1" in r["config"] and "N_ALIGNED=1" in r["config"])
    assert enc["wide_loads"] >= 2 and enc["wide_stores"] >= 1, enc
    dec = next(r for r in kernels if r["kernel"] == "_decode_kernel" and "N_ALIGNED=1" in r["config"])
    assert dec["wide_stores"] >= 1, dec


_BROKEN = """
import sys, torch
sys.path.insert(0, {tools!r})
import compile_kernels
from megatron_cai.core import kernel_configs as kc
# a dK/dV block far over sm_89's shared memory (declared as fitting), and a fwd/dq row that spills
kc.ATTENTION_TABLE[("dkdv", "16bit", 128)] = ((90_000, kc.Tiles(128, 128, 8, 2)),)
kc.ATTENTION_TABLE[("dq", "16bit", 128)] = ((90_000, kc.Tiles(64, 64, 4, 2)),)
sys.exit(compile_kernels.main(["--targets", "sm_89", "--subset", "ci", "--out", {out!r}]))
"""


def test_check_fails_on_oversized_block_and_spills(tmp_path) -> None:
    pytest.importorskip("triton")
    out = str(tmp_path / "broken")
    code = _BROKEN.format(tools=os.path.dirname(TOOL), out=out)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = {r["kernel"]: r for r in json.loads(open(out + ".json").read())["kernels"]}
    dkdv = kernels["_bwd_dkdv_kernel"]
    assert dkdv["shared_bytes"] > 101376
    assert any("> sm_89 limit 101376" in p for p in dkdv["problems"])
    assert any("declared 90000" in p for p in dkdv["problems"])
    assert any(p.startswith("spills") for p in kernels["_bwd_dq_kernel"]["problems"])
    assert "FAIL _bwd_dkdv_kernel" in proc.stderr

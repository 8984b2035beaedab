"""bench/squinch_phases.py and bench/squinch_scale.py --quick end to end over the real veth pair (root and
iproute2; minutes, so slow): every file written, every row predicted, the fits finite."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="needs root and iproute2 (ip netns, tc)")]


def _run(*argv: str) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_scale_quick(tmp_path):
    out = str(tmp_path / "scale")
    _run("bench/squinch_scale.py", "--quick", "--no-projection", "--run-id", "pytest", "--fresh", "--out", out)
    for ext in ("json", "md", "png"):
        assert os.path.getsize(f"{out}.{ext}") > 0
    with open(out + ".json") as f:
        res = json.load(f)
    v = res["validation"]
    configs = sum(len(g["configs"]) for g in res["groups"]) + 2  # + the quarter row's two
    assert len(v["rows"]) == configs
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in v["rows"])
    assert v["max_abs_error"] >= v["median_abs_error"]
    with open(os.path.join(ROOT, "bench", ".cache", "squinch_phases_quick.json")) as f:
        phases = json.load(f)
    assert {"unshaped", "64", "loopback"} <= set(phases["fits"]["links"])
    for fits in phases["fits"]["links"].values():
        assert all(f["bytes_per_s"] > 0 and math.isfinite(f["alpha_s"]) for f in fits.values())
    assert phases["fits"]["codec"]["encode_elems_per_s"] > 0

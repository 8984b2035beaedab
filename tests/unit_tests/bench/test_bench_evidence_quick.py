"""The seed-repeated benches (bench/clamp_drift.py, zreg_bf16.py, distill_seeds.py) in --quick mode, and
their statistics helpers.

Each quick run trains every configuration at toy size into a temporary folder; the checks are on what the
runs must show whatever the toy numbers: the files and their per-seed structure, the summary statistics
recomputed from the per-seed values, and the physics each bench is about (a clamp fixed at step 0 clips an
activation that grew; bf16 logit error scales with the logit scale; a store's bytes per token follow its
format).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import _evidence as E  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("evidence_cache")
    src = os.environ.get("BENCH_EVIDENCE_DATA")  # optional: a built demo corpus + tokenizer (runs are never reused)
    if src:
        for name in ("corpus.jsonl", "tok.model", "tok.vocab", "demo_text_document.bin", "demo_text_document.idx"):
            os.symlink(os.path.join(src, name), path / name)
    return str(path)


def run_quick(script: str, cache: str, out: str, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "BENCH_THREADS": "2"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick", "--cache-dir", cache,
                           "--out", out, "--seeds", "1", "2", *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for ext in ("json", "md", "png"):
        assert os.path.getsize(f"{out}.{ext}") > 0, ext
    with open(out + ".json") as f:
        res = json.load(f)
    assert res["seeds"] == [1, 2]
    for name, per_seed in res["per_seed"].items():
        assert sorted(per_seed) == ["1", "2"], name
    return res


def check_summary(res: dict, key: str, baseline: str, gap_key: str = "paired_gap") -> None:
    """mean ± std and the paired gap, recomputed from the per-seed values."""
    base = [res["per_seed"][baseline][s][key] for s in ("1", "2")]
    for name, per_seed in res["per_seed"].items():
        vals = [per_seed[s][key] for s in ("1", "2")]
        row = res["summary"][name]
        assert row["valid_loss"]["mean"] == pytest.approx(statistics.fmean(vals))
        assert row["valid_loss"]["std"] == pytest.approx(statistics.stdev(vals))
        if name != baseline:
            diffs = [v - b for v, b in zip(vals, base)]
            assert row[gap_key]["diff_mean"] == pytest.approx(statistics.fmean(diffs))
            assert row[gap_key]["diff_std"] == pytest.approx(statistics.stdev(diffs))


def test_clamp_drift_quick(tmp_path, cache):
    import clamp_drift

    out = str(tmp_path / "clamp_drift")
    res = run_quick("clamp_drift.py", cache, out)
    assert set(res["per_seed"]) == set(clamp_drift.CONFIGS)
    check_summary(res, "final_valid_loss", "bf16")
    reg = res["regime"]
    assert reg["chosen"] == max((k for k, v in reg["candidates"].items() if v["rescale"] is not None),
                                key=lambda k: abs(__import__("math").log(reg["candidates"][k]["growth"])))
    # The rescaled warm start makes the fc2 input grow during training ...
    bf16 = res["per_seed"]["bf16"]["1"]["curve"]
    assert bf16[-1]["rms"] > 3 * bf16[0]["rms"]
    # ... so a clamp calibrated at step 0 clips at the end, while absmax never clips and rms clips far less.
    for fmt in ("int8", "fp8"):
        end = {c: res["per_seed"][f"{fmt} {c}"]["1"]["curve"][-1] for c in clamp_drift.CLAMPS}
        assert res["per_seed"][f"{fmt} static"]["1"]["curve"][0]["clipped"] == 0.0
        assert end["static"]["clipped"] > 0.05
        assert end["absmax"]["clipped"] == 0.0
        assert end["rms"]["clipped"] < end["static"]["clipped"] / 5


def test_zreg_bf16_quick(tmp_path, cache):
    out = str(tmp_path / "zreg_bf16")
    res = run_quick("zreg_bf16.py", cache, out)
    assert set(res["per_seed"]) == {"fp32 Z-Reg off", "bf16 Z-Reg off", "bf16 Z-Reg 0.001", "bf16 Z-Reg 0.01"}
    check_summary(res, "final_valid_loss", "bf16 Z-Reg off")
    for name, m in res["mechanism"].items():
        assert sum(b["rows"] for b in m["bins"]) == m["rows"] > 0
        for b in m["bins"]:  # bf16 (8 mantissa bits): errors are present and bounded
            assert 0 < b["output"] < 5e-2 and 0 < b["output sdpa"] < 5e-2, (name, b)
    # Rounding a logit to bf16 costs ~|logit| * 2^-9: scaling every logit by 16 scales the error ~16x.
    sweep = {r["scale"]: r for r in res["mechanism"]["bf16 Z-Reg off"]["logit_scale_sweep"]}
    assert 8 < sweep[16]["logits"] / sweep[1]["logits"] < 32


def test_distill_seeds_quick(tmp_path, cache):
    out = str(tmp_path / "distill_seeds")
    res = run_quick("distill_seeds.py", cache, out)
    assert set(res["per_seed"]) == {"no KD", "full KD", "top-k k=8", "top-k k=32", "Gumbel k=8", "Gumbel k=32"}
    check_summary(res, "final_valid_loss", "no KD", "gap_to_no_kd")
    assert res["teacher"]["params"] >= 4 * res["student_params"]
    # Per token: k uint16 ids + k fp16 logits + lse fp32 + kappa fp32 (both samplers write the same format),
    # plus a little shard header.
    for name, store in res["stores"].items():
        k = int(name.split("k=")[1])
        assert store["format_bytes_per_token"] == 4 * k + 8
        assert 4 * k + 8 <= store["bytes_per_token"] < 4 * k + 8 + 2, (name, store)  # measured on disk
    # Different student seeds start from different initialisations.
    nokd = res["per_seed"]["no KD"]
    assert nokd["1"]["final_valid_loss"] != nokd["2"]["final_valid_loss"]


def test_statistics_helpers():
    per = {"1": {"x": 2.0}, "2": {"x": 4.0}, "3": {"x": 9.0}}
    base = {"1": {"x": 1.0}, "2": {"x": 2.0}, "3": {"x": 3.0}}
    s = E.seed_summary(per, "x")
    assert s["mean"] == pytest.approx(5.0) and s["std"] == pytest.approx(((9 + 1 + 16) / 2) ** 0.5)
    g = E.paired_gap(per, base, "x")
    assert g["diff"] == [1.0, 2.0, 6.0] and g["diff_mean"] == pytest.approx(3.0)
    assert g["rel_pct"] == pytest.approx([100.0, 100.0, 200.0])
    assert E.count_spikes([5.0, 4.9, 4.8, 4.7, 5.5, 4.6, float("nan")]) == 2
    assert E.count_spikes([5.0, 4.0, 3.0, 2.0]) == 0
    assert E.count_spikes([4.0, 5.0, 5.0, 5.0, 5.2]) == 0  # against the median: one low loss makes no spikes

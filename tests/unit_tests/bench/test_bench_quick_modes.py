"""Every bench of bench/ runs in its --quick mode (one run of bench/harness/quick.py, what CI runs), and the
committed results are what the benches' reports make of their own JSON.

The quick run trains every configuration at toy size into a temporary folder. The checks are on what its
results must show whatever the toy numbers: every bench finished and wrote its files, nothing was written
into bench/results/, and the facts each bench is about (bytes against the formulas, Squinch's 6/16 of bf16,
sharded state, the statistics recomputed from the per-seed values, a clamp fixed at step 0 clipping an
activation that grew, bf16 logit error scaling with the logit scale, a store's bytes per token).
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest
from testlib import ROOT

BENCH = os.path.join(ROOT, "bench")
RESULTS = os.path.join(BENCH, "results")
sys.path.insert(0, BENCH)

import harness as H  # noqa: E402
from harness import quick  # noqa: E402
from harness.scripts import load_module  # noqa: E402

PLOTS = {"squinch_codec", "fp16_training", "qat_training", "zreg_bf16", "clamp_drift", "distill_seeds", "distill",
         "zreg_tree_training", "squinch_convergence", "squinch_cluster_projection", "moe", "diloco"}


def _digest(folder: str) -> dict[str, str]:
    return {f: hashlib.md5(open(os.path.join(folder, f), "rb").read()).hexdigest() for f in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """bench/harness/quick.py over every bench, in a process of its own; (results folder, summary)."""
    out = tmp_path_factory.mktemp("bench_quick")
    before = _digest(RESULTS)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "BENCH_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "harness", "quick.py"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert _digest(RESULTS) == before, "a quick mode wrote into bench/results/"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    with open(out / "quick_summary.json") as f:
        return str(out), json.load(f)


def load(run, name: str) -> dict:
    with open(os.path.join(run[0], name + ".json")) as f:
        return json.load(f)


def test_every_bench_has_a_quick_mode_and_all_of_them_ran(run):
    scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH, "*.py"))}
    assert scripts == set(quick.BENCHES) | set(quick.NOT_HERE), "bench/harness/quick.py must name every bench"
    assert not set(quick.BENCHES) & set(quick.NOT_HERE)
    for name in scripts:
        source = open(os.path.join(BENCH, name + ".py")).read()
        assert "H.parser(" in source, f"{name} does not take the harness's flags"
    summary = {r["bench"]: r for r in run[1]["benches"]}
    assert set(summary) == set(quick.BENCHES) and all(r["ok"] for r in summary.values())
    for name in quick.BENCHES:
        for ext in ("json", "md", *(["png"] if name in PLOTS else [])):
            assert os.path.getsize(os.path.join(run[0], f"{name}.{ext}")) > 0, (name, ext)
        md = open(os.path.join(run[0], f"{name}.md")).read()
        assert md.startswith("# "), name


def test_gradient_bytes_match_the_formulas(run):
    rows = load(run, "dp_comm")
    assert {r["reducer"] for r in rows} == set(__import__("dp_comm").REDUCERS)
    for r in rows:
        assert abs(r["accounted_bytes"] - r["formula_bytes"]) < 1, r
        assert 1.0 <= r["measured_over_formula"] < 1.05, r  # the sockets carry the payload plus small headers
        if r["reducer"].startswith("squinch"):
            assert r["vs_bf16_accounted"] == pytest.approx(6 / 16, rel=0.01)
    bw = load(run, "squinch_bandwidth")["dp2"][0]
    assert bw["squinch"]["bytes"] / bw["bf16"]["bytes"] == pytest.approx(6 / 16, rel=0.01)
    conv = load(run, "squinch_convergence")["runs"]
    assert conv["squinch+EF@1"]["bytes_per_iter"] / conv["bf16@1"]["bytes_per_iter"] == pytest.approx(6 / 16, rel=0.01)
    for key in ("squinch hierarchical+EF@1", "fsdp2 HSDP squinch+EF@1"):
        assert 0 < conv[key]["inter_node_bytes_per_iter"] < conv[key]["bytes_per_iter"]
    for r in conv.values():
        assert math.isfinite(r["validation"][-1]["lm loss"])


def test_context_parallel_counts_by_hand(run):
    """Zig-zag at CP 2 on plain causal, L = T/2 keys per rank: the busiest rank sends 2L + L/2 keys' K and V
    (forward, backward, and dK/dV back; tests/unit_tests/bench/test_context_parallel_bench.py derives it)
    against the dense ring's 3L; every pair of the causal triangle is visible to exactly one rank."""
    cp = load(run, "context_parallel")
    line = next(s for s in cp["summary"] if (s["kind"], s["cp"]) == ("plain causal", 2))
    local = line["seq"] // 2
    assert line["total_bytes"]["max"] == 5 * local // 2 * cp["key_bytes"]
    assert line["dense_total_bytes"] == 3 * local * cp["key_bytes"]
    measured = next(s for s in cp["summary"] if (s["kind"], s["cp"]) == ("packed documents", 2))
    assert measured["max_saved_bytes"] > 0 and measured["max_peak_bytes"] > 0  # the gloo ranks' memory row
    rows = [r for r in cp["rows"] if (r["kind"], r["cp"]) == ("plain causal", 2) and "flops" in r]
    assert sum(r["visible_pairs"] for r in rows) == line["seq"] * (line["seq"] + 1) // 2
    assert {s["kind"] for s in cp["summary"]} == {"plain causal", "packed documents",
                                                  "packed documents (exponential)", "packed trees"}


def test_collectives_alone_and_the_projection(run):
    phases = load(run, "squinch_phases")
    assert list(phases["links"]) == ["loopback"]  # --no-netns: the one link there is
    for fits in phases["fits"]["links"].values():
        assert all(f["bytes_per_s"] > 0 and math.isfinite(f["alpha_s"]) for f in fits.values())
    assert phases["fits"]["codec"]["encode_elems_per_s"] > 0
    cells = load(run, "squinch_cluster_projection")["cells"]
    assert {(c["gpus"], c["gbit"]) for c in cells} == {(g, b) for g in (64, 512) for b in (800, 3200)}
    for c in cells:  # a step is never shorter than its compute, and hiding communication never adds time
        for k, step in c["step_s"].items():
            assert step >= c["setup"]["compute_s"] and 0 <= c["exposed_s"][k] <= step, (c["model"], k)


def test_diloco_rows_and_projection(run):
    res = load(run, "diloco")
    rows = {r["name"]: r for r in res["measured"]}
    assert set(rows) == {"dp bf16", "diloco 6"}
    dp, dl = rows["dp bf16"], rows["diloco 6"]
    assert dl["tokens"] == dp["tokens"] and dl["val_loss"] is not None and dp["val_loss"] is not None
    # both start from the one warm-start checkpoint: only the iterations after it are logged and counted
    after = res["options"]["iters"] - res["options"]["warm_start_iters"]
    assert res["options"]["warm_start_iters"] > 0 and len(dp["losses"]) == len(dl["losses"]) == after
    # the 2 iterations: one outer round (H = 2) and the final average, each the model once in 6 bits over the
    # 2-rank outer group, against 2 bf16 steps over the 4-rank ring (1.5 x the bytes per element): about 1/4
    assert dl["crossing_bytes"] < dp["crossing_bytes"] / 3
    assert 0 <= dl["wait_s"] <= dl["wall_s"] and dl["predicted_s"] > 0
    for r in res["projection"]:  # fewer bits never need a larger H nor a faster link
        assert r["6"]["min_h_k4"] <= r["16"]["min_h_k4"] <= r["32"]["min_h_k4"]
        assert r["6"]["min_gbit_h20_k4"] < r["16"]["min_gbit_h20_k4"] < r["32"]["min_gbit_h20_k4"]


def test_sharded_state_is_the_full_state_over_dp(run):
    rows = {r["path"]: r for r in load(run, "fsdp_memory")["rows"]}
    ddp, zero1, fsdp = rows["DDP"], rows["distributed optimizer"], rows["FSDP2"]
    dp = ddp["dp"]
    assert zero1["params"] == ddp["params"] and zero1["optimizer"] == ddp["optimizer"] / dp
    assert fsdp["params"] == ddp["params"] / dp and fsdp["grads"] == ddp["grads"] / dp
    assert fsdp["optimizer"] == ddp["optimizer"] / dp


def test_checkpoint_saves_both_formats_sync_and_async(run):
    res = load(run, "checkpoint")
    assert not res["unavailable"]
    for entry in res["sizes"].values():
        for fmt in ("torch", "torch_dist"):
            modes = entry["formats"][fmt]
            assert modes["sync"]["bytes"]["median"] > 12 * entry["params"]  # fp32 weights + two Adam moments
            assert modes["async"]["bytes"]["median"] == pytest.approx(modes["sync"]["bytes"]["median"], rel=0.01)
            assert modes["async"]["stall_s"]["median"] <= modes["async"]["save_s"]["median"]
            # issue 28's figures: the hash cost (sync save over the save with hashing off) and verify / save
            assert math.isfinite(modes["hash_cost"]["median"]) and modes["sync-nohash"]["save_s"]["median"] > 0
            assert 0 < modes["verify_over_save"]["median"] == pytest.approx(
                modes["sync"]["verify_s"]["median"] / modes["sync"]["save_s"]["median"], rel=1e-6)


def test_quantization_benches(run):
    rows = load(run, "qat_clamp")["rows"]
    at = {(r["fmt"], r["rule"]): r for r in rows if r["scale"] == 0.1 and r["granularity"] == "tensor"}
    # A clamp calibrated at weight scale 1 zeroes most of the int8 activations once the weights shrink 10x;
    # the RMS clamp follows them.
    assert at["int8", "static"]["zeroed"] > 0.5 > 0.3 > at["int8", "rms"]["zeroed"]
    runs = load(run, "qat_training")["runs"]
    assert not runs["bf16"]["fc2_probes"] and all(runs[n]["fc2_probes"] for n in runs if n != "bf16")


def test_attention_and_zreg_benches(run):
    res = load(run, "attention")
    for r in res["rows"]:
        assert 0 < r["tile_density"] <= 1
        assert r["interval_mask_bytes"] == 8 * r["seq"] and r["dense_mask_bytes"] == r["seq"] ** 2
    assert "demo-trees" in res["branch_savings"]
    for s in res["branch_savings"].values():
        assert s["flattened_tokens"] >= s["tree_tokens"]  # a shared prefix is counted once per tree
    rows = {r["run"]: r for r in load(run, "zreg_tree_training")["rows"]}
    assert set(rows) == {"off", "zreg=0.001"} and all(r["lse_max_end"] is not None for r in rows.values())


def test_step_overhead(run):
    res = load(run, "step_overhead")
    for name, reads in res["rows"]["reads"].items():  # issue 27: one read per iteration that does not log
        assert len(reads["per_iteration"]) == res["settings"]["sync_iters"], name
        assert reads["max_non_logging"] == 1 and reads["max_logging"] <= 2, (name, reads)
    opt, comp, base = res["rows"]["optimizer"], res["rows"]["compile"], res["rows"]["baseline"]
    assert opt["elements"] > 0 and set(opt["seconds"]) == {"unfused", "fused"}
    assert set(comp["seconds"]) == {"eager", "compiled"} and comp["backend"] == "aot_eager"
    assert set(base["tokens_per_s"]) == {"baseline", "this"} and base["trees"]["baseline"] == base["trees"]["this"]
    for pair in (opt, comp):  # the ratio is that of the medians of the alternated windows (slow / fast)
        slow, fast = pair["windows"].values()
        assert pair["ratio"] == pytest.approx(statistics.median(slow) / statistics.median(fast))
    this, other = base["windows"]["this"], base["windows"]["baseline"]
    assert base["ratio"] == pytest.approx(statistics.median(this) / statistics.median(other))


def test_distill_stores_hold_the_format_bytes(run):
    res = load(run, "distill")
    k = res["config"]["k"]
    for sampler, per_token in res["store_bytes_per_token_on_disk"].items():
        assert 4 * k + 8 <= per_token < 4 * k + 8 + 2, sampler  # k ids + k fp16 logits + lse + kappa (+ header)
    assert set(res["final"]) == {"no KD", "full KD (online)", "top-k KD", "Gumbel-k KD"}


def check_summary(res: dict, key: str, baseline: str, gap_key: str = "paired_gap") -> None:
    """mean ± std and the paired gap, recomputed from the per-seed values."""
    base = [res["per_seed"][baseline][s][key] for s in ("1", "2")]
    for name, per_seed in res["per_seed"].items():
        assert sorted(per_seed) == ["1", "2"], name
        vals = [per_seed[s][key] for s in ("1", "2")]
        row = res["summary"][name]
        assert row["valid_loss"]["mean"] == pytest.approx(statistics.fmean(vals))
        assert row["valid_loss"]["std"] == pytest.approx(statistics.stdev(vals))
        if name != baseline:
            diffs = [v - b for v, b in zip(vals, base)]
            assert row[gap_key]["diff_mean"] == pytest.approx(statistics.fmean(diffs))
            assert row[gap_key]["diff_std"] == pytest.approx(statistics.stdev(diffs))


def test_clamp_drift(run):
    import clamp_drift

    res = load(run, "clamp_drift")
    assert res["seeds"] == [1, 2] and set(res["per_seed"]) == set(clamp_drift.CONFIGS)
    check_summary(res, "final_valid_loss", "bf16")
    reg = res["regime"]
    assert reg["chosen"] == max((k for k, v in reg["candidates"].items() if v["rescale"] is not None),
                                key=lambda k: abs(math.log(reg["candidates"][k]["growth"])))
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


def test_zreg_bf16(run):
    res = load(run, "zreg_bf16")
    assert set(res["per_seed"]) == {"fp32 Z-Reg off", "bf16 Z-Reg off", "bf16 Z-Reg 0.001", "bf16 Z-Reg 0.01"}
    check_summary(res, "final_valid_loss", "bf16 Z-Reg off")
    for name, m in res["mechanism"].items():
        assert sum(b["rows"] for b in m["bins"]) == m["rows"] > 0
        for b in m["bins"]:  # bf16 (8 mantissa bits): errors are present and bounded
            assert 0 < b["output"] < 5e-2 and 0 < b["output sdpa"] < 5e-2, (name, b)
    # Rounding a logit to bf16 costs ~|logit| * 2^-9: scaling every logit by 16 scales the error ~16x.
    sweep = {r["scale"]: r for r in res["mechanism"]["bf16 Z-Reg off"]["logit_scale_sweep"]}
    assert 8 < sweep[16]["logits"] / sweep[1]["logits"] < 32


def test_distill_seeds(run):
    res = load(run, "distill_seeds")
    assert set(res["per_seed"]) == {"no KD", "full KD", "top-k k=8", "top-k k=32", "Gumbel k=8", "Gumbel k=32"}
    check_summary(res, "final_valid_loss", "no KD", "gap_to_no_kd")
    assert res["teacher"]["params"] >= 4 * res["student_params"]
    # Per token: k uint16 ids + k fp16 logits + lse fp32 + kappa fp32 (both samplers write the same format),
    # plus a little shard header; --quick writes and measures the stores of the smallest k.
    for name, store in res["stores"].items():
        k = int(name.split("k=")[1])
        assert store["format_bytes_per_token"] == 4 * k + 8
        if k == 8:
            assert 4 * k + 8 <= store["bytes_per_token"] < 4 * k + 8 + 2, (name, store)  # measured on disk
    nokd = res["per_seed"]["no KD"]
    assert nokd["1"]["final_valid_loss"] != nokd["2"]["final_valid_loss"]  # different initialisations


# ------------------------------------------------------------------------------------------ committed results
# Benches whose committed JSON predates the harness and lacks what their report prints (their settings): they
# are rendered from their JSON once re-run (timing runs, for a quiet machine).
NOT_FROM_JSON = {"train_throughput": lambda p: isinstance(p, list),  # rows only: no steps, no rounds
                 "attention": lambda p: "repeats" not in p["config"]}


SCRIPT_OF = {"diloco_scratch": "diloco"}  # reports that another configuration of a bench made (--out)


@pytest.mark.parametrize("name", ["checkpoint", "clamp_drift", "context_parallel", "diloco", "diloco_scratch",
                                  "distill", "distill_seeds",
                                  "dp_comm", "fp16_training", "kaiju", "moe", "step_overhead",
                                  "fsdp_memory", "qat_clamp", "qat_training", "squinch_cluster_projection",
                                  "squinch_codec", "squinch_convergence", "zreg_bf16", "zreg_tree_training"])
def test_committed_reports_are_what_the_bench_makes_of_its_json(name, tmp_path):
    shutil.copy(os.path.join(RESULTS, name + ".json"), tmp_path / (name + ".json"))
    module = load_module(f"bench/{SCRIPT_OF.get(name, name)}.py")  # by path: bench/gpu/ has same-named scripts
    module.main(["--from-json", "--out", str(tmp_path / name)])
    assert (tmp_path / (name + ".md")).read_text() == open(os.path.join(RESULTS, name + ".md")).read()


def test_the_benches_not_rendered_from_their_json_lack_their_settings():
    """Every committed JSON is tested above, or listed here because it cannot be (which this checks)."""
    tested = set(test_committed_reports_are_what_the_bench_makes_of_its_json.pytestmark[0].args[1])
    committed = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(RESULTS, "*.json"))}
    by_other_means = {"squinch_bandwidth", "squinch_bandwidth_partial", "squinch_bandwidth_rows_1",
                      "compile_kernels", "compile_kernels_triton36",  # tools/compile_kernels.py (tests of its own)
                      "squinch_phases", "squinch_scale"}  # the model on their measurements, below
    by_other_means |= {os.path.basename(p)[:-5] for pattern in ("squinch_*_rows_*.json", "squinch_*_run*.json",
                                                                 "*.rows.json")  # a resumable run's finished rows
                       for p in glob.glob(os.path.join(RESULTS, pattern))}
    assert committed - tested - by_other_means == set(NOT_FROM_JSON)
    for name, lacks_settings in NOT_FROM_JSON.items():
        with open(os.path.join(RESULTS, name + ".json")) as f:
            assert lacks_settings(json.load(f)), f"{name}.json has its settings now: test it above"


def test_committed_squinch_scale_reports_are_the_model_on_their_measurements():
    """squinch_phases / squinch_scale: each report renders from its JSON, and every prediction in it is what
    today's step-time model makes of the committed measurements (phase fits, timelines, measured rows)."""
    import squinch_phases
    import squinch_scale

    def committed(name):
        with open(os.path.join(RESULTS, name + ".json")) as f, open(os.path.join(RESULTS, name + ".md")) as g:
            return json.load(f), g.read()

    for name in ["squinch_scale"] + sorted(os.path.basename(p)[:-5] for p in
                                           glob.glob(os.path.join(RESULTS, "squinch_scale_run*.json"))):
        phases, phases_md = committed(name.replace("scale", "phases"))  # each run measured its own phases
        assert "\n".join(squinch_phases.report(phases)) + "\n" == phases_md
        assert squinch_phases.fits_of(phases) == phases["fits"], name  # today's fits of its samples
        res, md = committed(name)
        assert "\n".join(squinch_scale.report(res)) + "\n" == md, name
        again = squinch_scale.validate(squinch_scale.measured_groups(res), dict(res["quarter"]), res["timelines"],
                                       phases)
        assert [r["predicted_s"] for r in again["rows"]] == pytest.approx(
            [r["predicted_s"] for r in res["validation"]["rows"]], rel=1e-9), name
        assert again["max_abs_error"] == pytest.approx(res["validation"]["max_abs_error"], rel=1e-9)


def test_squinch_bandwidth_progress_report_regenerates_from_its_rows(tmp_path):
    import squinch_bandwidth

    squinch_bandwidth.main(["--from-cache", "--out", str(tmp_path / "partial")])
    for ext in ("md", "json"):
        ours = (tmp_path / f"partial.{ext}").read_text()
        assert ours == open(os.path.join(RESULTS, f"squinch_bandwidth_partial.{ext}")).read(), ext


# ------------------------------------------------------------------------------------------ the harness itself
def test_rows_are_kept_as_they_finish_and_an_interrupted_run_resumes(tmp_path):
    prefix, calls = str(tmp_path / "b"), []

    def compute(key):
        calls.append(key)
        if key == "boom":
            raise RuntimeError("stopped halfway")
        return {"value": len(calls)}

    first = H.Results(prefix, {"size": 1})
    assert first.row("a", lambda: compute("a")) == {"value": 1}
    with pytest.raises(RuntimeError):
        first.row("boom", lambda: compute("boom"))
    with open(prefix + ".rows.json") as f:
        saved = json.load(f)
    assert list(saved["rows"]) == ["a"] and len(saved["meta"]["a"]["load_average"]) == 3
    again = H.Results(prefix, {"size": 1})  # the same settings: row "a" is not measured again
    assert again.row("a", lambda: compute("a")) == {"value": 1} and calls == ["a", "boom"]
    other = H.Results(prefix, {"size": 2})  # other settings: nothing is reused
    assert other.row("a", lambda: compute("a")) == {"value": 3}
    md = other.write({"rows": other.rows}, lambda p: "# t\n" + json.dumps(p["rows"]))
    assert md.startswith("# t") and not os.path.exists(prefix + ".rows.json")
    with open(prefix + ".json") as f:
        payload = json.load(f)
    assert payload["rows"] == {"a": {"value": 3}} and set(payload["machine"]) == {"start", "end"}
    assert H.Results(prefix).rewrite(lambda p: "# again\n") == "# again\n"
    assert open(prefix + ".md").read() == "# again\n"


def test_alternation_and_spread():
    order = []
    out = H.alternate({"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b") or len(order)},
                      3, mirror=True)
    assert order == ["a", "b", "b", "a", "a", "b"] and out == {"a": [1, 4, 5], "b": [2, 3, 6]}
    order.clear()
    H.alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 2)
    assert order == ["a", "b", "a", "b"]
    s = H.spread([3.0, 1.0, 2.0, None])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 1.0}
    assert H.spread([None]) == {"median": None, "min": None, "max": None, "spread": None}


def test_quick_output_never_lands_in_bench_results(tmp_path):
    p = H.parser(None, "example")
    H.add(p, layers=2, seeds=[1, 2, 3])
    opts = H.parse(p, ["--quick"], quick={"layers": 1})
    assert opts.layers == 1 and opts.out == os.path.join(BENCH, ".cache", "quick", "example")
    assert H.parse(p, []).out == os.path.join(RESULTS, "example") and H.parse(p, []).layers == 2
    assert H.parse(p, ["--quick", "--out", str(tmp_path / "x")]).out == str(tmp_path / "x")
    with pytest.raises(SystemExit):
        quick.main(["--out", os.path.join(RESULTS, "quick")])


def test_statistics_helpers():
    per = {"1": {"x": 2.0}, "2": {"x": 4.0}, "3": {"x": 9.0}}
    base = {"1": {"x": 1.0}, "2": {"x": 2.0}, "3": {"x": 3.0}}
    s = H.seed_summary(per, "x")
    assert s["mean"] == pytest.approx(5.0) and s["std"] == pytest.approx(((9 + 1 + 16) / 2) ** 0.5)
    g = H.paired_gap(per, base, "x")
    assert g["diff"] == [1.0, 2.0, 6.0] and g["diff_mean"] == pytest.approx(3.0)
    assert g["rel_pct"] == pytest.approx([100.0, 100.0, 200.0])
    assert H.count_spikes([5.0, 4.9, 4.8, 4.7, 5.5, 4.6, float("nan")]) == 2
    assert H.count_spikes([5.0, 4.0, 3.0, 2.0]) == 0
    assert H.count_spikes([4.0, 5.0, 5.0, 5.0, 5.2]) == 0  # against the median: one low loss makes no spikes


def test_kaiju_cache_is_at_most_a_twentieth_of_the_baseline(run):
    """Bytes counted from the cache tensors: the ratio is at least 20 and equals its factors (MQA and sharing
    account for the bf16 Kaiju cache exactly; int8 for the rest)."""
    c = load(run, "kaiju")["cache"]
    assert c["ratio"] >= 20, c
    assert c["ratio_from_factors"] == pytest.approx(c["ratio"], rel=1e-12)
    assert c["bytes_per_token"]["llama_bf16"] == c["factors"]["mqa"] * c["factors"]["sharing"] * \
        c["bytes_per_token"]["kaiju_bf16"]
    assert abs(c["params"]["kaiju"] / c["params"]["llama"] - 1) < 0.01  # equal parameters (within 1%)
    assert abs(c["params"]["mla"] / c["params"]["llama"] - 1) < 0.01
    sh = c["shape"]
    head = sh["hidden"] // sh["heads"]  # MLA caches its latent (hidden / 4) and the RoPE key (head / 2), bf16
    assert c["bytes_per_token"]["mla_bf16"] == sh["layers"] * (sh["hidden"] // 4 + head // 2) * 2
    for name, row in c["rows"].items():
        b = row["branches"]
        assert b["forward_tokens"] == b["prompt"] + b["branches"] * (b["suffix"] + b["new_tokens"] - 1), name
        assert b["forward_tokens_separate"] == b["branches"] * (b["prompt"] + b["suffix"] + b["new_tokens"] - 1)
        assert row["decode"]["tokens_per_s"] > 0 and len(row["decode"]["load_average"]) == 3


def test_kaiju_loss_is_paired_over_seeds_at_equal_parameters_and_tokens(run):
    """The loss part: three architectures at (within 1%) one parameter count, every run the same iterations,
    the paired difference to the baseline recomputed from the per-seed losses, and branch decoding on the
    trained models equal to each branch decoded alone (model-dtype cache)."""
    r = load(run, "kaiju")["loss"]
    s, per, iters = r["summary"], r["per_seed"], r["settings"]["iters"]
    for kind in ("kaiju", "mla"):
        assert abs(s[kind]["params"] / s["llama"]["params"] - 1) < 0.01, kind
        diffs = [per[kind][seed]["valid_loss"] - per["llama"][seed]["valid_loss"] for seed in per["llama"]]
        assert len(diffs) >= 2
        assert s[kind]["vs_llama"]["diff_mean"] == pytest.approx(statistics.fmean(diffs))
        assert s[kind]["vs_llama"]["diff_std"] == pytest.approx(statistics.stdev(diffs))
    for kind, seeds in per.items():
        assert s[kind]["valid_loss"]["std"] == pytest.approx(statistics.stdev(v["valid_loss"] for v in seeds.values()))
        assert all(len(v["train_loss"]) == iters and v["curve"][-1][0] == iters for v in seeds.values()), kind
        b = seeds[str(r["seeds"][0])]["branches"]["auto"]
        assert b["tokens_equal"] == b["tokens"] == b["branches"] * b["new_tokens"], kind
        assert b["forward_tokens"] < b["forward_tokens_separate"]

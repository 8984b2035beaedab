"""The arithmetic of bench/squinch_phases.py and bench/squinch_scale.py, on synthetic measurements with
known answers (the benches themselves need root and a quiet machine; their --quick runs are checked in
test_scale_bench_quick.py)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import squinch_phases as P  # noqa: E402
import squinch_scale as S  # noqa: E402

from megatron_cai.core.distributed.comm_timing import timeline_log_lines  # noqa: E402

KIB = 1024


def _link(alpha: float, beta: float, cpu: float, sizes=(64 * KIB, 1024 * KIB, 16384 * KIB),
          issue=(1e-4, 0.0)) -> dict:
    """Samples of a link whose every collective takes steps x alpha + wire bytes / beta exactly, and
    issue[0] + issue[1] x wire bytes to issue."""
    samples = {}
    for op, dt in P.OPS:
        name = P.op_key(op, dt)
        samples[name] = {}
        for s in sizes:
            x = P.wire_bytes_at_2(op, s)
            t = P.STEPS_AT_2[op] * alpha + x / beta
            samples[name][str(s)] = {"median_s": t, "min_s": t, "max_s": t, "runs_s": [t],
                                     "issue_s": issue[0] + issue[1] * x,
                                     "cpu_s": 2e-5 + cpu * x}
    return {"rate_mbit": None, "loopback": False, "load": "", "samples": samples}


def test_fit_link_recovers_alpha_beta_and_transport_cpu():
    fits = P.fit_link(_link(alpha=3e-4, beta=2.5e7, cpu=4e-9))
    assert set(fits) == {"allreduce_fp32", "allreduce_bf16", "reduce_scatter_fp32", "reduce_scatter_bf16",
                         "all_to_all", "all_gather"}
    for f in fits.values():
        assert f["alpha_s"] == pytest.approx(3e-4, rel=1e-6)  # per step: the all-reduce's intercept is 2 steps
        assert f["bytes_per_s"] == pytest.approx(2.5e7, rel=1e-6)
        assert f["cpu_s_per_byte"] == pytest.approx(4e-9, rel=1e-3) and f["max_rel_residual"] < 1e-9


def test_fit_line_never_returns_a_negative_latency():
    # t = x / 10 - 1 (a burst made small messages look free): refit through the origin, weights 1/t:
    # b = sum(x/t) / sum((x/t)^2) = (100/9 + 200/19 + 400/39) / ((100/9)^2 + (200/19)^2 + (400/39)^2)
    a, b, _ = P.fit_line([100.0, 200.0, 400.0], [9.0, 19.0, 39.0])
    q = (100 / 9, 200 / 19, 400 / 39)
    assert a == 0.0 and b == pytest.approx(sum(q) / sum(v * v for v in q), rel=1e-9)


def test_fit_codec_recovers_launch_and_rates():
    launch, rates = 7e-6, {"encode": 5e8, "decode_accumulate": 9e8, "decode": 7e8, "memory": 4e9}
    samples = []
    for el in (65536, 1048576):
        for kind, rows_list in (("encode", (1, 2, 16)), ("decode_accumulate", (2, 16)), ("decode", (2, 16)),
                                ("memory", (1,))):
            for rows in rows_list:
                amount = el * 8 if kind == "memory" else el
                t = P.codec_launches(kind, rows) * launch + amount / rates[kind]
                samples.append({"kind": kind, "elements": el, "rows": rows, "median_s": t})
    fit = P.fit_codec({"samples": samples})
    assert fit["launch_s"] == pytest.approx(launch, rel=1e-6)
    assert fit["encode_elems_per_s"] == pytest.approx(5e8, rel=1e-6)
    assert fit["decode_accumulate_elems_per_s"] == pytest.approx(9e8, rel=1e-6)
    assert fit["decode_elems_per_s"] == pytest.approx(7e8, rel=1e-6)
    assert fit["memory_bytes_per_s"] == pytest.approx(4e9, rel=1e-6)
    # comm_model's launch counts: encode of 16 rows = 18 launches, decode-accumulate 3, a copy 1
    assert (P.codec_launches("encode", 16), P.codec_launches("decode_accumulate", 16),
            P.codec_launches("memory", 1)) == (18, 3, 1)


def test_timeline_lines_parse_back():
    """The bench reads what training prints at --timing-log-level 2 (the producer's own formatter)."""
    steps = []
    for it, shift in ((1, 100.0), (2, 0.0), (3, 2.0), (4, 4.0)):  # iteration 1 is warm-up
        t = {"steps": 1, "buckets": [(1, 5000, 20.0 + shift, 18.0 + shift), (0, 3000, 12.0 + shift, 11.0 + shift)],
             "backward end": 30.0 + shift, "backward end compute": 27.0 + shift, "sync end": 40.0 + shift,
             "step end": 45.0 + shift, "after sync": 5.0 + shift, "reducer host": 3.0}
        steps += [f" iteration {it}/ 4 | elapsed time per iteration (ms): 1.0 |"] + timeline_log_lines(it, [t])
    got = S.parse_timeline("\n".join(steps), warmup=1)
    assert got["bucket_elems"] == [3000, 5000]  # in ready order
    assert got["ready_ms"] == [13.0, 20.0] and got["backward_end_ms"] == 29.0 and got["after_sync_ms"] == 7.0
    assert got["iterations"] == 3
    tl = S.timeline_of(got)
    assert tl.bucket_elems == (3000, 5000) and tl.ready_s == pytest.approx((0.013, 0.020))
    assert tl.compute_s == pytest.approx(0.036)


def _phases() -> dict:
    links = {k: _link(2e-4, r * 1e6 / 8 * 0.9, 1e-9) for k, r in (("256", 256), ("64", 64))}
    links["unshaped"] = _link(1e-4, 3e8, 1e-9)
    links["loopback"] = _link(5e-5, 6e8, 1e-9)
    codec = {"launch_s": 1e-5, "encode_elems_per_s": 5e8, "decode_accumulate_elems_per_s": 9e8,
             "decode_elems_per_s": 7e8, "memory_bytes_per_s": 4e9}
    return {"fits": {"links": {k: P.fit_link(v) for k, v in links.items()}, "codec": codec}}


def test_inter_tier_between_measured_rates():
    ph = _phases()
    t128 = S.inter_tier(ph, 128)  # not measured: 90% of the rate, as at 64 and 256 Mbit/s
    assert t128.cost("allreduce", "fp32").bytes_per_s == pytest.approx(0.9 * 128e6 / 8, rel=1e-6)
    assert t128.cost("all_to_all", "uint8").alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert (t128.burst_bytes, t128.refill_bytes_per_s) == (64 * KIB, 16e6)
    t256 = S.inter_tier(ph, 256)
    assert t256.cost("all_gather", "uint8").bytes_per_s == pytest.approx(0.9 * 32e6, rel=1e-6)
    unshaped = S.inter_tier(ph, None)
    assert unshaped.burst_bytes == 0 and unshaped.cost("allreduce", "bf16").bytes_per_s == pytest.approx(3e8)


def test_inter_tier_interpolates_in_log_rate_between_its_neighbours():
    """At 128 Mbit/s, half-way in log(rate) between 64 (90% efficient, alpha 2e-4) and 256 (70%, 4e-4):
    80% and 3e-4; above the fastest measured rate, the fastest's efficiency."""
    def link(eff: float, alpha: float) -> dict:
        return {"allreduce_fp32": {"alpha_s": alpha, "bytes_per_s": eff, "issue_s": alpha, "issue_s_per_byte": 0.0,
                                   "cpu_s_per_byte": 1e-9}}
    ph = {"fits": {"links": {"64": link(0.9 * 8e6, 2e-4), "256": link(0.7 * 32e6, 4e-4),
                             "unshaped": link(1e9, 1e-4), "loopback": link(1e9, 1e-5)}}}
    mid = S.inter_tier(ph, 128).cost("allreduce", "fp32")
    assert (mid.bytes_per_s, mid.alpha_s, mid.issue_s) == pytest.approx((0.8 * 16e6, 3e-4, 3e-4))
    assert S.inter_tier(ph, 1024).cost("allreduce", "fp32").bytes_per_s == pytest.approx(0.7 * 128e6)
    assert S.inter_tier(ph, 16).cost("allreduce", "fp32").alpha_s == pytest.approx(2e-4)


def test_validation_rows_ratios_and_drift():
    ph = _phases()
    tl = {"bucket_elems": [100000, 100000], "ready_ms": [10.0, 20.0], "backward_end_ms": 25.0,
          "after_sync_ms": 3.0, "raw_step_ms": 40.0, "profile": "synthetic"}
    g = S.Group("small", 2, 256, True, ("fp32", "squinch"))
    pred = {label: S.predict_row(ph, tl, 2, 256, True, label).step_s for label in g.configs}
    meas = {label: {"median_s": 1.1 * pred[label], "spread": 0.01} for label in g.configs}  # the model 10% low
    quarter = {"size": "small", "B_mbit": 500.0, "compute_s": 0.028, "fp32_bytes": 800000,
               "fp32": {"median_s": 0.05, "spread": 0.0}, "squinch": {"median_s": 0.04, "spread": 0.0},
               "squinch/fp32": {"ratio": 0.8, "min": 0.8, "max": 0.8}}
    v = S.validate([(g, meas)], quarter, {"small|2": tl}, ph)
    assert [r["ratio"] for r in v["rows"][:2]] == pytest.approx([1 / 1.1, 1 / 1.1])
    assert len(v["rows"]) == 4 and v["max_abs_error"] >= v["median_abs_error"] > 0
    assert quarter["predicted squinch/fp32"] == pytest.approx(v["rows"][3]["predicted_s"] / v["rows"][2]["predicted_s"])
    res = {"groups": [{"key": g.key, "configs": list(g.configs), "rows": meas}], "quarter": quarter, "validation": v}
    r = S.ratios(res)
    assert r[f"{g.key} squinch/fp32"] == pytest.approx(pred["squinch"] / pred["fp32"])
    moved = {**res, "quarter": {**quarter, "squinch/fp32": {"ratio": 0.85}}}
    lines = S.compare(res, moved, 0.05)
    assert [x for x in lines if x.startswith("DRIFT")] == ["DRIFT quarter small squinch(B/4)/fp32(B): 0.800 -> 0.850 "
                                                            "(6.2%)"]


def test_doc_section_is_rewritten_between_its_markers(tmp_path, monkeypatch):
    ph = _phases()
    ph["load_before"] = "load average 0.10"
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{S.DOC_BEGIN}\nold text\n{S.DOC_END}\noutro\n")
    monkeypatch.setattr(S, "DOC", str(doc))
    run = {"run_id": "1", "wall_s": 1200.0, "validation": {"rows": [{}] * 23, "median_abs_error": 0.04,
                                                         "max_abs_error": 0.15},
           "quarter": {"squinch/fp32": {"ratio": 0.912}, "predicted squinch/fp32": 0.9}}
    run2 = {**run, "run_id": "2", "compare": {"path": "bench/results/squinch_scale.json", "limit": 0.05,
                                              "lines": ["ok a: 1 -> 1 (0.0%)", "DRIFT b: 1 -> 2 (100.0%)"]}}
    (tmp_path / "squinch_scale.json").write_text(__import__("json").dumps(run))
    (tmp_path / "squinch_scale_run2.json").write_text(__import__("json").dumps(run2))
    (tmp_path / "squinch_scale_quick.json").write_text("{}")  # not a run of record
    for _ in range(2):  # idempotent
        S.update_doc(str(tmp_path), ph)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old text" not in text
    assert text.count(S.DOC_BEGIN) == 1 and "| 1 | 23 | 4.0% / 15.0% | 0.912 / 0.900 | 20.0 min |" in text
    assert "| 2 vs bench/results/squinch_scale.json | 2 ratios | 1 moved by more than 5% | | |" in text
    assert "| 256 Mbit/s | 200 / 230 |" in text  # alpha 200 us per step, beta 0.9 x 256 Mbit/s


def test_fit_link_bounds_beta_when_time_does_not_grow():
    link = _link(alpha=1e-3, beta=1e9, cpu=0.0, sizes=(64 * KIB, 256 * KIB))
    for by_size in link["samples"].values():  # noise: the larger message measured faster
        by_size[str(256 * KIB)]["median_s"], by_size[str(64 * KIB)]["median_s"] = 1e-3, 2e-3
    fits = P.fit_link(link)
    f = fits["all_to_all"]  # wire bytes at n = 2: half the buffer
    assert f["beta_is_bound"] and f["bytes_per_s"] == pytest.approx(128 * KIB / 1e-3)
    assert fits["allreduce_fp32"]["bytes_per_s"] == pytest.approx(256 * KIB / 1e-3)


def _round(load: str, **steps: float) -> dict:
    return {"load": load, **{k: {"step_s": t, "steps_ms": [1e3 * t] * 20, "bytes": 1, "phases_ms": {}}
                             for k, t in steps.items()}}


def test_noisy_groups_are_named_for_a_remeasure():
    rows = {"timeline|small|2|unshaped#0": {"bucket_elems": [1], "load": "x"},
            # bf16 spreads (1.2 - 1.0) / 1.1 = 18% over its rounds
            **{f"dp2|small|256|False#{i}": _round("x", fp32=1.0, bf16=t) for i, t in enumerate((1.0, 1.1, 1.2))},
            **{f"dp2|small|64|True|rest#{i}": _round("x", fp32=1.0 + i / 100) for i in range(3)},  # 2%
            **{f"quarter-fp32|large|813#{i}": _round("x", fp32=1.0, squinch=0.5 * (1 + i / 10)) for i in range(3)}}
    assert S.noisy_keys(rows, 0.10) == ["dp2|small|256|False", "quarter-fp32|large|813"]
    assert S.noisy_keys(rows, 0.25) == []
    S.drop_rounds(rows, "dp2|small|256|False")
    assert sorted(rows) == ["dp2|small|64|True|rest#0", "dp2|small|64|True|rest#1", "dp2|small|64|True|rest#2",
                            "quarter-fp32|large|813#0", "quarter-fp32|large|813#1", "quarter-fp32|large|813#2",
                            "timeline|small|2|unshaped#0"]


def test_rounds_run_round_major_and_resume(tmp_path, monkeypatch):
    """Round i of every group runs before round i + 1 of any; finished rounds are not measured again; a
    group's summary takes its runs in round order, so a paired ratio pairs runs of one round."""
    from harness.shaped_link import RowCache

    calls = []

    def fake_measure(plan, opts):
        calls.append(plan.base)
        n = calls.count(plan.base)  # this plan's n-th round: step times 1, 2, 3 (x 10 for squinch)
        return _round(f"load {len(calls)}", **{k: n * (10 if k == "squinch" else 1) for k in plan.labels})

    monkeypatch.setattr(S.Plan, "measure", fake_measure)
    g = S.Group("small", 2, 256, True, ("fp32", "bf16"))
    a = S.group_plan(g, g.configs, S.store_of(g, {}), lambda *_: 20)
    q = S.quarter_plan("large", 800.0, lambda *_: 20)
    opts = __import__("argparse").Namespace(repeats=3)
    rows = RowCache(str(tmp_path / "rows.json"), {}, fresh=False)
    rows.rows[S.round_key(a.base, 0)] = _round("earlier", fp32=1.0, bf16=1.0)  # an earlier invocation's round
    S.measure_rounds([a, q], opts, rows)
    assert calls == [q.base, a.base, q.base, a.base, q.base]
    assert all(rows.rows[S.round_key(q.base, i)]["wall_s"] >= 0 for i in range(3))  # the report's time per part
    assert q.labels == ("fp32", "squinch") and q.runs[1][1] == 200.0  # Squinch at B/4
    again = RowCache(str(tmp_path / "rows.json"), {}, fresh=False)
    S.measure_rounds([a, q], opts, again)
    assert len(calls) == 5  # all rounds on disk
    quarter = S.quarter_group("large", 800.0, 0.3, 123, again)
    assert quarter["fp32"]["runs_s"] == [1, 2, 3] and quarter["squinch"]["runs_s"] == [10, 20, 30]
    assert quarter["squinch/fp32"] == {"ratio": 10.0, "min": 10.0, "max": 10.0}
    assert quarter["load"] == "load 1; load 3; load 5"
    group = S.group_rows(g, opts, again, {})
    assert group["fp32"]["runs_s"] == [1.0, 1, 2] and group["fp32"]["median_s"] == 1
    assert group["fp32"]["steps"] == [20, 20, 20]


def test_short_steps_run_for_the_minimum_time_at_the_predicted_step(monkeypatch):
    """A configuration's steady steps cover --min-steady-s at the step the model predicts for it (never
    fewer than --steps), and its plan runs exactly that many."""
    opts = __import__("argparse").Namespace(steps=20, warmup=3, min_steady_s=4.0)
    assert S.steps_for(0.065, opts) == 62 and S.steps_for(0.2, opts) == 20 and S.steps_for(0.199, opts) == 21
    ns = __import__("argparse").Namespace
    assert S.steps_for(0.3, opts) == 20 and S.steps_for(0.01, ns(steps=4, min_steady_s=0.0)) == 4  # --quick
    ph = _phases()
    tl = {"bucket_elems": [100000, 100000], "ready_ms": [10.0, 20.0], "backward_end_ms": 25.0,
          "after_sync_ms": 3.0, "raw_step_ms": 40.0, "profile": "synthetic"}
    steps = S.model_steps(ph, {"small|2": tl}, opts)
    fast, slow = S.Group("small", 2, None, True, ("bf16",)), S.Group("small", 2, 1, True, ("fp32",))
    assert steps(fast, "bf16") == S.steps_for(S.predict_row(ph, tl, 2, None, True, "bf16").step_s, opts) > 20
    assert steps(slow, "fp32") == 20  # 1 Mbit/s: seconds a step
    ran = []
    monkeypatch.setattr(S, "setup_link", lambda rate: None)
    monkeypatch.setattr(S, "load", lambda: "quiet")
    monkeypatch.setattr(S, "run_job", lambda flags, per_host, n, warmup, env: ran.append((n, warmup)) or {"n": n})
    plan = S.group_plan(fast, ("bf16",), fast.key, steps)
    assert plan.measure(opts) == {"load": "quiet", "bf16": {"n": steps(fast, "bf16")}}
    assert ran == [(steps(fast, "bf16"), 3)]
    q = S.quarter_plan("small", 500.0, lambda g, label: 30 if label == "fp32" else 40)
    assert [(label, rate, n) for label, rate, _, _, n in q.runs] == [("fp32", 500.0, 30), ("squinch", 125.0, 40)]


def test_a_plan_with_more_rounds_goes_on_after_the_others(tmp_path, monkeypatch):
    """The large model's plans take --repeats-large rounds: the same round-major order while every plan has
    rounds left, then the longer plans alone; ``rounds`` caps every plan (the timelines' first round)."""
    from harness.shaped_link import RowCache

    calls = []
    monkeypatch.setattr(S.Plan, "measure",
                        lambda plan, opts: calls.append(plan.base) or _round("x", **dict.fromkeys(plan.labels, 1.0)))
    g = S.Group("small", 2, 256, True, ("fp32",))
    small = S.group_plan(g, g.configs, g.key, lambda *_: 20)
    q = S.quarter_plan("large", 800.0, lambda *_: 20, rounds=5)
    rows = RowCache(str(tmp_path / "rows.json"), {}, fresh=False)
    opts = __import__("argparse").Namespace(repeats=3)
    S.measure_rounds([small, q], opts, rows, rounds=1)
    assert calls == [small.base, q.base]
    S.measure_rounds([small, q], opts, rows)
    assert calls == [small.base, q.base] * 3 + [q.base, q.base]
    assert len(S.rounds_of(rows.rows, q.base)) == 5 and len(S.rounds_of(rows.rows, small.base)) == 3


def test_a_repeat_measures_the_quarter_row_at_the_b_of_the_run_it_is_compared_with(tmp_path):
    import json

    first = tmp_path / "first.json"
    first.write_text(json.dumps({"quarter": {"size": "large", "B_mbit": 665.7}}))
    assert S.compared_b(str(first), "large") == 665.7
    assert S.compared_b(str(first), "toy") is None and S.compared_b(None, "large") is None
    q = {"B_mbit": 665.7, "own_B_mbit": 695.2, "fp32_bytes": 24442368, "compute_s": 0.2813}
    assert S.b_origin(q) == ("B = 666 Mbit/s, the B of the run compared with, so that both runs measure the same "
                             "links (fp32's 24442368 gradient bytes per step over the 281 ms of compute give 695 "
                             "Mbit/s)")
    assert S.b_origin({**q, "own_B_mbit": 665.7}).startswith("B = 666 Mbit/s (fp32's 24442368")


def test_a_timeline_is_the_median_of_its_rounds():
    def tl(ready, end, after, raw, load):
        return {"bucket_elems": [10, 20], "ready_ms": ready, "backward_end_ms": end, "after_sync_ms": after,
                "raw_step_ms": raw, "iterations": 20, "load": load, "profile": "bf16"}
    rounds = [tl([1.0, 5.0], 9.0, 2.0, 12.0, "a"), tl([3.0, 4.0], 7.0, 1.0, 10.0, "b"),
              tl([2.0, 6.0], 8.0, 3.0, 20.0, "c")]
    t = S.timeline_of_rounds(rounds)
    assert t["ready_ms"] == [2.0, 5.0] and (t["backward_end_ms"], t["after_sync_ms"], t["raw_step_ms"]) == (8, 2, 12)
    assert t["iterations"] == 60 and t["runs"] == 3 and t["load"] == "c" and t["bucket_elems"] == [10, 20]
    assert S.timeline_of_rounds([t, t])["runs"] == 6  # rounds of runs: every process counted
    assert S.timeline_processes({"timelines": {"small|2": {"runs": 9}, "large|2": {"runs": 15}}}) == \
        " (the median of 9-15 processes)"
    assert S.timeline_processes({"timelines": {"small|2": {"runs": 9}}}) == " (the median of 9 processes)"
    assert S.timeline_processes({"timelines": {"small|2": {}}}) == ""  # one process, before the rounds
    rounds[1]["bucket_elems"] = [30]
    with pytest.raises(RuntimeError, match="different buckets"):
        S.timeline_of_rounds(rounds)


def test_a_link_is_the_median_of_every_round():
    def raw(times, cpu, load):
        return {"rate_mbit": 64.0, "loopback": False, "load": load,
                "raw": {"times": {"allreduce_fp32|65536": times}, "issue": {"allreduce_fp32|65536": [1e-4] * 2},
                        "cpu": {"allreduce_fp32|65536": cpu}}}
    link = P.link_of([raw([1.0, 9.0], [0.1, 0.2], "first"), raw([2.0, 3.0], [0.3, 0.4], "mid"),
                      raw([4.0], [0.5], "last")])
    cell = link["samples"]["allreduce_fp32"]["65536"]
    assert cell["runs_s"] == [1.0, 9.0, 2.0, 3.0, 4.0] and cell["median_s"] == 3.0
    assert (cell["min_s"], cell["max_s"], cell["cpu_s"]) == (1.0, 9.0, 0.3)
    assert link["load"] == "first ... last" and link["rate_mbit"] == 64.0


def test_a_resumed_run_counts_the_time_of_every_invocation(tmp_path):
    from harness.shaped_link import RowCache

    path = str(tmp_path / "rows.json")
    first = RowCache(path, {"steps": 20}, fresh=False)
    first.get("a", lambda: {"median_s": 1.0})
    first.spent.append(780.0)  # an invocation refused as noisy
    first.save()
    again = RowCache(path, {"steps": 20}, fresh=False)
    assert again.rows == {"a": {"median_s": 1.0}} and again.spent == [780.0]
    again.spent.append(30.0)
    res = {"wall_s": sum(again.spent), "invocations": len(again.spent)}
    assert S.invocations(res) == " over 2 invocations" and S.invocations({"wall_s": 1.0}) == ""
    assert RowCache(path, {"steps": 20}, fresh=True).spent == []
    parts = {"phases_wall_s": 162.0, "parts_wall_s": {"timelines": 210.0, "real set": 768.0, "quarter row": 156.0}}
    assert S.wall_parts(parts) == "phases 2.7 min, timelines 3.5 min, real set 12.8 min, quarter row 2.6 min"
    # a run resumed by a build that did not yet add the phases' time of every invocation
    assert S.wall_parts({"phases_wall_s": 0.01}) == "phases in an earlier invocation, time not recorded"
    assert RowCache(path, {"steps": 40}, fresh=False).spent == []  # other settings: another run


def test_from_five_rounds_one_stray_process_at_each_end_does_not_count_as_spread():
    assert S.inner_spread([1.0, 1.1, 1.2]) == pytest.approx(0.2 / 1.1)  # 3 rounds: every one counts
    assert S.inner_spread([1.0, 1.1, 1.2, 1.0]) == pytest.approx(0.2 / 1.05)
    assert S.inner_spread([1.5, 1.0, 1.02, 0.9, 1.01]) == pytest.approx(0.02 / 1.01)  # without 0.9 and 1.5
    assert S.inner_spread([1.0, 1.0, 1.3, 1.3, 1.0]) == pytest.approx(0.3 / 1.0)  # two slow ones still count


def test_a_noisy_group_gets_more_rounds_and_is_judged_without_its_stray_ends(tmp_path, monkeypatch):
    """A group whose rounds spread above the limit gets --extra-rounds more; from 5 rounds its fastest and
    slowest no longer count, so one stray process passes and a group that stays noisy is still named."""
    from harness.shaped_link import RowCache

    steps = {"dp2|small|256|True": [1.0, 1.2, 1.01, 1.02, 0.99], "dp2|small|64|True": [1.0, 1.3, 1.3, 1.0, 1.0],
             "dp2|small|1000|True": [1.0, 1.01, 1.02, 9.0, 9.0]}
    calls = []

    def fake_measure(plan, opts):
        calls.append(plan.base)
        return _round("x", bf16=steps[plan.base][calls.count(plan.base) - 1])

    monkeypatch.setattr(S.Plan, "measure", fake_measure)
    plans = [S.group_plan(g, g.configs, g.key, lambda *_: 20)
             for g in (S.Group("small", 2, rate, True, ("bf16",)) for rate in (256, 64, 1000))]
    rows = RowCache(str(tmp_path / "rows.json"), {}, fresh=False)
    opts = __import__("argparse").Namespace(repeats=3)
    S.measure_rounds(plans, opts, rows)
    assert S.noisy_keys(rows.rows, 0.10) == ["dp2|small|256|True", "dp2|small|64|True"]
    S.extend_noisy(plans, opts, rows, 0.10, 0)
    assert len(calls) == 9  # no extra rounds asked for
    S.extend_noisy(plans, opts, rows, 0.10, 2)
    assert sorted(calls[9:]) == ["dp2|small|256|True"] * 2 + ["dp2|small|64|True"] * 2  # the quiet one: not again
    assert S.noisy_keys(rows.rows, 0.10) == ["dp2|small|64|True"]  # 1.0 1.0 1.0 1.3 1.3: two slow rounds
    S.extend_noisy(plans, opts, rows, 0.10, 2)
    assert len(calls) == 13  # extended once: its rounds are its own + 2, all measured
    summary = S.group_rows(plans[0].runs[0][2], opts, rows, {})["bf16"]
    assert len(summary["runs_s"]) == 5 and summary["median_s"] == 1.01 and summary["inner_spread"] < 0.10


def test_the_report_names_the_groups_measured_in_more_rounds_than_planned():
    def group(key, size, **runs):
        return {"key": key, "size": size, "rows": {"load": "x", **{k: {"runs_s": [1.0] * n} for k, n in runs.items()}}}

    reused = group("c", "small", bf16=3)
    reused["rows"]["fp32"] = {"runs_s": [1.0] * 9, "reused": True}  # a squinch_bandwidth row: not this run's rounds
    res = {"settings": {"repeats": 3, "repeats_large": 5},
           "groups": [group("a", "small", bf16=5), group("b", "large", bf16=5), reused],
           "quarter": {"size": "large", "fp32": {"runs_s": [1.0] * 7}}}
    assert S.extended(res) == (" Noisy after its planned rounds, so measured in more (--extra-rounds): "
                               "a 5, quarter large 7.")
    res["quarter"]["fp32"]["runs_s"], res["groups"] = [1.0] * 5, res["groups"][1:]
    assert S.extended(res) == ""


def test_fit_link_fits_the_issue_time_as_a_line_in_bytes():
    """gloo's all-to-all takes ~0.1 ms to issue at 64 KiB and ~8 ms at 64 MiB: one median over the sizes
    fell on that knee."""
    fits = P.fit_link(_link(alpha=3e-4, beta=2.5e7, cpu=4e-9, issue=(5e-5, 2e-10)))
    for f in fits.values():
        assert f["issue_s"] == pytest.approx(5e-5, rel=1e-6) and f["issue_s_per_byte"] == pytest.approx(2e-10, rel=1e-6)
    flat = P.fit_link(_link(alpha=3e-4, beta=2.5e7, cpu=4e-9))["all_to_all"]
    assert flat["issue_s"] == pytest.approx(1e-4, rel=1e-6) and flat["issue_s_per_byte"] == pytest.approx(0, abs=1e-15)


def test_dp4_on_two_cores_runs_host_work_at_half_speed():
    """Phases measured by 2 processes on 2 CPUs; a DP = 4 job runs 4 there: every host cost of a rank
    doubles (codec, issue, transport CPU, the loopback's bandwidth), the shaped veth's bandwidth does not."""
    ph = {**_phases(), "load_before": "load average 0.50, 0.40, 0.30 on 2 CPUs"}
    assert S.shared_cores(ph, 2) == 1.0 and S.shared_cores(ph, 4) == 2.0
    assert S.shared_cores({**ph, "load_before": "load average 0.1, 0.1, 0.1 on 8 CPUs"}, 4) == 1.0
    assert S.shared_cores(_phases(), 4) == 1.0  # a synthetic input that does not say
    loop = S.op_costs(ph["fits"]["links"]["loopback"])["all_to_all"]
    half = S.on_shared_cores(loop, 2.0, beta_is_cpu=True)
    assert (half.bytes_per_s, half.issue_s, half.cpu_s_per_byte, half.alpha_s) == pytest.approx(
        (loop.bytes_per_s / 2, 2 * loop.issue_s, 2 * loop.cpu_s_per_byte, loop.alpha_s))
    veth = S.on_shared_cores(loop, 2.0, beta_is_cpu=False)
    assert veth.bytes_per_s == loop.bytes_per_s and veth.issue_s == pytest.approx(2 * loop.issue_s)
    codec = S.codec_on_shared_cores(S.codec_of(ph), 2.0)
    assert (codec.encode_elems_per_s, codec.launch_s) == pytest.approx((5e8 / 2, 2e-5))
    # a DP = 4 Squinch step over a fast link with all of it after backward: slower with 4 ranks on 2 cores
    tl = {"bucket_elems": [400000], "ready_ms": [20.0], "backward_end_ms": 20.0, "after_sync_ms": 1.0,
          "raw_step_ms": 30.0, "profile": "synthetic"}
    own_cores = {**ph, "load_before": "load average 0.5, 0.4, 0.3 on 4 CPUs"}
    slow, fast = (S.predict_row(p, tl, 4, None, False, "hierarchical").step_s for p in (ph, own_cores))
    assert slow > fast

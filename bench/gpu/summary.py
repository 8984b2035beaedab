"""Summary of a GPU validation run: gpu_summary.md from the step JSONs in OUT (and printed, so the last
lines of the run's output say everything even if no file came back). No torch import: it runs even when
the steps could not.

- gpu_summary.md stays under SUMMARY_LIMIT_BYTES (10 KB; the output tail that comes back is 12 KB): each
  table shows its step's decisive columns, cells and problem lines are shortened (the JSONs keep all).
- ``--step NAME:STATUS:SECONDS:LIMIT --rc RC`` (validate.sh, after each step): a step JSON still saying
  ``running`` (the process was killed past its SIGTERM handler, or died) becomes ``killed`` (rc 124 / 137 /
  143) or ``crashed``, and the step's one summary line is printed, so it is in the output tail as the
  run goes.

    python bench/gpu/summary.py --out DIR --steps "env:ok:9:20 codec:TIMEOUT:40:40 ..." [--total-s N]
    python bench/gpu/summary.py --out DIR --step training:ok:140:160 --rc 0
"""
from __future__ import annotations

import argparse
import json
import os

SUMMARY_LIMIT_BYTES = 10_000
CELL_MAX = 32  # characters of one table cell
PROBLEMS_MAX = 6  # pytest problems listed (each cut to PROBLEM_CHARS)
PROBLEM_CHARS = 140
KILLED_RC = (124, 137, 143)  # timeout's exit status, SIGKILL, SIGTERM
# Columns left out of the summary tables (their values are in the step JSONs).
OMIT = {"codec": {"timing"}, "attention": {"batch", "kernels", "fwd_TFLOPs", "bwd_TFLOPs"},
        "training": {"params_M", "TFLOPs", "MFU_datasheet"}}
STEP_FILES = {"env": "gpu_env.json", "codec": "gpu_codec.json", "attention": "gpu_attention.json",
              "training": "gpu_train.json", "qat": "gpu_qat.json", "pytest": "gpu_pytest.json",
              "cp": "gpu_context_parallel.json", "overhead": "gpu_overhead.json"}  # the last two: --extra


def _fmt(v) -> str:
    if isinstance(v, float):  # 3 significant digits; whole numbers from 1000 up (tokens/s, elements)
        return f"{v:.0f}" if 1e3 <= abs(v) < 1e9 else f"{v:.3g}"
    text = "" if v is None else str(v).replace("|", "/").replace("\n", " ")
    return text if len(text) <= CELL_MAX else text[:CELL_MAX - 3] + "..."


def table(rows: list[dict], columns: list[str], omit: set[str] = frozenset()) -> str:
    if not rows:
        return "(no rows)"
    cols = [c for c in columns if c not in omit and any(r.get(c) is not None for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def load(out: str, name: str) -> dict | None:
    if name not in STEP_FILES:
        return None
    try:
        with open(os.path.join(out, STEP_FILES[name])) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def goals(res: dict) -> list[str]:
    """The issue's goals, each with the measured figure (or why it is missing)."""
    out = []
    codec = res.get("codec")
    if codec and codec.get("encode_ef_ratio_min") is not None:
        r = codec["encode_ef_ratio_min"]
        out.append(f"codec encode + error feedback >= 0.7 of copy bandwidth: {r:.3f} "
                   f"({'met' if r >= 0.7 else 'NOT met'})")
    att = res.get("attention")
    for layout, method, phrase, want in (("plain causal", "sdpa flash", "ours >= 0.7 of SDPA flash", 0.7),
                                         ("packed trees", "flex", "ours faster than FlexAttention", 1.0)):
        rows = [r for r in (att or {}).get("rows", []) if r.get("layout") == layout and r.get("method") == method]
        for r in rows:
            vals = [r.get("fwd_vs_ours"), r.get("bwd_vs_ours")]
            if None in vals:
                continue
            met = all(v >= want for v in vals) if want < 1 else all(v > want for v in vals)
            out.append(f"attention T={r['seq']} {layout}: {phrase}: fwd {vals[0]:.2f}, bwd {vals[1]:.2f} "
                       f"(method time / ours; {'met' if met else 'NOT met'})")
    train = res.get("training")
    for r in (train or {}).get("rows", []):
        if r.get("kind") == "ours" and not r.get("flags") and r.get("vs_peer") is not None:
            out.append(f"training {r['model']} plain causal >= 0.9 of the compiled peer: {r['vs_peer']:.3f} "
                       f"({'met' if r['vs_peer'] >= 0.9 else 'NOT met'})")
        if r.get("kind") == "peer-compiled" and r.get("compile"):
            c = r["compile"]
            out.append(f"compiled peer {r['model']}: {c['unique_graphs']} graph(s), {c['graph_breaks']} graph "
                       f"breaks ({'compiled once' if not r.get('error') else 'NOT a compiled reference'})")
    rows = (train or {}).get("rows", [])
    for ours, theirs in zip(rows, rows[1:]):
        if ours.get("kind") == "ours-alternated" and theirs.get("kind") == "megatron-core" \
                and theirs.get("step_ms") is not None:
            out.append(f"training {ours['model']} ours vs megatron-core GPTModel, alternated: "
                       f"{ours['step_ms']:.1f} ms (spread {ours['spread_ms']:.1f}) vs {theirs['step_ms']:.1f} ms "
                       f"(spread {theirs['spread_ms']:.1f}) per iteration; tokens/s ratio "
                       f"{ours['vs_megatron_core']:.3f}; MFU {ours['MFU_measured']:.3f} vs "
                       f"{theirs['MFU_measured']:.3f}")
    for r in (res.get("overhead") or {}).get("rows", []):
        if r.get("vs_uncompiled") is not None:
            out.append(f"{r['model']} {r['row']}: tokens/s with / without --compile {r['vs_uncompiled']:.3f}")
    for r in (res.get("cp") or {}).get("rows", []):
        out.append(f"CP=4 {r['batch']}: busiest rank / CP=1 time "
                   f"{r['busiest rank ms'] / r['CP=1 fwd+bwd ms']:.3f}, max error out {r['max err out']:.2g}, "
                   f"dq {r['max err dq']:.2g}")
    return out or ["no goal could be evaluated (see the steps)"]


def render(out: str, steps: str, total_s: int | None, dry_run: bool) -> str:
    res = {name: load(out, name) for name in STEP_FILES}
    env = next((d["environment"] for d in res.values() if d and d.get("environment")), {})
    ceil = (res.get("env") or {}).get("ceilings", {})
    lines = [f"# GPU validation summary{' (DRY RUN: toy sizes on the CPU)' if dry_run else ''}", ""]
    lines.append(f"{env.get('device', '?')} (sm_{env.get('capability', '?')}); torch {env.get('torch', '?')}, "
                 f"triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}, Python {env.get('python', '?')}; "
                 f"{env.get('date', '')}, load {env.get('loadavg', '?')}.")
    if ceil:
        lines.append(f"Ceilings: copy {ceil.get('copy_GBps', 0):.0f} GB/s (measured), bf16 matmul "
                     f"{ceil.get('bf16_matmul_TFLOPs', 0):.0f} TFLOP/s (measured, {ceil.get('matmul_size')}^3), "
                     f"datasheet bf16 {ceil.get('datasheet_bf16_TFLOPs')} TFLOP/s.")
    missing = [m for m, ok in (res.get("env") or {}).get("modules", {}).items() if not ok]
    if missing:
        lines.append(f"Not installed: {', '.join(missing)}.")
    lines += ["", "| step | status | seconds | limit s | rows | skipped |", "|---|---|---|---|---|---|"]
    limit_sum = 0
    for item in steps.split():
        name, status, secs, limit = (item.split(":") + ["", "", ""])[:4]
        limit_sum += int(limit or 0)
        data = res.get(name) or {}
        n_rows = len(data.get("rows", [])) if name != "pytest" else sum(data.get("counts", {}).values())
        lines.append(f"| {name} | {status} | {secs} | {limit} | {n_rows} | {len(data.get('skipped', []))} |")
    lines.append(f"\nTotal {total_s} s; step limits add up to {limit_sum} s.")
    lines += ["", "## Goals", ""] + [f"- {g}" for g in goals(res)]
    ran = [item.split(":")[0] for item in steps.split()]
    for name in [n for n in STEP_FILES if n not in ("env", "pytest") and (n in ran or res.get(n))]:
        data = res.get(name)
        lines += ["", f"## {name}: {data.get('title', '') if data else 'no result file'}", ""]
        if data:
            lines.append(f"status {data.get('status')}" + (f"; skipped: {', '.join(data['skipped'])}"
                                                          if data.get("skipped") else ""))
            if name == "codec":
                lines.append(f"byte-identical to the torch reference: {data.get('all_identical')}")
            lines += ["", table(data.get("rows", []), data.get("columns", []), OMIT.get(name, set()))]
    py = res.get("pytest")
    if "pytest" in ran or py:
        lines += ["", "## pytest -m gpu", ""]
    if py:
        lines.append(f"status {py.get('status')}, counts {py.get('counts')}, collection errors "
                     f"{len(py.get('collection_errors', []))}")
        problems = [p for p in py.get("problems", []) if p["outcome"] != "skipped"]
        lines += [f"- {p['outcome']}: {p['nodeid']} ({p['seconds']} s): {p['message']}"[:PROBLEM_CHARS]
                  for p in problems[:PROBLEMS_MAX]]
        if len(problems) > PROBLEMS_MAX:
            lines.append(f"- and {len(problems) - PROBLEMS_MAX} more (gpu_pytest.json)")
    elif "pytest" in ran:
        lines.append("no result file")
    return fit("\n".join(lines) + "\n")


def fit(text: str, limit: int = SUMMARY_LIMIT_BYTES) -> str:
    """``text`` cut to ``limit`` bytes (UTF-8) at a line end, with a note saying so, if it is longer."""
    if len(text.encode()) <= limit:
        return text
    note = "\n(summary cut at 10 KB: the step JSONs and gpu_log.txt hold the rest)\n"
    head = text.encode()[:limit - len(note.encode())].decode(errors="ignore")
    return head[:head.rfind("\n") + 1 if "\n" in head else len(head)] + note


def settle(out: str, name: str, rc: int) -> str | None:
    """The status of step ``name``'s JSON after its process ended with ``rc``: one left at ``running``
    (killed past its SIGTERM handler, or dead without reaching Python's exit) becomes ``killed`` or
    ``crashed``. Returns the status (None without a file)."""
    data = load(out, name)
    if data is None:
        return None
    if data.get("status") == "running":
        data["status"] = "killed" if rc in KILLED_RC else "crashed"
        data["exit_code"] = rc
        path = os.path.join(out, STEP_FILES[name])
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)
    return data.get("status")


def step_line(out: str, item: str) -> str:
    """One line for step ``name:status:seconds:limit``: status, rows, skips and its goals' figures."""
    name, status, secs, limit = (item.split(":") + ["", "", ""])[:4]
    data = load(out, name) or {}
    n_rows = len(data.get("rows", [])) if name != "pytest" else sum(data.get("counts", {}).values())
    own = goals({name: data}) if data else []
    figures = "; ".join(g for g in own if not g.startswith("no goal"))
    return (f"summary: {name} {status} in {secs}/{limit} s, file status {data.get('status', 'missing')}, "
            f"{n_rows} rows, {len(data.get('skipped', []))} skipped" + (f"; {figures}" if figures else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder holding the gpu_*.json files")
    p.add_argument("--steps", default="", help="space-separated name:status:seconds:limit")
    p.add_argument("--total-s", type=int, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--name", default="gpu_summary.md", help="the summary's file name in --out")
    p.add_argument("--step", default=None, help="name:status:seconds:limit of the step that just ended")
    p.add_argument("--rc", type=int, default=0, help="with --step: its exit status")
    args = p.parse_args(argv)
    if args.step:
        settle(args.out, args.step.split(":")[0], args.rc)
        print(step_line(args.out, args.step), flush=True)
        return 0
    text = render(args.out, args.steps, args.total_s, args.dry_run)
    with open(os.path.join(args.out, args.name), "w") as f:
        f.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Summary of a GPU validation run: gpu_summary.md from the step JSONs in OUT (and printed, so the last
lines of the run's output say everything even if no file came back). No torch import: it runs even when
the steps could not.

    python bench/gpu/summary.py --out DIR --steps "env:ok:9:20 codec:TIMEOUT:40:40 ..." [--total-s N]
"""
from __future__ import annotations

import argparse
import json
import os

STEP_FILES = {"env": "gpu_env.json", "codec": "gpu_codec.json", "attention": "gpu_attention.json",
              "training": "gpu_train.json", "qat": "gpu_qat.json", "pytest": "gpu_pytest.json"}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "/")


def table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "(no rows)"
    cols = [c for c in columns if any(r.get(c) is not None for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def load(out: str, name: str) -> dict | None:
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
    mfu = [f"{r['model']} {r['row']}: {r['MFU_measured']:.3f}" for r in (train or {}).get("rows", [])
           if r.get("MFU_measured") is not None]
    if mfu:
        out.append("MFU over the measured bf16 matmul rate: " + "; ".join(mfu))
    return out or ["no goal could be evaluated (see the steps)"]


def render(out: str, steps: str, total_s: int | None, dry_run: bool) -> str:
    res = {name: load(out, name) for name in STEP_FILES}
    env = (res.get("env") or {}).get("environment", {})
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
    for name in ("codec", "attention", "training", "qat"):
        data = res.get(name)
        lines += ["", f"## {name}: {data.get('title', '') if data else 'no result file'}", ""]
        if data:
            lines.append(f"status {data.get('status')}" + (f"; skipped: {', '.join(data['skipped'])}"
                                                          if data.get("skipped") else ""))
            if name == "codec":
                lines.append(f"byte-identical to the torch reference: {data.get('all_identical')}")
            lines += ["", table(data.get("rows", []), data.get("columns", []))]
    py = res.get("pytest")
    lines += ["", "## pytest -m gpu", ""]
    if py:
        lines.append(f"status {py.get('status')}, counts {py.get('counts')}, collection errors "
                     f"{len(py.get('collection_errors', []))}")
        lines += [f"- {p['outcome']}: {p['nodeid']} ({p['seconds']} s): {p['message'][:200]}"
                  for p in py.get("problems", []) if p["outcome"] != "skipped"]
    else:
        lines.append("no result file")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder holding the gpu_*.json files")
    p.add_argument("--steps", default="", help="space-separated name:status:seconds:limit")
    p.add_argument("--total-s", type=int, default=None)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    text = render(args.out, args.steps, args.total_s, args.dry_run)
    with open(os.path.join(args.out, "gpu_summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

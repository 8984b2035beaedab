"""Bytes each rank sends for gradient reduction per iteration, measured, against the formulas.

For DP = 2, 4, 8 (gloo on this CPU) and each reducer (all-reduce / reduce-scatter in fp32 and bf16,
Squinch all-reduce / reduce-scatter) this trains a small GPT for two iterations and records, around
the gradient reduction of each iteration (``finish_grad_sync``, overlap off):

- measured: the bytes this process wrote to its sockets (``wchar`` of /proc/self/io, all threads),
- accounted: what the reducer reports (the ``grad comm bytes`` of the log line),
- formula: 2(n-1)/n * S for all-reduce and (n-1)/n * S for reduce-scatter, S the bucket bytes on the
  wire (elements x 4 for fp32, x 2 for bf16, x 6/8 for Squinch plus one flag byte per row, each row padded
  to 16 bytes).

The ranks of one DP size are started once and train every reducer in turn. Byte counts do not depend on
the machine's load.

    python bench/dp_comm.py            # writes bench/results/dp_comm.{json,md}; --quick: DP = 2, a toy model
"""
from __future__ import annotations

import harness as H

from megatron_cai.testing.distributed import run_distributed

MODEL = ["--squared-relu",
         "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "2000", "--mock-data", "--micro-batch-size", "2", "--train-iters", "2",
         "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--position-embedding-type", "rope", "--lr-decay-style", "cosine",
         "--num-workers", "0"]
QUICK_MODEL = [{"2000": "256", "128": "32", "32": "16"}.get(a, a) for a in MODEL]

REDUCERS = {
    "all-reduce fp32": [],
    "all-reduce bf16": ["--grad-reduce-in-bf16"],
    "reduce-scatter fp32": ["--use-distributed-optimizer"],
    "reduce-scatter bf16": ["--use-distributed-optimizer", "--grad-reduce-in-bf16"],
    "squinch all-reduce": ["--squinch"],
    "squinch reduce-scatter": ["--squinch", "--use-distributed-optimizer"],
}


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _measure(argv: list[str], world: int) -> dict:
    """Train with these flags; bytes measured and accounted around each iteration's gradient reduction."""
    from harness.training import build_trainer

    trainer = build_trainer(argv, world_size=world)
    ddp = trainer.model[0]
    measured, accounted = [], []
    original = ddp.finish_grad_sync

    def finish():
        before_io, before_acc = _wchar(), ddp.grad_comm_bytes
        original()
        measured.append(_wchar() - before_io)
        accounted.append(ddp.grad_comm_bytes - before_acc)

    ddp.finish_grad_sync = finish
    trainer.train()
    buckets = [(b.numel, ddp.buffer.grad_data.element_size()) for b in ddp.buffer.buckets]
    return {"measured": measured, "accounted": accounted, "buckets": buckets}


def _worker(rank, world, argvs):
    return [_measure(argv, world) for argv in argvs]


def formula(name: str, n: int, buckets: list[tuple[int, int]]) -> float:
    rs = "reduce-scatter" in name
    total = 0.0
    for numel, elem in buckets:
        if name.startswith("squinch"):
            rows = (n - 1) * (1 if rs else 2)  # rows sent: all-to-all, and the all-gather of the re-encoded shard
            row = -(-(numel // n * 6 // 8 + 1) // 16) * 16  # 6-bit payload + flag byte, padded to 16 bytes
            total += rows * row
        else:
            total += (1 if rs else 2) * (n - 1) / n * numel * elem
    return total


def measure_dp(n: int, model: list[str]) -> list[dict]:
    """Every reducer at DP = n, one row each (rank 0's bytes in the last iteration)."""
    argvs = [model + ["--global-batch-size", str(2 * n)] + flags for flags in REDUCERS.values()]
    results = run_distributed(_worker, n, (argvs,), env={"OMP_NUM_THREADS": "1"})[0]
    rows = []
    for name, res in zip(REDUCERS, results):
        f = formula(name, n, res["buckets"])
        rows.append({"dp": n, "reducer": name, "elements": sum(b[0] for b in res["buckets"]),
                     "formula_bytes": f, "accounted_bytes": res["accounted"][-1],
                     "measured_bytes": res["measured"][-1], "measured_over_formula": res["measured"][-1] / f})
        r = rows[-1]
        print(f"DP={n} {name:24s} formula {f:12.0f}  accounted {r['accounted_bytes']:10d}  "
              f"measured {r['measured_bytes']:10d}  ratio {r['measured_over_formula']:.4f}", flush=True)
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Squinch rows get their measured (and accounted) bytes over bf16's and fp32's of the same collective."""
    by = {(r["dp"], r["reducer"]): r for r in rows}
    for r in rows:
        if r["reducer"].startswith("squinch"):
            kind = "reduce-scatter" if "scatter" in r["reducer"] else "all-reduce"
            r["vs_bf16_measured"] = r["measured_bytes"] / by[r["dp"], f"{kind} bf16"]["measured_bytes"]
            r["vs_fp32_measured"] = r["measured_bytes"] / by[r["dp"], f"{kind} fp32"]["measured_bytes"]
            r["vs_bf16_accounted"] = r["accounted_bytes"] / by[r["dp"], f"{kind} bf16"]["accounted_bytes"]
    return rows


def render(rows: list[dict]) -> str:
    lines = ["# Gradient bytes per rank per iteration (gloo, CPU)", "",
             f"Model: {rows[0]['elements']:,} gradient elements (padded buckets). Measured = bytes written to "
             "sockets by the rank during gradient reduction (/proc/self/io wchar). Formula: 2(n-1)/n S "
             "(all-reduce), (n-1)/n S (reduce-scatter); Squinch S = 6/8 byte per element + 1 flag byte per row, "
             "each row padded to 16 bytes.",
             "", "| DP | reducer | formula bytes | accounted (log line) | measured | measured / formula | "
             "Squinch / bf16 (measured) | Squinch / fp32 (measured) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sq = (f"{r['vs_bf16_measured']:.4f} (6/16 = 0.3750) | {r['vs_fp32_measured']:.4f} (6/32 = 0.1875)"
              if "vs_bf16_measured" in r else " | ")
        lines.append(f"| {r['dp']} | {r['reducer']} | {r['formula_bytes']:.0f} | {r['accounted_bytes']} | "
                     f"{r['measured_bytes']} | {r['measured_over_formula']:.4f} | {sq} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "dp_comm")
    H.add(p, dp=[2, 4, 8])
    opts = H.parse(p, argv, quick=dict(dp=[2]))
    model = QUICK_MODEL if opts.quick else MODEL
    out = H.Results(opts.out, {"dp": opts.dp, "model": model})
    if opts.from_json:
        out.rewrite(render)
        return
    rows = [r for n in opts.dp for r in out.row(f"dp{n}", lambda n=n: measure_dp(n, model))]
    out.write(with_ratios(rows), render)


if __name__ == "__main__":
    main()

"""The GPU rows of bench/step_overhead.py (issue 27), for the training step of bench/gpu/validate.sh.

- :data:`COMPILE_ROWS`: our Trainer with ``--compile`` next to the rows without it, in bench/gpu/train.py's
  ``ROWS`` format ``(row name, model, kind, extra flags)``; train.py's compiled peer (fused AdamW, SDPA,
  ``torch.compile`` per layer) is the reference of both, so ``vs_peer`` reads "with and without --compile".
- :func:`host_read_row`: host reads per iteration of the Trainer on the GPU (``Tensor.item`` /
  ``__bool__`` / ``tolist`` / ``cpu`` / ``numpy``, counted): at most 1 where an iteration does not log.
- :func:`optimizer_row`: the optimizer step of a model's buffers, PyTorch's fused AdamW against the unfused
  update it replaced, alternating windows timed with device synchronisation.

Each function takes the Megatron flags of a row (train.py's ``base_flags(...)``) and returns one row dict
with train.py's ``row`` / ``model`` / ``step_ms`` columns and its own keys. As a script it is the
``overhead`` step of ``bench/gpu/validate.sh --extra`` (the second run, if the machine has time left):
every row into ``--out`` (gpu_overhead.json), the ``--compile`` rows beside the same rows without it
(``vs_uncompiled``); ``--dry-run`` runs them at toy sizes on the CPU.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "bench"), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import step_overhead  # noqa: E402

COMPILE_ROWS = [
    ("ours --compile: plain causal (SDPA)", "350M", "ours", ["--compile"]),
    ("ours --compile: packed docs (Triton visibility kernel)", "350M", "ours", ["--reset-attention-mask", "--compile"]),
    ("ours --compile: plain causal (SDPA)", "1.3B", "ours", ["--compile"]),
]


def host_read_row(argv: list[str], model: str, iters: int = 12, log_interval: int = 6) -> dict:
    """Host reads in each of ``iters`` Trainer iterations (``--log-interval log_interval``)."""
    counts = step_overhead.count_reads(_with(argv, {"--train-iters": str(iters), "--log-interval": str(log_interval)}))
    summary = step_overhead.read_summary(counts, log_interval)
    return {"row": "host reads per iteration (ours)", "model": model, **summary,
            "ok": summary["max_non_logging"] <= 1}


def optimizer_row(argv: list[str], model: str, device, rounds: int = 5, reps: int = 10) -> dict:
    """Median ms per optimizer step of this model's buffers: fused (ours) and the unfused update."""
    from megatron_cai.core import device as dev

    t = step_overhead.optimizer_times(argv, rounds, reps, sync=lambda: dev.synchronize(device))
    med = {k: v["median"] * 1e3 for k, v in t["seconds"].items()}
    return {"row": "optimizer step: fused AdamW vs unfused", "model": model, "step_ms": med["fused"],
            "unfused_ms": med["unfused"], "speedup": t["ratio"], "elements": t["elements"]}


def _with(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with these flags' values replaced (or appended)."""
    out = list(argv)
    for flag, value in values.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


COLUMNS = ["row", "model", "step_ms", "spread_ms", "tokens_per_s", "vs_uncompiled", "unfused_ms", "speedup",
           "max_non_logging", "max_logging", "ok", "error"]
# Seconds a row needs left to start (GPU; the dry run: 5): the --compile rows pay Inductor's compile.
ROW_NEED_S = {"host reads": 15.0, "optimizer": 15.0, "ours": 25.0, "compile": 60.0}


def main(argv=None) -> int:
    """The step of ``validate.sh --extra``: host reads, the optimizer step, and our Trainer with and
    without ``--compile`` (train.py's rows and figures), into ``--out`` after every row."""
    import gc
    import shutil
    import tempfile

    import train
    from common import Budget, StepResults, ceilings, environment, parser, pick_device

    from megatron_cai.core import device as dev

    args = parser(__doc__.split("\n\n")[0], "gpu_overhead", 150).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    res = StepResults(args.out, "Training-step overheads: host reads, fused optimizer, --compile", COLUMNS,
                      dry_run=args.dry_run, environment=environment(device))
    label = "toy" if args.dry_run else "quickstart"
    base = step_overhead.flags(step_overhead.TOY if args.dry_run else step_overhead.QUICKSTART, 10,
                               device=device.type) + ([] if args.dry_run else ["--bf16"])

    def need(kind: str) -> float:
        return 5.0 if args.dry_run else ROW_NEED_S[kind]

    ok = True
    if budget.allows(need("host reads")):
        ok = res.add(host_read_row(base, label))["ok"]
    else:
        res.skip("host reads")
    if budget.allows(need("optimizer")):
        res.add(optimizer_row(base, label, device, rounds=2 if args.dry_run else 5, reps=2 if args.dry_run else 10))
    else:
        res.skip("optimizer step")
    seq, mbs, iters, warmup = (64, 2, 2, 1) if args.dry_run else (2048, 4, 10, 3)
    ceil = ceilings(args.out, device, args.dry_run)
    tmp = tempfile.mkdtemp(prefix="megatron_cai_gpu_overhead_")
    try:
        data = os.path.join(tmp, "corpus")
        train.build_corpus(data, 2 * (iters + 2) * mbs * (seq + 1))
        uncompiled: dict[tuple[str, str], float] = {}
        rows = [("ours: plain causal (SDPA)", "350M", "ours", []),
                ("ours: packed docs (Triton visibility kernel)", "350M", "ours", ["--reset-attention-mask"]),
                *COMPILE_ROWS]
        for name, model, kind, extra in rows:
            if args.dry_run and model != "350M":
                continue
            if not budget.allows(need("compile" if "--compile" in extra else "ours")):
                res.skip(f"{name} {model}")
                continue
            argv_row = train.base_flags("toy" if args.dry_run else model, seq, mbs, iters, data, args.dry_run) + extra
            try:
                (_, _, r), = train.measure(kind, name, argv_row, warmup, 1, device, args.dry_run)
            except Exception as e:  # recorded per row (a compile failure, out of memory, ...)
                res.add({"row": name, "model": model, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                ok = False
                continue
            row = {"row": name, "model": model, **train.figures(r, mbs, seq, ceil, device)}
            plain = (model, " ".join(f for f in extra if f != "--compile"))
            if "--compile" in extra and plain in uncompiled:
                row["vs_uncompiled"] = row["tokens_per_s"] / uncompiled[plain]
            else:
                uncompiled[plain] = row["tokens_per_s"]
            res.add(row)
            gc.collect()
            dev.empty_cache(device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res.finish(ok)


if __name__ == "__main__":
    raise SystemExit(main())

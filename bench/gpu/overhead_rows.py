"""The GPU rows of bench/step_overhead.py (issue 27), for the training step of bench/gpu/validate.sh.

- :data:`COMPILE_ROWS`: our Trainer with ``--compile`` next to the rows without it, in bench/gpu/train.py's
  ``ROWS`` format ``(row name, model, kind, extra flags)``; train.py's compiled peer (fused AdamW, SDPA,
  ``torch.compile`` per layer) is the reference of both, so ``vs_peer`` reads "with and without --compile".
- :func:`host_read_row`: host reads per iteration of the Trainer on the GPU (``Tensor.item`` /
  ``__bool__`` / ``tolist`` / ``cpu`` / ``numpy``, counted): at most 1 where an iteration does not log.
- :func:`optimizer_row`: the optimizer step of a model's buffers, PyTorch's fused AdamW against the unfused
  update it replaced, alternating windows timed with device synchronisation.

Each function takes the Megatron flags of a row (train.py's ``base_flags(...)``) and returns one row dict
with train.py's ``row`` / ``model`` / ``step_ms`` columns and its own keys. ``python bench/gpu/overhead_rows.py
--dry-run`` runs them at toy sizes on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "bench")):
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    args = p.parse_args(argv)
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")
    model = step_overhead.TOY if args.dry_run else step_overhead.QUICKSTART
    base = step_overhead.flags(model, 10, device=device.type) + ([] if args.dry_run else ["--bf16"])
    rows = [host_read_row(base, "toy" if args.dry_run else "quickstart"),
            optimizer_row(base, "toy" if args.dry_run else "quickstart", device, rounds=2 if args.dry_run else 5,
                          reps=2 if args.dry_run else 10)]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "per_iteration"}), flush=True)
    return 0 if rows[0]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

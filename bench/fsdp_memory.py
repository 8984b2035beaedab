"""Per-rank memory of DDP, the distributed optimizer (ZeRO-1) and FSDP2 at DP = 1, 2, 4 (gloo, CPU).

For each layout a small GPT trains for two iterations. Per rank we record:

- params / grads / optimizer: the start-up memory report's bytes (``core/distributed/memory.py``),
  taken after the first iteration (all lazily allocated state exists by then);
- peak: the peak resident memory over the first two iterations above the resident memory right after
  construction (tensors above 64 KiB are separate mmaps, so this follows live tensor bytes), plus the
  model state allocated before (parameters; with DDP also the gradient buffer and Adam state).

For FSDP2 the peak is compared with (P + G + O) / DP plus the largest FSDP unit's unsharded working
set, where P, G, O are the DDP run's (unsharded) bytes and the working set of a unit of U fp32 bytes
in backward is 4U: its all-gathered parameters, its unsharded gradients, the reduce-scatter input they
are copied into, and the next unit's parameters that FSDP2 prefetches.

    python bench/fsdp_memory.py [--quick] [--out bench/results/fsdp_memory]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_cai.testing.distributed import run_distributed  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "2048", "--make-vocab-size-divisible-by", "8",
         "--mock-data", "--micro-batch-size", "1", "--train-iters", "2", "--log-interval", "100",
         "--eval-interval", "0", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]
QUICK_MODEL = [a if a != "512" else "256" for a in MODEL]
PATHS = {"DDP": [], "distributed optimizer": ["--use-distributed-optimizer"], "FSDP2": ["--use-torch-fsdp2"]}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_during(fn) -> int:
    """Peak resident bytes above the current ones while fn runs: VmHWM is reset through clear_refs and
    read afterwards. With MALLOC_MMAP_THRESHOLD_ set (main), every tensor above 64 KiB is its own mmap,
    returned to the system when freed, so resident memory follows live tensor bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size to the current one
    rss_before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - rss_before) * 1024


def _largest_unit_bytes(trainer) -> int:
    from megatron_cai.core.distributed.fsdp import sharding_units

    sizes = []
    for chunk in trainer.model:
        module = chunk.module
        units = sharding_units(module)
        inner = {id(p) for u in units for p in u.parameters()}
        sizes += [sum(p.numel() * 4 for p in u.parameters()) for u in units]
        sizes.append(sum(p.numel() * 4 for p in module.parameters() if id(p) not in inner))
    return max(sizes)


def _worker(rank, world, argv):
    import pretrain_gpt
    from megatron_cai.core.distributed.memory import memory_report
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    # Measured from right after construction: held before = the parameters (FSDP2 allocates grads and
    # Adam state lazily) or, with DDP, the flat parameter / gradient buffers and the Adam state.
    before = memory_report(trainer.model, trainer.optimizer, trainer.device)
    baseline = before.params if config.ddp.use_torch_fsdp2 else before.model_state
    transient = _peak_during(lambda: (trainer.train_step(), trainer.train_step()))
    held = memory_report(trainer.model, trainer.optimizer, trainer.device)
    out = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer, "peak": baseline + transient}
    if config.ddp.use_torch_fsdp2:
        out["largest_unit"] = _largest_unit_bytes(trainer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="hidden 256 instead of 512")
    ap.add_argument("--dp", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fsdp_memory"))
    a = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks (fixed, not adaptive)
    model = QUICK_MODEL if a.quick else MODEL
    rows = []
    for dp in a.dp:
        for name, flags in PATHS.items():
            res = run_distributed(_worker, dp, (model + flags + ["--global-batch-size", str(dp)],), timeout=1800)
            row = {"path": name, "dp": dp}
            for k in ("params", "grads", "optimizer", "peak"):
                row[k] = max(r[k] for r in res)
                row[k + "_spread"] = max(r[k] for r in res) - min(r[k] for r in res)
            if "largest_unit" in res[0]:
                row["largest_unit"] = res[0]["largest_unit"]
            rows.append(row)
            print(row, flush=True)
    full = {r["dp"]: r for r in rows if r["path"] == "DDP"}
    for r in rows:
        if r["path"] == "FSDP2":
            d = full[r["dp"]]
            state = (d["params"] + d["grads"] + d["optimizer"]) / r["dp"]
            r["expected_peak"] = state + 4 * r["largest_unit"]
            r["peak_vs_expected"] = r["peak"] / r["expected_peak"] - 1
            r["state_vs_expected"] = (r["params"] + r["grads"] + r["optimizer"]) / state - 1
    mib = 1 << 20
    lines = ["| path | DP | params MiB | grads MiB | optimizer MiB | state MiB | peak MiB | FSDP2 expected peak MiB "
             "| peak vs expected |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        state = r["params"] + r["grads"] + r["optimizer"]
        exp = f"{r['expected_peak'] / mib:.2f}" if "expected_peak" in r else ""
        dev = f"{100 * r['peak_vs_expected']:+.1f}%" if "peak_vs_expected" in r else ""
        lines.append(f"| {r['path']} | {r['dp']} | {r['params'] / mib:.2f} | {r['grads'] / mib:.2f} | "
                     f"{r['optimizer'] / mib:.2f} | {state / mib:.2f} | {r['peak'] / mib:.2f} | {exp} | {dev} |")
    fsdp = [abs(r["peak_vs_expected"]) for r in rows if "peak_vs_expected" in r]
    summary = (f"FSDP2 peak within {100 * max(fsdp):.1f}% of (P+G+O)/DP + 4 x largest unit "
               f"(median {100 * statistics.median(fsdp):.1f}%)") if fsdp else ""
    table = "\n".join(lines)
    print(table)
    print(summary)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"model": model, "rows": rows, "summary": summary}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("# Per-rank memory: DDP, distributed optimizer, FSDP2 (bench/fsdp_memory.py)\n\n"
                f"Model flags: `{' '.join(model)}`. Bytes per rank (max over ranks; params, grads and optimizer "
                "state are deterministic, so there is no spread to report). Peak: resident bytes over the "
                "first two iterations above those after construction (every tensor above 64 KiB its own mmap), plus "
                "the state allocated before.\n\n"
                + table + "\n\n" + summary + "\n")


if __name__ == "__main__":
    main()

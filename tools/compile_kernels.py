"""Compile every Triton kernel of megatron-cai for CUDA targets on a machine without a GPU.

    python tools/compile_kernels.py --targets sm_80,sm_86,sm_89,sm_90

Drives the real launchers (kernel_configs.py picks the tiles for each target's shared memory) under a
stand-in Triton driver, compiles each kernel to a cubin, and reports registers and spills (``ptxas -v``),
shared memory and compile time. Exits 1 when a kernel fails to compile, spills at head dim <= 128, or
needs more shared memory than the target allows. Writes ``PREFIX.json`` and ``PREFIX.md``. Compiled
kernels are cached by Triton (keyed by source hash; ``TRITON_CACHE_DIR``), so a rerun takes seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cai.core import triton_aot  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=None,
                   help="comma-separated targets (default: sm_80,sm_86,sm_89,sm_90 and sm_100 if known)")
    p.add_argument("--subset", choices=("full", "hopper", "ci"), default="full",
                   help="ci: the bf16 d128 attention kernels and the fused Squinch encoder and decoder; hopper: "
                        "bf16 at head dims 64/128 (window or not), fp32 d128, every fp32/bf16 Squinch kernel")
    p.add_argument("--only", default=None,
                   help="comma-separated substrings of case labels to keep, e.g. 'float32 d128,bfloat16 d64 "
                        "plain window' (iterating on table rows; the acceptance run takes every case)")
    p.add_argument("--jobs", type=int, default=1, help="targets compiled in parallel processes")
    p.add_argument("--out", default="bench/results/compile_kernels", help="output prefix (.json, .md)")
    p.add_argument("--progress", default=None,
                   help="prefix of per-target JSON files rewritten after every case (for long runs)")
    return p


def _one_target(name: str, subset: str, progress_prefix: str | None = None, only: str | None = None) -> list[dict]:
    return triton_aot.to_json(triton_aot.run_check([name], subset, progress_prefix=progress_prefix, only=only))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_kernels: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    known = triton_aot.known_targets()
    targets = args.targets.split(",") if args.targets else list(known)
    unknown = [t for t in targets if t not in known]
    if unknown:
        print(f"compile_kernels: --targets {','.join(unknown)} not compilable with this Triton "
              f"(known: {','.join(known)})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows: list[dict] = []
    done: list[str] = []
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(_one_target, t, args.subset, args.progress, args.only): t for t in targets}
            for fut in as_completed(futures):
                rows += fut.result()
                done.append(futures[fut])
                if len(done) < len(targets):  # partial results survive an interrupted run
                    _write(args, done, rows, t0, partial=True)
    else:
        for t in targets:
            rows += _one_target(t, args.subset, args.progress, args.only)
            done.append(t)
            if len(done) < len(targets):
                _write(args, done, rows, t0, partial=True)
    return _write(args, targets, rows, t0, partial=False)


def _write(args, targets: list[str], rows: list[dict], t0: float, partial: bool) -> int:
    """Print the table (final only), write PREFIX.json/.md; 1 if any kernel failed the check."""
    records = [triton_aot.KernelRecord(**{k: v for k, v in r.items() if k != "problems"}) for r in rows]
    table = triton_aot.to_markdown(records)
    if not partial:
        print(table)
    failed = [r for r in records if r.problems()]
    complete = args.subset == "full" and not args.only
    unexercised = triton_aot.unexercised_candidates(records) if complete and not partial else []
    import triton

    summary = {
        "targets": targets, "subset": args.subset, "only": args.only, "kernels_compiled": len(records),
        "failures": len(failed),
        "max_registers": max((r.registers or 0) for r in records),
        "wall_s": round(time.perf_counter() - t0, 1), "triton": triton.__version__,
        "unexercised_table_candidates": unexercised, "partial": partial,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"summary": summary, "kernels": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            only = f" --only '{args.only}'" if args.only else ""
            note = " PARTIAL (interrupted before every target finished)" if partial else ""
            f.write(f"# Ahead-of-time Triton kernel check{note}\n\n`python tools/compile_kernels.py --targets "
                    f"{','.join(targets)}{only}` (subset {args.subset}, triton {triton.__version__}): "
                    f"{len(records)} compiled kernels, {len(failed)} failures, {summary['wall_s']} s.\n\n"
                    f"{table}\n")
    if partial:
        return 1
    for r in failed:
        print(f"FAIL {r.kernel} {r.config} {r.target}: {'; '.join(r.problems())}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

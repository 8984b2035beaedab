"""Squinch codec on the GPU against device-to-device copy bandwidth: fused Triton encode, encode with error
feedback, decode-accumulate, and the collectives' one-launch wire rows (a DP = 8 bucket), payloads checked
byte for byte against the torch reference.

Each op is timed as K back-to-back calls captured in one CUDA graph (launch overhead excluded; the dry
run times plain calls). Bandwidth counts the bytes an op must move: encode reads 4 B and writes 0.75 B
per fp32 element; error feedback also reads and writes the fp32 residual; decode-accumulate of W payloads
reads W x 0.75 B and reads and writes 4 B per element; the copy reads and writes 4 B. ratio = op GB/s /
copy GB/s (the measured ceiling, gpu_env.json).
"""
from __future__ import annotations

import torch
from common import Budget, StepResults, ceilings, environment, parser, pick_device, summary, time_fn

from megatron_cai.core.distributed import squinch_collectives as sc
from megatron_cai.core.squinch import codec, reference

WORLD = 8


def check_bytes(n: int, device: torch.device) -> dict:
    """Triton vs torch reference at n elements: payloads, residuals, decode-accumulate and wire rows
    bit-identical."""
    g = torch.Generator(device="cpu").manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.logspace(-6, 2, n).roll(n // 3)).to(device)
    r0 = (torch.randn(n, generator=g) * 1e-3).to(device)
    r_tri, r_ref = r0.clone(), r0.clone()
    pe_tri, nf_tri = codec.encode_with_feedback(x, r_tri, backend="triton")
    pe_ref, nf_ref = codec.encode_with_feedback(x, r_ref, backend="torch")
    rows = torch.stack([pe_tri, codec.encode(x.flip(0), backend="torch")] * (WORLD // 2))
    acc_tri = torch.ones(n, device=device)
    acc_ref = acc_tri.clone()
    codec.decode_accumulate(rows, acc_tri, backend="triton")
    reference.decode_accumulate(rows, acc_ref)
    m = n - n % (8 * WORLD)
    w_tri, w_ref = r0[:m].clone(), r0[:m].clone()
    wire_tri = sc.encode_rows(x[:m], WORLD, w_tri, backend="triton")
    wire_ref = sc.encode_rows(x[:m], WORLD, w_ref, backend="torch")
    return {
        "payload_and_feedback_identical": bool(torch.equal(pe_tri, pe_ref)),
        "residual_identical": bool(torch.equal(r_tri.view(torch.int32), r_ref.view(torch.int32))),
        "nonfinite_agree": bool(nf_tri.item() == nf_ref.item()),
        "decode_accumulate_identical": bool(torch.equal(acc_tri.view(torch.int32), acc_ref.view(torch.int32))),
        "wire_rows_identical": bool(torch.equal(wire_tri, wire_ref) and torch.equal(w_tri, w_ref)),
    }


def graph_time(fn, device: torch.device, calls: int, reps: int) -> dict:
    """Seconds per call: `calls` back-to-back calls captured in a CUDA graph, replayed `reps` times."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up on the capture stream (its codec scratch is made here)
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    t = time_fn(graph.replay, device, reps)
    return summary([t["median_s"] / calls, t["min_s"] / calls, t["max_s"] / calls]) | {"reps": reps,
                                                                                         "calls": calls}


def ops(n: int, device: torch.device) -> dict:
    """name -> (callable, bytes it must move)."""
    x = torch.randn(n, device=device)
    dst, res, acc = torch.empty_like(x), torch.zeros_like(x), torch.zeros_like(x)
    payload = codec.encode(x, backend="triton")
    rows_in = torch.stack([payload] * WORLD)
    p = payload.numel()
    wire = sc.encode_rows(x, WORLD, res, backend="triton")
    shard = torch.empty(n // WORLD, device=device)
    return {
        "d2d copy": (lambda: dst.copy_(x), 8 * n),
        "encode": (lambda: codec.encode(x, backend="triton", out=payload), 4 * n + p),
        "encode + error feedback": (lambda: codec.encode_with_feedback(x, res, backend="triton", out=payload),
                                    12 * n + p),
        f"decode-accumulate (W={WORLD})": (lambda: codec.decode_accumulate(rows_in, acc, backend="triton"),
                                           WORLD * p + 8 * n),
        f"wire encode + feedback, {WORLD} rows": (lambda: sc.encode_rows(x, WORLD, res, out=wire,
                                                                          backend="triton"), 12 * n + wire.numel()),
        f"wire decode-sum of {WORLD} rows": (lambda: sc.decode_sum_into(wire, shard, backend="triton"),
                                             wire.numel() + 4 * shard.numel()),
    }


COLUMNS = ["elements", "op", "us_per_call", "spread_us", "GBps", "ratio_vs_copy", "timing"]


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_codec", 45).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    res = StepResults(args.out, "Squinch codec vs copy bandwidth", COLUMNS, dry_run=args.dry_run,
                      environment=environment(device))
    ceil = ceilings(args.out, device, args.dry_run)
    res.set(ceilings=ceil)
    copy_bw = ceil["copy_GBps"]
    checks = check_bytes(2056 if args.dry_run else 1 << 24, device)
    res.set(byte_checks=checks, all_identical=all(checks.values()))
    print(f"  byte-identical to the torch reference: {checks}", flush=True)
    sizes = [2056] if args.dry_run else [64 << 20, 256 << 20, 16 << 20]  # 2056: full programs and a tail
    for n in sizes:
        for name, (fn, nbytes) in ops(n, device).items():
            if not budget.allows(1.0 if args.dry_run else 3.0):
                res.skip(f"{n} elements {name}")
                continue
            if device.type == "cuda":
                t, how = graph_time(fn, device, calls=10, reps=5), "CUDA graph of 10 calls"
            else:
                t, how = time_fn(fn, device, reps=1), "plain calls"
            res.add({"elements": n, "op": name, "us_per_call": t["median_s"] * 1e6,
                     "spread_us": (t["max_s"] - t["min_s"]) * 1e6, "GBps": nbytes / t["median_s"] / 1e9,
                     "ratio_vs_copy": nbytes / t["median_s"] / 1e9 / copy_bw, "timing": how})
    ef = [r["ratio_vs_copy"] for r in res.payload["rows"] if r["op"] == "encode + error feedback"]
    res.set(goal="codec >= 0.7 of copy bandwidth", encode_ef_ratio_min=min(ef) if ef else None)
    return res.finish(all(checks.values()))


if __name__ == "__main__":
    raise SystemExit(main())

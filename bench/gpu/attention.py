"""Attention forward + backward on the GPU: our Triton kernels vs SDPA (flash backend, plain causal
only) and FlexAttention with the equivalent block mask, bf16, head dim 128, on plain causal,
packed-document and tree batches. Reports time ratios and max |error| of out/dq/dk/dv vs FlexAttention
(and vs SDPA on plain causal).
"""
from __future__ import annotations

import importlib.util
import random

import torch
import torch.nn.functional as F
from common import ROOT, Budget, environment, markdown_table, parser, pick_device, time_fn, write_results

from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import attend, flex_attention_intervals


def layouts(seq: int, batch: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """start/limit [batch, seq] of plain causal rows, packed documents and packed trees."""
    rng = random.Random(seq)
    causal = (torch.arange(seq).expand(batch, seq), torch.full((batch, seq), seq))
    docs = []
    for _ in range(batch):
        cuts, pos = [], 0
        while pos < seq:
            pos = min(seq, pos + rng.randint(seq // 16, seq // 3))
            cuts.append(pos)
        starts = torch.arange(seq)
        ends = torch.tensor([next(c for c in cuts if c > i) for i in range(seq)])
        docs.append((starts, ends))
    packed = (torch.stack([d[0] for d in docs]), torch.stack([d[1] for d in docs]))
    # bench/attention.py holds the tree generator and packer of the CPU attention bench
    spec = importlib.util.spec_from_file_location("bench_attention", f"{ROOT}/bench/attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = []
    for b in range(batch):
        trees = mod.synthetic_trees(random.Random(seq + b), 64)
        lay, _ = mod.pack_trees(trees, seq)
        rows.append((lay.start, lay.limit, lay.position_ids))
    ts, tl, _ = V.batch(rows, seq)
    out = {"plain causal": causal, "packed documents": packed, "packed trees": (ts, tl)}
    return {k: (s.to(device), lim.to(device)) for k, (s, lim) in out.items()}


def _run(method: str, q, k, v, start, limit, grad):
    qq, kk, vv = (t.detach().requires_grad_(grad is not None) for t in (q, k, v))
    if method == "ours (triton)":
        out = attend(qq, kk, vv, start, limit, backend="triton")
    elif method == "sdpa flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    else:
        out, _ = flex_attention_intervals(qq, kk, vv, start, limit)
    if grad is not None and out.requires_grad:
        out.backward(grad)
        return out, qq.grad, kk.grad, vv.grad
    return out, None, None, None


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_attention", 110).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    # the Triton interpreter holds bf16 as raw uint16 bits (its tl.dot is wrong on them): fp16 in the dry run
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    seqs = [64] if args.dry_run else [2048, 8192]
    heads, dim = (2, 128) if args.dry_run else (16, 128)
    reps = 1 if args.dry_run else 10
    rows = []
    for seq in seqs:
        batch = 1 if args.dry_run else max(1, 16384 // seq)
        for name, (start, limit) in layouts(seq, batch, device).items():
            if not budget.allows(f"T={seq} {name}", 2.0 if args.dry_run else 15.0):
                continue
            g = torch.Generator(device="cpu").manual_seed(seq)
            q, k, v, grad = (torch.randn(batch, heads, seq, dim, generator=g).to(device, dtype) for _ in range(4))
            methods = ["ours (triton)", "flex"] + (["sdpa flash"] if name == "plain causal" else [])
            results, times = {}, {}
            for m in methods:
                # FlexAttention on CPU is forward-only: the dry run times its forward
                use_grad = grad if (device.type == "cuda" or m != "flex") else None
                try:
                    results[m] = _run(m, q, k, v, start, limit, use_grad)
                    call = (m, q, k, v, start, limit, use_grad)
                    times[m] = time_fn(lambda call=call: _run(*call), device, reps)
                except Exception as e:  # recorded per method (e.g. no flash kernel on this GPU)
                    times[m] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            ours = times["ours (triton)"].get("median_s")
            for m in methods:
                row = {"seq": seq, "batch": batch, "layout": name, "method": m}
                if "error" in times[m]:
                    row["error"] = times[m]["error"]
                    rows.append(row)
                    continue
                row["fwd+bwd_ms"] = times[m]["median_s"] * 1e3
                row["spread_ms"] = (times[m]["max_s"] - times[m]["min_s"]) * 1e3
                row["ours_speedup"] = times[m]["median_s"] / ours if ours else None
                if m != "ours (triton)" and m in results:
                    errs = [(a.float() - b.float()).abs().max().item()
                            for a, b in zip(results["ours (triton)"], results[m]) if a is not None and b is not None]
                    row["max_abs_err_vs_ours"] = max(errs) if errs else None
                rows.append(row)
    payload = {"environment": environment(device), "dry_run": args.dry_run, "dtype": str(dtype), "head_dim": dim,
               "heads": heads, "rows": rows, "skipped": budget.skipped}
    table = markdown_table(rows, ["seq", "batch", "layout", "method", "fwd+bwd_ms", "spread_ms", "ours_speedup",
                                  "max_abs_err_vs_ours", "error"])
    table += "\n\nours_speedup = method time / our time (> 1: ours is faster)."
    write_results(args.out, "Attention fwd+bwd: Triton vs SDPA flash vs FlexAttention", payload, table)
    bad = [r for r in rows if r["method"] == "ours (triton)" and "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

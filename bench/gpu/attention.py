"""Attention forward and backward on the GPU, bf16, head dim 128: our Triton kernels against SDPA's flash
kernel on plain causal rows and against FlexAttention (compiled, the same interval BlockMask) on packed
documents and packed trees, at T = 8k, 2k and 16k (16k tokens per call).

TFLOP/s count the FLOPs of the visible (query, key) pairs only: forward 4 x D per pair (QK^T and PV),
backward 10 x D per pair (five matmuls), for every method alike. The forward is timed alone, the backward
alone (``autograd.grad`` on a retained graph). Which kernel ran is recorded per method: our Triton launches
by kernel name (a counter on Triton's launch entry point), SDPA under ``sdpa_kernel(FLASH_ATTENTION)``
(which refuses any other kernel), and on CUDA the kernel names the profiler saw. Errors are max |ours -
reference| over out, dq, dk and dv.
"""
from __future__ import annotations

import contextlib
import random

import torch
import torch.nn.functional as F
from common import Budget, KernelCounter, StepResults, environment, parser, pick_device, time_fn

from megatron_cai.core import device as dev
from megatron_cai.core import kernel_configs as kc
from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import flex_attention_intervals
from megatron_cai.core.transformer.triton_attention import triton_attention

# Other bf16 d128 launch rows, timed on sm_90 after everything else (at T = 8k) to show whether the table's
# Hopper rows are the fastest: (fwd, dq, dkdv) tiles; each compiles without spills for sm_90.
ALTERNATIVES = {
    "generic rows (before the sm_90 ones)": (kc.Tiles(64, 64, 8, 2), kc.Tiles(64, 64, 8, 2), kc.Tiles(64, 64, 8, 1)),
    "64-row tiles on 4 warps": (kc.Tiles(64, 64, 4, 3), kc.Tiles(64, 64, 4, 2), kc.Tiles(32, 64, 8, 2)),
}
COLUMNS = ["seq", "batch", "layout", "method", "fwd_ms", "bwd_ms", "fwd_TFLOPs", "bwd_TFLOPs", "fwd_vs_ours",
           "bwd_vs_ours", "max_err_vs_ours", "kernels", "error"]


def packed_documents(seq: int, batch: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for _ in range(batch):
        lengths, left = [], seq
        while left > 0:
            lengths.append(min(left, rng.randint(seq // 16, seq // 3)))
            left -= lengths[-1]
        rows.append(V.from_document_lengths(lengths))
    return V.batch(rows, seq)


def packed_trees(seq: int, batch: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Code-shaped trees (a header, then functions and classes with methods; nodes of 16 to 200 tokens at
    T = 2k, scaled with T) packed first-fit into each row, the rest padding."""
    unit = max(1, seq // 256)
    rows = []
    for _ in range(batch):
        layouts, used = [], 0
        while True:
            parents, lengths = [-1], [rng.randint(2, 25) * unit]
            for _ in range(rng.randint(2, 10)):
                parents.append(0 if rng.random() < 0.6 else rng.randrange(len(parents)))
                lengths.append(rng.randint(2, 31) * unit)
            if used + sum(lengths) > seq:
                if layouts:
                    break
                continue
            layouts.append(V.from_tree(parents, lengths))
            used += sum(lengths)
        lay = V.concat_layouts(layouts)
        rows.append((lay.start, lay.limit))
    return V.batch(rows, seq)


def layouts(seq: int, batch: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rng = random.Random(seq)
    causal = (torch.arange(seq).expand(batch, seq), torch.full((batch, seq), seq))
    return {"plain causal": causal, "packed trees": packed_trees(seq, batch, rng),
            "packed documents": packed_documents(seq, batch, rng)}


def visible_pairs(start: torch.Tensor, limit: torch.Tensor, seq: int) -> int:
    return int((limit.clamp(max=seq) - start.clamp(min=0)).clamp(min=0).sum())


def _forward(method: str, q, k, v, start, limit):
    if method == "ours (triton)":
        return triton_attention(q, k, v, start, limit)[0]
    if method == "sdpa flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return flex_attention_intervals(q, k, v, start, limit)[0]


def measure(method: str, q, k, v, grad, start, limit, device: torch.device, reps: int) -> tuple[dict, tuple]:
    """fwd / bwd times of one method and its (out, dq, dk, dv); flex on the CPU is forward-only."""
    backward = device.type == "cuda" or method != "flex"
    qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
    t_fwd = time_fn(lambda: _forward(method, qq, kk, vv, start, limit), device, reps)
    out = _forward(method, qq, kk, vv, start, limit)
    if not backward:
        return {"fwd": t_fwd}, (out, None, None, None)
    grads = torch.autograd.grad(out, (qq, kk, vv), grad, retain_graph=True)
    t_bwd = time_fn(lambda: torch.autograd.grad(out, (qq, kk, vv), grad, retain_graph=True), device, reps)
    return {"fwd": t_fwd, "bwd": t_bwd}, (out, *grads)


def kernels_used(method: str, q, k, v, grad, start, limit, device: torch.device) -> str:
    """Proof of the kernel: our Triton launches by name; SDPA forced to flash; CUDA kernel names seen."""
    counter = KernelCounter()
    names: list[str] = []
    with counter.active():
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                measure(method, q, k, v, grad, start, limit, device, reps=1)
            names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"
                            and any(w in e.name.lower() for w in ("flash", "attn", "attention", "fwd", "bwd",
                                                                  "kernel"))})
        else:
            measure(method, q, k, v, grad, start, limit, device, reps=1)
    parts = [f"{k}x{v}" for k, v in sorted(counter.counts.items())]
    if method == "sdpa flash":
        parts.append("sdpa_kernel(FLASH_ATTENTION)" if device.type == "cuda" else "sdpa MATH (CPU)")
    return "; ".join(parts + [n[:60] for n in names[:4]])


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_attention", 110).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    # the Triton interpreter holds bf16 as raw uint16 bits (its tl.dot is wrong on them): fp16 in the dry run
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    seqs = [64] if args.dry_run else [8192, 2048, 16384]
    heads, dim = (2, 128) if args.dry_run else (16, 128)
    reps = 1 if args.dry_run else 5
    res = StepResults(args.out, "Attention fwd / bwd: ours vs SDPA flash and FlexAttention", COLUMNS,
                      dry_run=args.dry_run, environment=environment(device), dtype=str(dtype), heads=heads,
                      head_dim=dim, goal="ours >= 0.7 of SDPA flash on causal; faster than flex on trees")
    seen: set[tuple[str, str]] = set()
    ok = True
    for seq in seqs:
        batch = 1 if args.dry_run else max(1, 16384 // seq)
        for name, (start, limit) in layouts(seq, batch).items():
            start, limit = start.to(device), limit.to(device)
            pairs = visible_pairs(start, limit, seq) * heads
            g = torch.Generator(device="cpu").manual_seed(seq)
            q, k, v, grad = (torch.randn(batch, heads, seq, dim, generator=g).to(device, dtype) for _ in range(4))
            methods = ["ours (triton)", "sdpa flash" if name == "plain causal" else "flex"]
            results = {}
            for m in methods:
                if not budget.allows(2.0 if args.dry_run else 12.0):
                    res.skip(f"T={seq} {name} {m}")
                    continue
                row = {"seq": seq, "batch": batch, "layout": name, "method": m}
                try:
                    times, results[m] = measure(m, q, k, v, grad, start, limit, device, reps)
                    if (name, m) not in seen:  # the kernel proof, once per layout and method
                        row["kernels"] = kernels_used(m, q, k, v, grad, start, limit, device)
                        seen.add((name, m))
                except Exception as e:  # recorded per method (e.g. no flash kernel on this GPU)
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    ok = ok and m != "ours (triton)"
                    res.add(row)
                    continue
                for phase, flops in (("fwd", 4 * dim * pairs), ("bwd", 10 * dim * pairs)):
                    if phase in times:
                        row[f"{phase}_ms"] = times[phase]["median_s"] * 1e3
                        row[f"{phase}_TFLOPs"] = flops / times[phase]["median_s"] / 1e12
                        row[f"{phase}_spread_ms"] = (times[phase]["max_s"] - times[phase]["min_s"]) * 1e3
                ours = next((r for r in res.payload["rows"] if r["seq"] == seq and r["layout"] == name
                             and r["method"] == "ours (triton)"), None)
                if m != "ours (triton)" and ours is not None and "ours (triton)" in results:
                    for phase in ("fwd", "bwd"):
                        if row.get(f"{phase}_ms") and ours.get(f"{phase}_ms"):
                            row[f"{phase}_vs_ours"] = row[f"{phase}_ms"] / ours[f"{phase}_ms"]  # > 1: ours faster
                    errs = [(a.float() - b.float()).abs().max().item()
                            for a, b in zip(results["ours (triton)"], results[m]) if a is not None and b is not None]
                    row["max_err_vs_ours"] = max(errs)
                res.add(row)
            del q, k, v, grad, results
    if device.type == "cuda" and dev.device_capability(device) >= 90:
        tile_alternatives(res, budget, device, dtype, heads, dim)
    res.set(note="fwd_vs_ours / bwd_vs_ours = method time / our time (> 1: ours is faster)")
    return res.finish(ok)


@contextlib.contextmanager
def table_rows(tiles: tuple[kc.Tiles, kc.Tiles, kc.Tiles]):
    """kernel_configs' bf16 / fp16 d128 rows replaced by ``(fwd, dq, dkdv)`` tiles while active."""
    keys = [(role, "16bit", 128) for role in ("fwd", "dq", "dkdv")]
    saved = {k: kc.ATTENTION_TABLE[k] for k in keys}
    kc.ATTENTION_TABLE.update({k: ((kc.SMEM_OPTIN[90], t),) for k, t in zip(keys, tiles)})
    try:
        yield
    finally:
        kc.ATTENTION_TABLE.update(saved)


def tile_alternatives(res: StepResults, budget: Budget, device, dtype, heads: int, dim: int) -> None:
    """Our kernels at T = 8k with other launch rows, against the table's (the rows measured above)."""
    seq, batch = 8192, 2
    for name in ("plain causal", "packed trees"):
        start, limit = (t.to(device) for t in layouts(seq, batch)[name])
        pairs = visible_pairs(start, limit, seq) * heads
        g = torch.Generator(device="cpu").manual_seed(seq)
        q, k, v, grad = (torch.randn(batch, heads, seq, dim, generator=g).to(device, dtype) for _ in range(4))
        ours = next((r for r in res.payload["rows"] if r["seq"] == seq and r["layout"] == name
                     and r["method"] == "ours (triton)" and r.get("fwd_ms")), None)
        for label, tiles in ALTERNATIVES.items():
            if not budget.allows(20.0):
                res.skip(f"T={seq} {name} ours: {label}")
                continue
            row = {"seq": seq, "batch": batch, "layout": name, "method": f"ours: {label}",
                   "kernels": " / ".join(str(t) for t in tiles)}
            with table_rows(tiles):
                times, _ = measure("ours (triton)", q, k, v, grad, start, limit, device, reps=5)
            for phase, flops in (("fwd", 4 * dim * pairs), ("bwd", 10 * dim * pairs)):
                row[f"{phase}_ms"] = times[phase]["median_s"] * 1e3
                row[f"{phase}_TFLOPs"] = flops / times[phase]["median_s"] / 1e12
                if ours:
                    row[f"{phase}_vs_ours"] = row[f"{phase}_ms"] / ours[f"{phase}_ms"]
            res.add(row)


if __name__ == "__main__":
    raise SystemExit(main())

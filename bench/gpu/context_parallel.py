"""Context-parallel attention's per-chunk Triton kernels on one GPU: CP = 4 simulated against CP = 1.

For T = 16384 (bf16, 32 heads, 8 KV heads of 128) on plain causal, packed-document (mean length T/16)
and packed-tree rows: every CP rank's key sets (its own keys, and the keys it receives from each peer,
exactly as its plan names them) run through the per-chunk Triton kernels one after another on the one
GPU, forward and backward with the merged lse, and are merged by log-sum-exp. Reported per batch: the
CP = 1 Triton attention's forward + backward time, the busiest rank's key-set time, the sum over ranks
(the split's overhead: more, smaller launches), the time imbalance (max over mean) and the max |error|
of the merged output and of dQ against the CP = 1 call. No communication is timed: this step checks
and times the kernels that each rank runs.
"""
from __future__ import annotations

import sys

import torch
from common import Budget, StepResults, environment, load_bench_module, parser, pick_device, time_fn

# bench/context_parallel.py by path: this file is "context_parallel" too.
_CPU_BENCH = load_bench_module("context_parallel")
batch_of, intervals = _CPU_BENCH.batch_of, _CPU_BENCH.intervals

from megatron_cai.core.context_parallel.attention import lse_merge, received_key_set  # noqa: E402
from megatron_cai.core.context_parallel.batch import split_for  # noqa: E402
from megatron_cai.core.context_parallel.kernels import chunk_attention  # noqa: E402
from megatron_cai.core.context_parallel.plan import build_rank_plan  # noqa: E402
from megatron_cai.core.transformer.attention import attend  # noqa: E402

CP = 4
KINDS = ("plain causal", "packed documents", "packed trees")
COLUMNS = ["batch", "T", "chunks", "CP=1 fwd+bwd ms", "busiest rank ms", "sum over ranks / CP=1", "time imbalance",
           "max err out", "max err dq"]


def _key_sets(plans, rank: int, q, k, v):
    """Rank ``rank``'s key sets as (k, v, start, limit, positions): its own, then each peer's keys."""
    plan = plans[rank]
    idx = plan.local_index
    sets = [(k[:, :, idx], v[:, :, idx], plan.start, plan.limit, plan.position_ids)]
    for d, step in enumerate(plan.steps):
        if not step.num_received:
            continue
        sender = plans[step.recv_from].steps[d]  # the same step seen from the sender: its keys, in order
        keys = plans[step.recv_from].local_index[sender.send_cols]
        kv = torch.stack([k[sender.send_rows, :, keys], v[sender.send_rows, :, keys]])  # [2, n, H, D]
        ks, vs = received_key_set(kv, step, idx.numel())
        sets.append((ks, vs, step.start, step.limit, step.position_ids))
    return sets


def _rank_attention(sets, q_local, do_local):
    """Forward of every key set, the lse merge, and every key set's backward with the merged lse."""
    kernels = [chunk_attention("triton", q_local, ks, vs, s, lim, position_ids=pos) for ks, vs, s, lim, pos in sets]
    out, lse = None, None
    for kern in kernels:
        o, part = kern.forward()
        o, part = o.float(), part.float()
        out, lse = (o, part) if out is None else lse_merge(out, lse, o, part)
    delta = (do_local.float() * out).sum(-1)
    dq = sum(kern.backward(do_local, lse, delta)[0].float() for kern in kernels)
    return out, dq


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], "gpu_context_parallel", 40.0)
    p.add_argument("--batches", nargs="*", choices=KINDS, default=list(KINDS), help="default: all three")
    args = p.parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    seq, heads, kv_heads, dim, dtype = ((64, 2, 1, 16, torch.float32) if args.dry_run
                                        else (16384, 32, 8, 128, torch.bfloat16))
    reps, warmup = (1, 0) if args.dry_run else (5, 1)  # --dry-run: the kernels' checks, not their times
    res = StepResults(args.out, "Context-parallel per-chunk kernels (bench/gpu/context_parallel.py)", COLUMNS,
                      dry_run=args.dry_run, cp=CP, environment=environment(device))
    for kind in args.batches:
        if not budget.allows(5.0):
            res.skip(kind)
            continue
        batch = batch_of(kind, seq)
        start, limit = (t.to(device) for t in intervals(batch))
        pos = batch["position_ids"].to(device)
        split = split_for(batch, CP)
        plans = [build_rank_plan(split, r, start, limit, pos) for r in range(CP)]
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype, generator=g)
        v = torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype, generator=g)
        do = torch.randn(1, heads, seq, dim, device=device, dtype=dtype, generator=g)
        qr = q.detach().requires_grad_()
        ref_out = attend(qr, k, v, start, limit, backend="triton")
        ref_out.backward(do)
        ref_out, ref_dq = ref_out.detach(), qr.grad.clone()  # before the timed calls add to qr.grad

        def full(qr=qr, k=k, v=v, start=start, limit=limit, do=do):
            attend(qr, k, v, start, limit, backend="triton").backward(do)

        t_full = time_fn(full, device, reps, warmup)["median_s"]
        per_rank, err_out, err_dq = [], 0.0, 0.0
        for r in range(CP):
            idx = plans[r].local_index
            sets = _key_sets(plans, r, q, k, v)
            out, dq = _rank_attention(sets, q[:, :, idx], do[:, :, idx])
            err_out = max(err_out, float((out - ref_out[:, :, idx].float()).abs().max()))
            err_dq = max(err_dq, float((dq - ref_dq[:, :, idx].float()).abs().max()))
            q_local, do_local = q[:, :, idx], do[:, :, idx]
            per_rank.append(time_fn(lambda s=sets, ql=q_local, dl=do_local: _rank_attention(s, ql, dl),
                                    device, reps, warmup)["median_s"])
        mean = sum(per_rank) / CP
        res.add({"batch": kind, "T": seq, "chunks": split.num_chunks, "CP=1 fwd+bwd ms": 1e3 * t_full,
                 "busiest rank ms": 1e3 * max(per_rank), "sum over ranks / CP=1": sum(per_rank) / t_full,
                 "time imbalance": max(per_rank) / mean, "max err out": err_out, "max err dq": err_dq})
    return res.finish(True)


if __name__ == "__main__":
    sys.exit(main())

"""Exact tests of every Squinch error-feedback path, at steps 1 to 3 (error feedback active from step 2).

Each rank runs the real SquinchReducer (C codec, gloo) over two buckets of different sizes for three
steps. An independent oracle replays the same algorithm on one process with the reference (torch)
codec: sender-side error feedback per rank and bucket (y = g/DP + e; e <- y - decode(encode(y))),
the owner's decode-sum of the chunks in sender order, and, in all-reduce mode, the owner-side
re-encode with its own error feedback and the decode of every owner's payload. Every result must be
bit-identical (torch.equal) to the oracle. Covered: flat DP = 2 and 4, hierarchical (2 nodes x 2),
TP2 x DP2 and PP2 x DP2, each in reduce-scatter and all-reduce mode, and a skipped non-finite step.

Mutations tried (each applied alone to core/distributed/squinch_reducer.py; each made a test here fail
with an assertion, not a crash; residuals dropped by popping them before the encode that uses them):
  1. sender-side error feedback off in the flat path (``reduce``): dp2_rs, tp2dp2_rs, pp2dp2_ar fail.
  2. owner-side error feedback off in the flat all-reduce's second phase (``_after_all_to_all``,
     flat branch): dp2_ar, dp4_ar, tp2dp2_ar, pp2dp2_ar fail; the ``rs`` cases stay green.
  3. sender-side error feedback off in the hierarchical path (``_reduce_hierarchical``): hier_rs fails.
  4. owner-side error feedback off in the hierarchical all-reduce (``_after_all_to_all``,
     hierarchical branch): hier_ar fails.
  5. one residual for all buckets (key without the bucket index): dp2_rs fails.
  6. ``step_skipped`` keeps the residuals: test_skipped_nonfinite_step_resets_feedback fails.
  7. the sender does not set the non-finite flag byte: test_skipped_nonfinite_step_resets_feedback fails.
  8. the receiver ignores the flag byte: test_skipped_nonfinite_step_resets_feedback[rs] fails.
"""
import math
import time

import pytest
import torch
from testlib.distributed import run_distributed

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.grad_buffer import Bucket, bucket_padding
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer, _completed
from megatron_cai.core.squinch import decode, encode

BUCKET_BLOCKS = (3, 2)  # two buckets of different sizes (multiples of the DP padding)
STEPS = 3


def _grad(global_rank: int, bucket: int, numel: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * step + 1000 * bucket + global_rank)
    return torch.randn(numel, generator=g) * torch.logspace(-6, 0, numel).roll(7 * global_rank + bucket)


def _numels(dp: int) -> list[int]:
    return [k * bucket_padding(dp) for k in BUCKET_BLOCKS]


def _worker(rank, world, tp, pp, mode, rpn, nan_at, early=False):
    ps.initialize_model_parallel(tp, pp, ranks_per_node=rpn)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    reducer = SquinchReducer(ps.get_data_parallel_group(), dp, error_feedback=True,
                             shard_only=mode.endswith("rs"), hierarchical=mode.startswith("hier"), backend="cpu")
    outs, early_stages = [], []
    for step in range(STEPS):
        step_out = []
        handles, buckets = [], []
        for b, numel in enumerate(_numels(dp)):
            g = _grad(rank, b, numel, step)
            if nan_at == (step, rank, b):
                g[5] = float("nan")
            bucket = Bucket(b, 0, numel, [], g, torch.zeros(numel), dp, dp_rank)
            buckets.append(bucket)
            handles.append(reducer.reduce(bucket))
            if early:  # let this bucket's first collective finish, so the next hand-over advances it
                while not _completed(handles[-1].work):
                    time.sleep(0.001)
        if early:
            reducer.progress()
            early_stages.append([h.stage for h in handles])
        for h, bucket in zip(handles, buckets):
            h.wait()
            step_out.append(bucket.grad_data.clone())
        if any(not torch.isfinite(o).all() for o in step_out):
            reducer.step_skipped()
        outs.append(step_out)
    # numpy arrays travel by value (tensors would travel as file descriptors of a process that exits)
    outs = [[o.numpy() for o in step_out] for step_out in outs]
    return {"dp_ranks": ps.get_data_parallel_global_ranks(), "dp_rank": dp_rank, "outs": outs,
            "early_stages": early_stages}


# ------------------------------------------------------------------------------------------ oracle
def _enc_dec(y: torch.Tensor) -> torch.Tensor:
    return decode(encode(y, backend="torch"), y.numel(), backend="torch")


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    s = parts[0]
    for p in parts[1:]:
        s = s + p
    return torch.zeros_like(s) + s  # decode-accumulate adds into a zeroed target


class _Oracle:
    """Squinch over one DP group, replayed step by step with the reference codec."""

    def __init__(self, global_ranks: list[int], local: int | None) -> None:
        self.ranks, self.n = global_ranks, len(global_ranks)
        self.local = local
        self.res: dict[tuple, torch.Tensor] = {}

    def _ef(self, key: tuple, y: torch.Tensor) -> torch.Tensor:
        """Encode y with the residual of `key`; return the decoded values and update the residual."""
        y = y + self.res.get(key, torch.zeros_like(y))
        d = _enc_dec(y)
        self.res[key] = y - d
        return d

    def step(self, step: int, nan_at) -> list[list[torch.Tensor]]:
        """Per bucket, per DP rank: (shard, full) after reduction; NaN-filled when a sender was poisoned."""
        n, out, poisoned = self.n, [], False
        for b, numel in enumerate(_numels(n)):
            c = numel // n
            g = []
            for gr in self.ranks:
                x = _grad(gr, b, numel, step) * (1.0 / n)
                if nan_at == (step, gr, b):
                    x[5] = float("nan")
                g.append(x)
            if self.local is None:
                dec = [self._ef(("b", b, w), g[w]).view(n, c) for w in range(n)]
                shards = [_sum_in_order([dec[w][r] for w in range(n)]) for r in range(n)]
            else:
                L, M = self.local, n // self.local
                node_slice = {}
                for m in range(M):
                    for lr in range(L):
                        parts = [g[m * L + j].view(M, L, c)[:, lr, :].reshape(-1) for j in range(L)]
                        node_slice[m, lr] = _sum_in_order(parts)
                dec = {k: self._ef(("b", b, k), v).view(M, c) for k, v in node_slice.items()}
                shards = [None] * n
                for m in range(M):
                    for lr in range(L):
                        shards[m * L + lr] = _sum_in_order([dec[mm, lr][m] for mm in range(M)])
            full = torch.cat([self._ef(("o", b, r), shards[r]) for r in range(n)])
            if any(not torch.isfinite(x).all() for x in g):  # flagged: every receiver gets NaN
                shards = [torch.full_like(s, math.nan) for s in shards]
                full = torch.full_like(full, math.nan)
                poisoned = True
            out.append([(shards[r], full) for r in range(n)])
        if poisoned:  # the step is skipped everywhere: step_skipped() drops all feedback
            self.res = {k: torch.zeros_like(v) for k, v in self.res.items()}
        return out


def _check(results, mode, nan_at=None):
    local = 2 if mode.startswith("hier") else None
    groups = {}
    for res in results:
        groups.setdefault(tuple(res["dp_ranks"]), {})[res["dp_rank"]] = res
    for ranks, members in groups.items():
        oracle = _Oracle(list(ranks), local)
        n = len(ranks)
        for step in range(STEPS):
            expected = oracle.step(step, nan_at)
            for b, per_rank in enumerate(expected):
                for r, (shard, full) in enumerate(per_rank):
                    got = torch.from_numpy(members[r]["outs"][step][b])
                    c = got.numel() // n
                    where = f"{mode}: global rank {ranks[r]}, bucket {b}, step {step + 1}"
                    if mode.endswith("rs"):
                        assert _same(got[r * c:(r + 1) * c], shard), where
                    else:
                        assert _same(got, full), where


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality; NaN equals NaN (a poisoned step)."""
    if torch.isnan(b).all():
        return bool(torch.isnan(a).all())
    return torch.equal(a, b)


@pytest.mark.parametrize("world,tp,pp,mode,rpn", [
    (2, 1, 1, "rs", None), (2, 1, 1, "ar", None), (4, 1, 1, "ar", None),
    (4, 1, 1, "hier_rs", 2), (4, 1, 1, "hier_ar", 2),
    (4, 2, 1, "rs", None), (4, 2, 1, "ar", None), (4, 1, 2, "rs", None), (4, 1, 2, "ar", None),
], ids=["dp2_rs", "dp2_ar", "dp4_ar", "hier_rs", "hier_ar", "tp2dp2_rs", "tp2dp2_ar", "pp2dp2_rs", "pp2dp2_ar"])
def test_error_feedback_exact_over_three_steps(world, tp, pp, mode, rpn):
    results = run_distributed(_worker, world, (tp, pp, mode, rpn, None))
    _check(results, mode)


@pytest.mark.parametrize("mode", ["ar", "rs"])
def test_skipped_nonfinite_step_resets_feedback(mode):
    """A NaN on rank 1 at step 2 poisons that bucket everywhere; step_skipped drops all feedback, and
    step 3 matches an oracle whose residuals restart from zero."""
    results = run_distributed(_worker, 2, (1, 1, mode, None, (1, 1, 0)))
    for res in results:
        assert torch.isnan(torch.from_numpy(res["outs"][1][0])).any()
    _check(results, mode, nan_at=(1, 1, 0))


@pytest.mark.parametrize("world,mode,rpn", [(2, "ar", None), (4, "hier_ar", 2)], ids=["dp2_ar", "hier_ar"])
def test_second_phase_started_before_wait_is_exact(world, mode, rpn):
    """The overlap path: each bucket's all-to-all (hierarchical: its intra-node reduce-scatter) completes
    before the next hand-over, so progress() starts the later stages before wait(); same exact results."""
    results = run_distributed(_worker, world, (1, 1, mode, rpn, None, True))
    for res in results:
        assert all(min(stages) >= 1 for stages in res["early_stages"]), res["early_stages"]
    _check(results, mode)

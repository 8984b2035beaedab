"""At most one host synchronisation per training iteration (issue 27): a DP=2 CPU run with Squinch, --fp16
(dynamic loss scaling), the divergence and spike checks, the exit-signal handler, --calculate-per-token-loss,
the distributed optimizer with overlapped reduction and gather, --exit-duration-in-mins (rank 0's deadline vote),
and --log-interval 10 counts
``Tensor.item``, ``__bool__``, ``tolist``, ``cpu`` and ``numpy`` calls (patched) in every iteration:
at most 1 on iterations that do not log, at most 2 on those that do (the first and every 10th)."""
from testlib.distributed import run_distributed
from testlib.host_sync import HostSyncCounter
from testlib.train import TINY_MODEL, train

ITERS, LOG = 12, 10  # iterations 1 and 10 log
ARGS = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
                     str(ITERS), "--lr", "3e-3", "--log-interval", str(LOG), "--eval-interval", "0", "--eval-iters",
                     "0", "--seed", "7", "--squinch", "--fp16", "--check-for-spiky-loss",
                     # and the paths that used to read per micro-batch or per bucket
                     "--calculate-per-token-loss", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather",
                     # rank 0's deadline vote travels in the same read-back (far away: no exit)
                     "--exit-duration-in-mins", "10000"]


def _worker(rank, world_size, argv):
    counter = HostSyncCounter()
    per_iteration: list[dict] = []

    def hook(trainer):
        before_step = trainer.profiler.before_step

        def counting_before_step(iteration):  # the loop calls it first thing in every iteration
            if iteration > 0:
                per_iteration.append({"total": counter.total(), "where": dict(counter.where)})
            counter.reset()
            before_step(iteration)
        trainer.profiler.before_step = counting_before_step
        counter.install()

    try:
        out = train(argv, world_size, trainer_hook=hook)
    finally:
        counter.uninstall()
    per_iteration.append({"total": counter.total(), "where": dict(counter.where)})  # the last, and the end
    return {"counts": per_iteration, "skipped": out["skipped"], "history": out["history"]}


def test_at_most_one_host_sync_per_iteration_that_does_not_log():
    for rank, r in enumerate(run_distributed(_worker, 2, (ARGS,))):
        counts = r["counts"]
        assert len(counts) == ITERS
        for i, c in enumerate(counts[:-1]):  # the last iteration's count also holds the end of training
            it = i + 1
            limit = 2 if it == 1 or it % LOG == 0 else 1  # Megatron logs the first iteration, then every LOG
            assert c["total"] <= limit, f"rank {rank} iteration {it}: {c['total']} host reads at {c['where']}"
        assert all(c["total"] >= 1 for c in counts), "the step's one read-back is missing: counting is broken"
        assert len(r["history"]) == ITERS and r["skipped"] >= 1, "fp16 from 2**32 must overflow"

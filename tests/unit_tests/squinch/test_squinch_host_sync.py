"""No per-bucket host synchronisation in the Squinch reducer path (issue 14, item 2).

A DP = 2 step on CPU (gloo) through DistributedDataParallel with several buckets, overlapped with
backward: ``Tensor.__bool__``, ``Tensor.item`` and ``Tensor.tolist`` are patched to count calls.
Backward plus ``finish_grad_sync`` (every bucket's reduction) must make none; the per-step grad-norm
check of the optimizer makes its own (the one place where the step synchronises), and that count
does not depend on the number of buckets.
"""
import pytest
import torch
from testlib.distributed import run_distributed
from torch import nn

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer
from megatron_cai.core.optimizer.config import OptimizerConfig
from megatron_cai.core.optimizer.optimizer import DistributedAdamW

HOST_SYNCS = ("__bool__", "item", "tolist")


class _Counter:
    def __init__(self) -> None:
        self.calls: dict[str, int] = dict.fromkeys(HOST_SYNCS, 0)
        self.active = False

    def install(self) -> None:
        for name in HOST_SYNCS:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, _name=name, **k):
                if self.active:
                    self.calls[_name] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, counted)

    def total(self) -> int:
        return sum(self.calls.values())


def _worker(rank, world, mode, hierarchical, bucket_size):
    ps.initialize_model_parallel(1, 1, ranks_per_node=1 if hierarchical else None)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    reducer = SquinchReducer(ps.get_data_parallel_group(), world, error_feedback=True, shard_only=mode == "rs",
                             hierarchical=hierarchical, backend="cpu")
    ddp = DistributedDataParallel(model, reducer, DDPConfig(reducer="squinch", bucket_size=bucket_size,
                                                            overlap_grad_reduce=True,
                                                            use_distributed_optimizer=mode == "rs"),
                                  device=torch.device("cpu"))
    opt = DistributedAdamW([ddp], OptimizerConfig(lr=1e-3, use_distributed_optimizer=mode == "rs"))
    counter = _Counter()
    counter.install()
    counts = []
    for step in range(2):
        ddp.zero_grad_buffer()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ddp(x).square().mean()
        counter.active = True
        loss.backward()
        ddp.finish_grad_sync()
        counter.active = False
        reducer_syncs = dict(counter.calls)
        counter.calls = dict.fromkeys(HOST_SYNCS, 0)
        counter.active = True
        norm, finite = opt.clip_and_check(1.0)
        counter.active = False
        counts.append({"reducer": reducer_syncs, "grad_norm": counter.total(), "finite": finite})
        counter.calls = dict.fromkeys(HOST_SYNCS, 0)
        opt.step()
    return {"buckets": len(ddp.buffer.buckets), "counts": counts}


@pytest.mark.parametrize("mode,hierarchical", [("ar", False), ("rs", False), ("ar", True)],
                         ids=["allreduce", "reducescatter", "hierarchical"])
def test_no_host_sync_per_bucket(mode, hierarchical):
    few = run_distributed(_worker, 2, (mode, hierarchical, 10**9))
    many = run_distributed(_worker, 2, (mode, hierarchical, 64 * 64))
    assert few[0]["buckets"] == 1 and many[0]["buckets"] >= 4
    for res in few + many:
        for c in res["counts"]:
            assert c["finite"]
            assert c["reducer"] == dict.fromkeys(HOST_SYNCS, 0), f"{res['buckets']} buckets: {c['reducer']}"
            assert c["grad_norm"] >= 1
    # the grad-norm check synchronises once per step, whatever the number of buckets
    assert {c["grad_norm"] for r in few + many for c in r["counts"]} == {few[0]["counts"][0]["grad_norm"]}

"""The step-time model moves the bytes the real reducers count (``bytes_sent``), for every reducer mode,
over 4 gloo ranks laid out as two nodes of two."""
import torch
from testlib.distributed import run_distributed

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.comm_model import (
    BackwardTimeline,
    CodecCost,
    OpCost,
    ReducerMode,
    Tier,
    Topology,
    predict,
)
from megatron_cai.core.distributed.grad_buffer import Bucket, bucket_padding
from megatron_cai.core.distributed.reducers import AllReduceReducer, ReduceScatterReducer
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer

MODES = {"fp32": ReducerMode("fp32"), "bf16": ReducerMode("bf16"), "fp32 rs": ReducerMode("fp32", shard_only=True),
         "squinch": ReducerMode("squinch"), "squinch rs": ReducerMode("squinch", shard_only=True),
         "squinch hier": ReducerMode("squinch", hierarchical=True),
         "squinch hier rs": ReducerMode("squinch", hierarchical=True, shard_only=True)}


def _reducer(name: str, dp: int):
    group = ps.get_data_parallel_group()
    if name.startswith("squinch"):
        return SquinchReducer(group, dp, hierarchical="hier" in name, shard_only=name.endswith("rs"), backend="cpu")
    return (ReduceScatterReducer if name.endswith("rs") else AllReduceReducer)(group, dp)


def _worker(rank, world, numel):
    ps.initialize_model_parallel(1, 1, ranks_per_node=2)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sent = {}
    for name, mode in MODES.items():
        dtype = torch.bfloat16 if mode.reducer == "bf16" else torch.float32
        reducer = _reducer(name, dp)
        g = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
        reducer.reduce(Bucket(0, 0, numel, [], g, torch.zeros(numel), dp, dp_rank)).wait()
        sent[name] = reducer.bytes_sent
    return sent


def test_model_bytes_equal_the_reducers_counts():
    numel = 5 * bucket_padding(4)  # padded as the grad buffer pads it
    results = run_distributed(_worker, 4, (numel,))
    link = Tier(OpCost(1e-4, 1e8))
    topo = Topology(dp=4, ranks_per_node=2, intra=link, inter=link, reduce_scatter="all_to_all")
    codec = CodecCost(1e8, 1e8, 1e8, 1e9, 0.0)
    tl = BackwardTimeline((numel,), (0.01,), 0.01, 0.0)
    for name, mode in MODES.items():
        expected = predict(tl, topo, codec, mode).rank_bytes
        assert {r[name] for r in results} == {expected}, name

"""Every implementation of the data-parallel contracts (``core.distributed.contracts``) has their members:
the three DDP bucket reducers, FSDP2's reduce-scatter hooks (plain, Squinch, HSDP) and the chunk-level
``UnitReducers`` over them, and both wrapped model chunks. The callers (schedules, trainer, checkpoints)
rely on the contract instead of probing, so a missing member must fail here, not in a run.
``build_optimizer`` picks the optimizer from the chunks' ``data_parallel_kind``."""
from __future__ import annotations

import torch
from testlib.distributed import run_distributed

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.contracts import BucketReducer, GradReducer, ModelChunk
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.fsdp import FSDPSettings, wrap_model_chunks
from megatron_cai.core.distributed.reducers import build_reducer
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.optimizer.config import OptimizerConfig
from megatron_cai.core.optimizer.fsdp_adamw import FullyShardedAdamW
from megatron_cai.core.optimizer.optimizer import DistributedAdamW, build_optimizer

CPU = torch.device("cpu")


def _model() -> GPTModel:
    return GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8))


def _worker(rank, world_size):
    ps.initialize_model_parallel(1, 1)
    found = []

    def check(obj, contract, what):
        found.append((what, type(obj).__name__, contract.__name__, isinstance(obj, contract)))

    for reducer, sharded in (("allreduce", False), ("reducescatter", True), ("squinch", False), ("squinch", True)):
        config = DDPConfig(reducer=reducer, use_distributed_optimizer=sharded)
        r = build_reducer(config, ps.get_data_parallel_group(), 1)
        chunk = DistributedDataParallel(_model(), r, config, device=CPU)
        check(r, BucketReducer, f"ddp {reducer} sharded={sharded}")
        check(chunk, ModelChunk, f"ddp {reducer} sharded={sharded}")
        optimizer = build_optimizer([chunk], OptimizerConfig(use_distributed_optimizer=sharded))
        found.append((f"ddp {reducer}", chunk.data_parallel_kind, "optimizer", type(optimizer) is DistributedAdamW))
    for squinch, hierarchical in ((False, False), (True, False), (True, True)):
        what = f"fsdp2 squinch={squinch} hierarchical={hierarchical}"
        chunk = wrap_model_chunks([_model()], CPU, FSDPSettings(squinch=squinch, hierarchical=hierarchical))[0]
        check(chunk, ModelChunk, what)
        check(chunk.reducer, GradReducer, what)
        for comm in chunk.comms.values():
            check(comm, GradReducer, what)
        assert chunk.reducer.carries_feedback == squinch
        optimizer = build_optimizer([chunk], OptimizerConfig())
        found.append((what, chunk.data_parallel_kind, "optimizer", type(optimizer) is FullyShardedAdamW))
    return found


def test_every_reducer_and_model_chunk_keeps_its_contract():
    found = run_distributed(_worker, 1)[0]
    assert {f[1] for f in found if f[2] != "optimizer"} == {  # every implementation was looked at
        "AllReduceReducer", "ReduceScatterReducer", "SquinchReducer", "DistributedDataParallel",
        "FullyShardedChunk", "UnitReducers", "CountingReduceScatter", "SquinchReduceScatter"}
    broken = [f for f in found if not f[3]]
    assert not broken, broken
    assert {f[1] for f in found if f[2] == "optimizer"} == {"ddp", "fsdp2"}

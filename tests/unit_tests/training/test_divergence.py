"""The divergence monitor: the bound on consecutive skipped iterations, loss spikes, refusing to save
non-finite state, its checkpointed state, and the flags with Megatron-LM's defaults."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.reducers import AllReduceReducer
from megatron_cai.training.divergence import DivergenceConfig, DivergenceError, DivergenceMonitor

CPU = torch.device("cpu")



def test_monitor_raises_at_the_bound_with_loss_and_checkpoint():
    m = DivergenceMonitor(DivergenceConfig(max_consecutive_skipped_iterations=3), CPU, "ck/iter_0000002")
    m.observe(1, {"lm loss": 2.5}, skipped=False)
    m.observe(2, {"lm loss": 2.25}, skipped=False)
    m.observe(3, {"lm loss": float("nan")}, skipped=True)
    m.observe(4, {}, skipped=True)
    m.observe(5, {"lm loss": 2.0}, skipped=False)  # a finite step resets the run of skips
    m.observe(6, {}, skipped=True)
    m.observe(7, {}, skipped=True)
    with pytest.raises(DivergenceError) as e:
        m.observe(8, {}, skipped=True)
    msg = str(e.value)
    assert "iteration 8" in msg and "3 consecutive" in msg
    assert "last finite lm loss 2.000000E+00 at iteration 5" in msg and "ck/iter_0000002" in msg


def test_monitor_without_check_or_bound_never_raises():
    for cfg in (DivergenceConfig(check_for_nan_in_loss_and_grad=False), DivergenceConfig(0)):
        m = DivergenceMonitor(cfg, CPU)
        for i in range(50):
            m.observe(i + 1, {}, skipped=True)


def test_spike_detection_counts_losses_above_k_times_the_median():
    m = DivergenceMonitor(DivergenceConfig(check_for_spiky_loss=True, spiky_loss_factor=3.0, spiky_loss_window=20),
                          CPU)
    losses = [2.0 + 0.01 * (i % 5) for i in range(15)] + [7.0, 2.0, 5.9, 6.1]
    lines = [m.observe(i + 1, {"lm loss": v}, skipped=False) for i, v in enumerate(losses)]
    median_before = [float(np.median(losses[max(0, i - 20):i])) if i else 0.0 for i in range(len(losses))]
    expected = [i >= 10 and v > 3.0 * median_before[i] for i, v in enumerate(losses)]
    assert [line is not None for line in lines] == expected
    assert m.spikes == sum(expected) == 2
    assert "loss spike" in lines[15] and "loss spikes so far: 1" in lines[15]


def test_refuse_save_after_a_skip_or_with_non_finite_state():
    model = DistributedDataParallel(torch.nn.Linear(3, 3), AllReduceReducer(None, 1), DDPConfig(), device=CPU)
    m = DivergenceMonitor(DivergenceConfig(), CPU)
    assert m.refuse_save([model], None) is None
    m.observe(1, {}, skipped=True)
    assert "non-finite" in m.refuse_save([model], None)
    m.observe(2, {"lm loss": 1.0}, skipped=False)
    with torch.no_grad():
        model.module.weight[0, 0] = float("inf")
    assert "non-finite values" in m.refuse_save([model], None)


def test_the_finite_check_before_a_save_reads_back_once():
    """One host sync for the whole state (it runs before every save), not one per tensor; a non-finite
    value in any tensor, on any device the caller names, still refuses."""
    from testlib.host_sync import HostSyncCounter

    from megatron_cai.training.divergence import all_finite

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    tensors = [p.detach() for p in model.parameters()]
    counter = HostSyncCounter().install()
    try:
        finite = all_finite(tensors, CPU)
    finally:
        counter.uninstall()
    assert finite and counter.total() == 1 and len(tensors) == 12, counter.calls
    for i in (0, 7, 11):
        bad = [t.clone() for t in tensors]
        bad[i].view(-1)[-1] = float("nan") if i != 7 else float("-inf")
        assert not all_finite(bad, CPU), i
    assert all_finite([], CPU)


def test_divergence_state_round_trips():
    m = DivergenceMonitor(DivergenceConfig(), CPU)
    m.observe(7, {"lm loss": 3.5}, skipped=False)
    other = DivergenceMonitor(DivergenceConfig(), CPU)
    other.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert other.last_finite == (7, 3.5)


def test_divergence_flags_have_megatron_defaults():
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.config import ArgumentError

    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    div = parse_config(base, world_size=1).training.divergence
    assert div == DivergenceConfig() and div.check_for_nan_in_loss_and_grad
    assert div.max_consecutive_skipped_iterations == 10
    off = parse_config(base + ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"], world_size=1)
    assert not off.training.divergence.check_for_nan_in_loss_and_grad and off.training.divergence.check_for_spiky_loss
    with pytest.raises(ArgumentError, match="max-consecutive-skipped-iterations"):
        parse_config(base + ["--max-consecutive-skipped-iterations", "-1"], world_size=1)


def _after_one_step(kind: str):
    """A one-layer GPT wrapped by DDP (distributed Adam) or FSDP2 (AdamW over its shards), one finite step
    taken: (model chunk, optimizer)."""
    from megatron_cai.core.distributed.fsdp import FSDPSettings, wrap_model_chunks
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.core.optimizer.config import OptimizerConfig
    from megatron_cai.core.optimizer.optimizer import build_optimizer

    net = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8))
    net.initialize(seed=1)
    chunk = (wrap_model_chunks([net], CPU, FSDPSettings())[0] if kind == "fsdp2" else
             DistributedDataParallel(net, AllReduceReducer(None, 1), DDPConfig(), device=CPU))
    optimizer = build_optimizer([chunk], OptimizerConfig(use_distributed_optimizer=kind == "ddp"))
    tokens = torch.arange(16).remainder(32).view(2, 8)
    chunk.zero_grad_buffer()  # through the ModelChunk contract, as the schedules drive it
    chunk.set_is_last_microbatch(True)
    chunk(tokens, torch.arange(8).expand(2, 8), labels=tokens).mean().backward()
    chunk.finish_grad_sync()
    optimizer.step(lr=1e-3)
    return chunk, optimizer


def _refusals_for_non_finite_adam_state(rank, world_size):
    """For each optimizer (DDP's distributed Adam, FSDP2's AdamW over its shards): refuse_save after one
    finite step, then after one moment element is set to NaN (the parameters stay finite)."""
    from megatron_cai.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    out = {}
    for kind in ("ddp", "fsdp2"):
        chunk, optimizer = _after_one_step(kind)
        m = DivergenceMonitor(DivergenceConfig(), CPU)
        before = m.refuse_save([chunk], optimizer)
        moments = list(optimizer.moment_tensors())
        if moments:
            with torch.no_grad():
                moments[-1].view(-1)[0] = float("nan")
        out[kind] = (before, m.refuse_save([chunk], optimizer), len(moments),
                     all(bool(torch.isfinite(p).all()) for p in chunk.module.parameters()))
    return out


def _refusals_for_one_ranks_non_finite_fsdp2_shard(rank, world_size):
    """FSDP2 over 2 ranks: one element of rank 1's shard of an Adam moment set to NaN; every rank refuses."""
    from megatron_cai.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    chunk, optimizer = _after_one_step("fsdp2")
    m = DivergenceMonitor(DivergenceConfig(), CPU)
    before = m.refuse_save([chunk], optimizer)
    moments = [t for t in optimizer.moment_tensors() if t.numel()]  # this rank's shards
    if rank == 1:
        with torch.no_grad():
            moments[-1].view(-1)[0] = float("nan")
    return before, m.refuse_save([chunk], optimizer), type(next(chunk.module.parameters())).__name__


def test_one_ranks_non_finite_shard_refuses_the_save_on_every_rank():
    from testlib.distributed import run_distributed

    found = run_distributed(_refusals_for_one_ranks_non_finite_fsdp2_shard, 2)
    assert [f[2] for f in found] == ["DTensor", "DTensor"]  # sharded parameters: each rank checks its shards
    assert [f[0] for f in found] == [None, None]
    assert all(f[1] is not None and "non-finite values" in f[1] for f in found), found


def test_refuse_save_with_non_finite_adam_state_of_either_optimizer():
    from testlib.distributed import run_distributed

    found = run_distributed(_refusals_for_non_finite_adam_state, 1)[0]
    for kind, (before, after, n_moments, params_finite) in found.items():
        assert before is None and params_finite and n_moments >= 2, (kind, found[kind])
        assert after is not None and "non-finite values" in after, (kind, after)

"""Megatron-LM training flags, each against an independent expectation: --optimizer sgd (torch.optim.SGD),
--calculate-per-token-loss (the global token mean), --overlap-param-gather (a single-process run),
--profile (a torch.profiler trace), the TensorBoard flags, --empty-unused-memory-level, --manual-gc,
--train-data-path / --valid-data-path, and the log line a real run prints."""
from __future__ import annotations

import glob
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.reducers import build_reducer
from megatron_cai.core.optimizer.config import OptimizerConfig
from megatron_cai.core.optimizer.optimizer import DistributedAdamW
from megatron_cai.training import training

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
                     "--lr", "3e-3", "--log-interval", "2", "--eval-iters", "0", "--seed", "7"]


@pytest.fixture
def single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_sgd_matches_torch_sgd(single_process):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    reference = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    ddp_config = DDPConfig(bucket_size=10_000)
    ddp = DistributedDataParallel(module, build_reducer(ddp_config, None, 1), ddp_config, device=torch.device("cpu"))
    opt = DistributedAdamW([ddp], OptimizerConfig(lr=0.1, weight_decay=0.05, optimizer="sgd", sgd_momentum=0.8))
    groups = [{"params": [p for p in reference if p.dim() > 1], "weight_decay": 0.05},
              {"params": [p for p in reference if p.dim() <= 1], "weight_decay": 0.0}]
    torch_sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.8)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        lr = 0.1 * (1 - step / 8)
        for p, ref in zip(module.parameters(), reference):
            grad = torch.randn(p.shape, generator=g)
            s, e = ddp.buffer.offsets[id(p)]
            ddp.buffer.grad_data[s:e] = grad.reshape(-1)
            ref.grad = grad.clone()
        opt.step(lr)
        for group in torch_sgd.param_groups:
            group["lr"] = lr
        torch_sgd.step()
        for p, ref in zip(module.parameters(), reference):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)


def _fake_step(per_token_losses: list[torch.Tensor]):
    """A forward_step whose loss_func is pretrain_gpt's masked token mean of fixed per-token losses."""
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        losses = per_token_losses[batch["index"]]

        def loss_func(_output):
            mask = batch["loss_mask"].float()
            loss = (losses * mask).sum() / mask.sum()
            return loss, {"lm loss": loss}

        return None, loss_func
    return forward_step


def test_per_token_loss_is_the_global_token_mean(single_process):
    g = torch.Generator().manual_seed(0)
    losses = [torch.rand(2, 8, generator=g) * 5 for _ in range(3)]
    masks = [torch.zeros(2, 8) for _ in range(3)]
    masks[0][:, :8] = 1
    masks[1][0, :2] = 1
    masks[2][:, :5] = 1
    batches = [{"index": i, "loss_mask": masks[i]} for i in range(3)]
    step, iters = training.per_token_loss_step(_fake_step(losses), batches, [None], 3, torch.device("cpu"))
    total = 0.0
    stat = 0.0
    for _ in range(3):  # the schedule: each micro-batch's loss / M, summed by backward
        _, loss_func = step(iters[0], None)
        loss, stats = loss_func(None)
        total += float(loss) / 3
        stat += float(stats["lm loss"]) / 3
    expected = float(sum((lo * m).sum() for lo, m in zip(losses, masks)) / sum(m.sum() for m in masks))
    mean_of_means = sum(float((lo * m).sum() / m.sum()) for lo, m in zip(losses, masks)) / 3
    assert total == pytest.approx(expected) and stat == pytest.approx(expected)
    assert abs(expected - mean_of_means) > 1e-3  # the two definitions differ on this batch


def test_per_token_loss_trains_and_equals_the_default_when_masks_are_full():
    a = train(BASE + ["--calculate-per-token-loss"])["history"]
    b = train(BASE)["history"]
    for x, y in zip(a, b):  # mock data: every token counts, so both definitions agree
        assert x["lm loss"] == pytest.approx(y["lm loss"], rel=1e-6)


def _dist_worker(rank, world_size, argv):
    return train(argv, world_size)


def test_overlap_param_gather_matches_a_single_process():
    argv = BASE + ["--ddp-bucket-size", "2000", "--overlap-grad-reduce"]
    reference = train(argv)["history"]
    got = last_stage_history(run_distributed(_dist_worker, 2, (argv + ["--use-distributed-optimizer",
                                                                        "--overlap-param-gather"],)))
    assert len(got) == len(reference) == 4
    for a, b in zip(got, reference):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-5)
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-5)


def _deferral_worker(rank, world_size, argv):
    seen = {}

    def hook(trainer):
        opt = trainer.optimizer
        original = opt._all_gather_params

        def recording():
            original()
            seen.setdefault("pending_after_step", []).append(len(opt._pending))
        opt._all_gather_params = recording
    train(argv, world_size, trainer_hook=hook)
    return seen


def test_overlap_param_gather_leaves_the_gathers_to_the_next_forward():
    argv = BASE + ["--ddp-bucket-size", "2000", "--overlap-grad-reduce", "--use-distributed-optimizer",
                   "--overlap-param-gather"]
    seen = run_distributed(_deferral_worker, 2, (argv,))
    for s in seen:  # several buckets still in flight after each step, waited for by the forward hooks
        assert s["pending_after_step"] and min(s["pending_after_step"]) > 1


def test_profile_writes_a_tensorboard_trace(tmp_path):
    train(BASE + ["--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                  "--tensorboard-dir", str(tmp_path)])
    traces = glob.glob(str(tmp_path / "*.pt.trace.json"))
    assert len(traces) == 1
    events = json.load(open(traces[0]))["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)


def _scalars(tb_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_flags(tmp_path):
    argv = BASE + ["--eval-interval", "2", "--eval-iters", "1", "--split", "90,10,0"]
    train(argv + ["--tensorboard-dir", str(tmp_path / "plain")])
    train(argv + ["--tensorboard-dir", str(tmp_path / "all"), "--log-timers-to-tensorboard", "--log-throughput",
                  "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard"])
    plain, full = _scalars(tmp_path / "plain"), _scalars(tmp_path / "all")
    for tag in ("iteration-time", "throughput", "lm loss validation ppl", "world-size"):
        assert tag not in plain and tag in full, tag
    assert [s for s, _ in full["iteration-time"]] == [2, 4]
    for (step, ppl), (step2, loss) in zip(full["lm loss validation ppl"], full["lm loss validation"]):
        assert step == step2 and ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert [v for _, v in full["loss-scale"]] == [1.0] * 4 and [v for _, v in full["world-size"]] == [1.0] * 4


@pytest.mark.parametrize("level,per_step", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_level(monkeypatch, level, per_step):
    calls = []
    monkeypatch.setattr("megatron_cai.training.training.empty_device_cache", lambda device: calls.append(1))
    train(BASE + ["--empty-unused-memory-level", str(level)])
    assert len(calls) == 4 * per_step


def test_manual_gc(monkeypatch):
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    train(BASE + ["--manual-gc", "--manual-gc-interval", "2"])
    assert len(calls) == 1 + 2 and gc.isenabled()  # at the start, then every 2nd of 4 iterations


def write_dataset(prefix: str, docs: list) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for doc in docs:
        builder.add_document(np.asarray(doc))
    builder.finalize(prefix + ".idx")


def test_per_split_data_paths(tmp_path):
    rng = np.random.default_rng(0)
    write_dataset(str(tmp_path / "a"), [rng.integers(1, 50, 40).tolist() for _ in range(30)])
    write_dataset(str(tmp_path / "b"), [rng.integers(50, 100, 40).tolist() for _ in range(30)])
    argv = BASE[:BASE.index("--mock-data")] + BASE[BASE.index("--mock-data") + 1:]
    argv += ["--train-data-path", str(tmp_path / "a"), "--valid-data-path", str(tmp_path / "b"),
             "--tokenizer-type", "NullTokenizer", "--eval-interval", "2", "--eval-iters", "1"]
    seen = {}

    def hook(trainer):
        seen["train"] = [trainer.train_ds[i]["tokens"] for i in range(len(trainer.train_ds))]
        seen["valid"] = [trainer.valid_ds[i]["tokens"] for i in range(len(trainer.valid_ds))]
        seen["test"] = trainer.test_ds
    train(argv, trainer_hook=hook)
    assert all(int(t.max()) < 50 for t in seen["train"])  # only prefix a, all of it
    assert all(int(t.min()) >= 50 or int(t.min()) == 0 for t in seen["valid"])  # only prefix b
    assert seen["test"] is None


def test_a_real_run_prints_megatrons_lines(capsys):
    train(BASE + ["--log-interval", "2"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 3  # iterations 1 (megatron-core 0.19.2 prints a run's first iteration), 2 and 4
    for line in lines:
        assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +\d+/ +4 \|", line)
        assert " loss scale: 1.0 |" in line and " number of nan iterations:   0 |" in line
        assert line.index("number of nan iterations") < line.index("tokens per second")
    assert os.environ.get("RANK") is None

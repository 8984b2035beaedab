"""Acceptance 3: over a 20-iteration warmup-and-decay run, the log line's learning rate and the TensorBoard tags,
steps and learning rates equal what megatron-core 0.19.2 logs.

The expectation comes from megatron-core itself, run on CPU in its own process: Megatron-LM's argument parser
and ``validate_args`` read the same flags, its ``get_optimizer_param_scheduler`` builds the schedule from them,
and its ``training_log`` is called for each of the 20 iterations (with the losses and norms of our run, so that
both sides log the same figures) with a recording TensorBoard writer. Our run writes a real event file, read back
with TensorBoard's ``EventAccumulator``. CPU shims on the megatron-core side: ``torch.cuda.current_device``,
``torch.cuda.synchronize`` and its ``memory_stats``, and CUDA tensors made on the CPU (``mcore_cpu.CpuTorch``).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import typing

import pytest
import torch
from testlib import mcore_cpu
from testlib.distributed import run_distributed
from testlib.train import train

if not hasattr(typing, "override"):
    typing.override = lambda f: f
pytest.importorskip("megatron.training.training")
pytest.importorskip("tensorboard")

MEGATRON_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                  "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "5",
                  "--lr-decay-iters", "18", "--lr-decay-style", "cosine", "--log-interval", "4",
                  "--tensorboard-log-interval", "3", "--log-params-norm", "--log-num-zeros-in-grad",
                  "--log-memory-to-tensorboard", "--log-timers-to-tensorboard", "--log-throughput",
                  "--log-world-size-to-tensorboard", "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                  "--mock-data", "--transformer-impl", "local"]
OURS = ["--squared-relu", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--num-workers",
        "0", "--make-vocab-size-divisible-by", "8"]
OUR_EXTRA_TAGS = ("tokens-per-second", "grad-comm-bytes", "attention-lse/")
LR_FIELD = re.compile(r" iteration +(\d+)/ +\d+ \|.*? learning rate: ([0-9.E+-]+) \|")


def _our_run(rank: int, world: int, tb: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(MEGATRON_FLAGS + OURS + ["--tensorboard-dir", tb], world)
    return {"history": result["history"], "stdout": out.getvalue()}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step) -> None:
        self.calls.append((tag, float(value), int(step)))


def _megatron_run(rank: int, world: int, per_iteration: list[dict]) -> dict:
    """megatron-core 0.19.2's training_log for the 20 iterations, its scheduler's rates in the optimizer groups."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    import megatron.training.arguments as margs
    import megatron.training.global_vars as gv
    import megatron.training.training as mtraining
    import megatron.training.utils.common_utils as common
    from megatron.core import parallel_state as mps
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    mps.initialize_model_parallel(1, 1)
    margs.get_device_arch_version = lambda: 9
    mtraining.torch = common.torch = mcore_cpu.CpuTorch()
    argv, sys.argv = sys.argv, ["pretrain_gpt.py", *MEGATRON_FLAGS]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.parse_args()
            args.world_size = 1
            margs.validate_args(args, {})
    finally:
        sys.argv = argv
    args.padded_vocab_size = 64
    gv.set_args(args)
    gv._set_timers(args)
    gv._GLOBAL_ENERGY_MONITOR = object()  # read, unused without --log-energy
    writer = gv._GLOBAL_TENSORBOARD_WRITER = _Recorder()
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)

    class Optimizer:
        param_groups = [{"params": [], "default_config": True, "is_decoupled_lr": False}]

    scheduler = mtraining.get_optimizer_param_scheduler(Optimizer())
    gv.get_timers()("interval-time", log_level=0).start(barrier=True)
    total: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for it, fig in enumerate(per_iteration, start=1):  # as megatron's train(): step, count, then log
            scheduler.step(increment=args.global_batch_size)
            args.consumed_train_samples += args.global_batch_size
            lr = mtraining.get_canonical_lr_for_logging(Optimizer.param_groups)
            mtraining.training_log({"lm loss": torch.tensor([fig["lm loss"]])}, total, lr, it, 1.0, False, 0,
                                   fig["grad norm"], fig["params norm"], fig["num zeros"], None,
                                   is_first_iteration=it == 1)
    return {"scalars": writer.calls, "stdout": out.getvalue()}


def _event_scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logged_lr_and_tensorboard_are_megatrons(tmp_path):
    ours = run_distributed(_our_run, 1, (str(tmp_path / "tb"),))[0]
    events = _event_scalars(str(tmp_path / "tb"))
    per_iteration = [{"lm loss": h["lm loss"], "grad norm": h["grad norm"]} for h in ours["history"]]
    for name, tag in (("params norm", "params-norm"), ("num zeros", "num-zeros")):
        logged = dict(events[tag])  # every 3rd iteration; Megatron needs a value at each (it logs the same ones)
        for it, fig in enumerate(per_iteration, start=1):
            fig[name] = logged.get(it, 1.0)
    theirs = run_distributed(_megatron_run, 1, (per_iteration,))[0]

    expected: dict[str, list[tuple[int, float]]] = {}
    for tag, value, step in theirs["scalars"]:
        expected.setdefault(tag, []).append((step, value))
    extra = {t for t in events if t not in expected}
    assert all(t.startswith(OUR_EXTRA_TAGS) for t in extra), extra
    assert set(expected) <= set(events), set(expected) - set(events)
    assert len(expected) >= 20
    for tag, points in expected.items():
        assert [s for s, _ in events[tag]] == [s for s, _ in points], f"{tag}: steps differ"
        if not tag.startswith(("iteration-time", "throughput", "mem-")):  # timings and CPU/CUDA memory differ
            got = [v for _, v in events[tag]]
            assert got == pytest.approx([v for _, v in points], rel=1e-6), tag
    lrs = [v for _, v in expected["learning-rate"]]
    assert lrs[0] < lrs[1] and min(lrs) == pytest.approx(1e-4)  # warmup, then decay to the minimum

    def lr_fields(stdout: str) -> list[tuple[int, str]]:
        return [(int(m.group(1)), m.group(2)) for m in LR_FIELD.finditer(stdout)]

    assert lr_fields(ours["stdout"]) == lr_fields(theirs["stdout"])
    assert [it for it, _ in lr_fields(ours["stdout"])] == [1, 4, 8, 12, 16, 20]

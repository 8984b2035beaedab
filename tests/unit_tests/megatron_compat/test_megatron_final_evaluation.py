"""Megatron's final evaluation: after training, with --eval-iters > 0, the validation set then the test set, in
megatron-core 0.19.2's lines and TensorBoard tags (its own evaluate_and_print_results runs here on the same
losses); none after an exit flag or signal, none with --eval-iters 0; --skip-train evaluates only."""
from __future__ import annotations

import inspect
import re
import types
import typing

import pytest
from testlib.train import TINY_MODEL, train

from megatron_cai.training.logging import validation_log_lines
from megatron_cai.training.training_log import validation_scalars

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
mtraining = pytest.importorskip("megatron.training.training")

LOSSES = {"lm loss": 3.375}  # exact in fp32 (megatron-core holds the losses in fp32 tensors)


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step) -> None:
        self.scalars.append((tag, value, step))


def _megatron(prefix: str, iteration: int, consumed: int, ppl: bool, monkeypatch) -> tuple[str, list]:
    """megatron-core's evaluate_and_print_results on LOSSES: the printed block and the scalars written."""
    import torch

    printed, writer = [], _Writer()
    args = types.SimpleNamespace(multiple_validation_sets=False, eval_iters=2, full_validation=False,
                                 validation_set_names=None, consumed_train_samples=consumed,
                                 log_validation_ppl_to_tensorboard=ppl)
    monkeypatch.setattr(mtraining, "get_args", lambda: args)
    monkeypatch.setattr(mtraining, "get_tensorboard_writer", lambda: writer)
    monkeypatch.setattr(mtraining, "get_wandb_writer", lambda: None)
    monkeypatch.setattr(mtraining, "print_rank_last", printed.append)
    monkeypatch.setattr(mtraining, "evaluate", lambda *a, **k: ({k: torch.tensor(v) for k, v in LOSSES.items()},
                                                                 None, False))
    mtraining.evaluate_and_print_results(prefix, None, None, None, iteration, None, None)
    return "\n".join(printed), [(t, float(v), s) for t, v, s in writer.scalars]


@pytest.mark.parametrize("on", ["validation set", "test set"])
@pytest.mark.parametrize("ppl", [False, True])
def test_final_lines_and_tags_are_megatrons(on, ppl, monkeypatch):
    block, scalars = _megatron(f"iteration 7 on {on}", 7, 56, ppl, monkeypatch)
    assert validation_log_lines(7, LOSSES, on=on) == block
    ours = [(t, float(v), s) for t, v, s in validation_scalars(LOSSES, 7, 56, ppl)]
    assert sorted(ours) == sorted(scalars)


def test_megatrons_pretrain_evaluates_validation_then_test_after_training():
    source = inspect.getsource(mtraining.pretrain)
    valid = source.index("prefix = f'iteration {iteration} on validation set'")
    test = source.index("prefix = f'iteration {iteration} on test set'")
    assert source.index("if args.do_valid:") < valid < source.index("if args.do_test:") < test
    assert source.count("write_to_tensorboard=not cfg_container.validation.skip_train") >= 2
    assert re.search(r"do_valid = .*args\.eval_iters > 0", inspect.getsource(mtraining))


RUN = [*TINY_MODEL, "--mock-data", "--train-iters", "2", "--micro-batch-size", "2", "--log-interval", "1"]


def test_final_evaluation_runs_after_training(capsys):
    train(RUN + ["--eval-iters", "2"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "validation loss at" in line]
    assert [line.split(" | ")[0] for line in lines] == [" validation loss at iteration 2 on validation set",
                                                        " validation loss at iteration 2 on test set"]


@pytest.mark.parametrize("extra", [["--eval-iters", "0"], ["--eval-iters", "2", "--exit-interval", "1"]])
def test_no_final_evaluation_without_eval_iters_or_after_an_exit(extra, capsys):
    train(RUN + extra)
    assert "validation loss at" not in capsys.readouterr().out


def test_skip_train_only_evaluates(capsys):
    result = train(RUN + ["--eval-iters", "2", "--skip-train"])
    out = capsys.readouterr().out
    assert result["iteration"] == 0 and result["history"] == []
    assert "skipping training (--skip-train is on) ..." in out
    assert "validation loss at iteration 0 on validation set" in out and "on test set" in out

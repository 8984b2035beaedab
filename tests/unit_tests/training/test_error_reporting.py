"""Known errors: one `error:` line (once, or per rank for rank-local ones), exit status 2, no traceback;
unknown errors keep theirs; printing survives a closed stream."""
from __future__ import annotations

import io
import sys

import pytest

from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetError
from megatron_cai.core.parallel_state import ParallelLayoutError
from megatron_cai.training import errors
from megatron_cai.training.checkpoint import CheckpointError, CheckpointIOError, ConversionError
from megatron_cai.training.config import ArgumentError
from megatron_cai.training.divergence import DivergenceError


def test_known_errors_print_once_and_rank_local_ones_with_their_rank():
    plain, local = IndexedDatasetError("x.idx: truncated"), CheckpointIOError("cannot load a.pt")
    assert errors.format_known_error(plain, 0, 2) == "error: x.idx: truncated"
    assert errors.format_known_error(plain, 1, 2) is None
    assert errors.format_known_error(local, 1, 2) == "error: [rank 1] cannot load a.pt"
    assert errors.format_known_error(local, 0, 1) == "error: cannot load a.pt"


def test_run_cli_returns_2_without_traceback_and_keeps_unknown_errors(capsys):
    def bad():
        raise DivergenceError("training diverged at iteration 3")

    assert errors.run_cli(bad, (DivergenceError,)) == 2
    assert capsys.readouterr().err == "error: training diverged at iteration 3\n"

    def unknown():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        errors.run_cli(unknown, (DivergenceError,))


def test_safe_print_survives_a_closed_stream(monkeypatch):
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    closed = Closed()
    monkeypatch.setattr(sys, "stdout", closed)
    errors.safe_print("saved checkpoint")  # no exception
    assert sys.stdout is not closed
    errors.safe_print("and later lines go nowhere")


@pytest.mark.parametrize("cls", [ArgumentError, CheckpointError, CheckpointIOError, ConversionError, errors.DataError,
                                 DivergenceError, errors.RankLocalError, IndexedDatasetError, ParallelLayoutError])
def test_every_user_fixable_error_is_known_to_run_cli(cls, capsys):
    """The classes a user can act on (flags, data, checkpoints, layout, divergence): one line, exit 2, with no
    list to keep in step: training's derive from UserError, core's two are named in KNOWN_ERRORS."""
    def bad():
        raise cls("what went wrong")

    assert errors.run_cli(bad) == 2
    assert capsys.readouterr().err == "error: what went wrong\n"
    assert issubclass(cls, errors.KNOWN_ERRORS)

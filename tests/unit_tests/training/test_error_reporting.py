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


_EXIT_SCRIPT = r'''
import atexit, os, sys, tempfile
import torch.distributed as dist
from megatron_cai.training.errors import exit_process

marker, mode = sys.argv[1], sys.argv[2]
if mode != "single":
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
atexit.register(lambda: open(marker, "a").write("atexit\n"))


class Finalized:  # writes through what it bound while the interpreter was whole
    def __del__(self, write=os.write, fd=os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        write(fd, b"finalized\n")


keep = Finalized()


def main():
    print("output before the exit", flush=False)
    if mode == "raise":
        raise KeyError("bug")
    return 2


exit_process(main)
'''


@pytest.mark.parametrize("mode", ["distributed", "raise", "single"])
def test_a_failed_distributed_process_exits_without_finalization(tmp_path, mode):
    """Status kept, atexit handlers run, stdout flushed; a failed distributed process skips finalization
    (where an undestroyed process group can abort it), a single process still finalizes."""
    import os
    import subprocess

    marker = tmp_path / "marker"
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, str(script), str(marker), mode], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == (1 if mode == "raise" else 2), proc.stderr
    assert proc.stdout == "output before the exit\n"
    assert ("KeyError: 'bug'" in proc.stderr) == (mode == "raise")
    lines = marker.read_text().splitlines()
    assert lines[0] == "atexit"
    assert ("finalized" in lines) == (mode == "single")

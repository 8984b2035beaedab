"""One round of problems: what the flags need from the machine joins the flag report; --sequence-parallel at
TP = 1 is disabled with Megatron's warning; a rank other than 0 prints an error every rank finds, after a grace."""
from __future__ import annotations

import io

import pytest
import torch

from megatron_cai.training import errors
from megatron_cai.training.arguments import ArgumentError, parse_args, parse_config, resolve_megatron_flags

MINIMAL = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]


def _report(argv: list[str]) -> list[str]:
    with pytest.raises(ArgumentError) as err:
        parse_args(argv, machine=True)
    return str(err.value).splitlines()


def test_missing_files_and_bad_flags_in_one_report(tmp_path):
    (tmp_path / "half.idx").write_bytes(b"")
    lines = _report(MINIMAL + ["--data-path", "0.7", str(tmp_path / "none"), "0.3", str(tmp_path / "half"),
                               "--vocab-file", str(tmp_path / "vocab.json"), "--bogus"])
    assert lines[0].startswith("4 flag problems")
    body = "\n".join(lines)
    assert f"--data-path {tmp_path}/none: {tmp_path}/none.idx and {tmp_path}/none.bin not found" in body
    assert f"--data-path {tmp_path}/half: {tmp_path}/half.bin not found" in body  # the .idx is there
    assert f"--vocab-file {tmp_path}/vocab.json: file not found" in body and "unknown   --bogus" in body


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_device_without_cuda_is_reported():
    assert _report(MINIMAL + ["--device", "cuda"]) == [
        "--device cuda: no CUDA device is available here; use --device cpu, or leave it unset"]


def test_machine_checks_are_only_for_the_launch():
    parse_args(MINIMAL + ["--data-path", "nowhere/prefix", "--device", "cuda"])  # a config built elsewhere


@pytest.mark.parametrize("tp,disabled", [(1, True), (2, False)])
def test_sequence_parallel_at_tp1_is_disabled_with_megatrons_warning(tp, disabled):
    args = resolve_megatron_flags(parse_args(MINIMAL + ["--sequence-parallel", "--tensor-model-parallel-size",
                                                        str(tp)]))
    warning = " > warning: Disabling sequence parallelism because tensor model parallelism is disabled"
    assert args.sequence_parallel is (not disabled)
    assert (warning in args.megatron_notes) is disabled
    if disabled:
        config = parse_config(MINIMAL + ["--sequence-parallel"], world_size=1)
        assert not config.parallel.sequence_parallel and not config.model.sequence_parallel
        assert config.logging.megatron_notes.count(warning) == 1


class _Store:
    def __init__(self, reported: bool) -> None:
        self.keys = {"megatron_cai/error_reported"} if reported else set()
        self.counts: dict[str, int] = {}

    def add(self, key, amount):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set(self, key, value):
        self.keys.add(key)

    def wait(self, keys, timeout):
        if not set(keys) <= self.keys:
            raise RuntimeError("Socket Timeout")


@pytest.mark.parametrize("reported", [True, False])
def test_with_a_process_group_rank_0_marks_its_report(monkeypatch, reported):
    err, store = io.StringIO(), _Store(reported)
    monkeypatch.setattr(errors.sys, "stderr", err)
    monkeypatch.setattr(errors, "_default_store", lambda: store)
    monkeypatch.setattr(errors, "world_size", lambda: 2)
    monkeypatch.setattr(errors, "current_rank", lambda: 1)
    errors.report_known_error(ArgumentError("--x: bad"))
    assert err.getvalue() == ("" if reported else "error: --x: bad\n")  # silent once rank 0 has printed
    monkeypatch.setattr(errors, "current_rank", lambda: 0)
    monkeypatch.setattr(errors, "PEER_REPORT_GRACE_S", 0.2)  # no other rank acknowledges here
    fresh = _Store(False)
    monkeypatch.setattr(errors, "_default_store", lambda: fresh)
    errors.report_known_error(ArgumentError("--x: bad"))
    assert "megatron_cai/error_reported" in fresh.keys


def test_other_ranks_print_the_report_after_the_grace(monkeypatch):
    slept, err = [], io.StringIO()
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setattr(errors.sys, "stderr", err)
    for rank, expect_sleep in ((0, []), (3, [errors.PEER_REPORT_GRACE_S])):
        slept.clear()
        monkeypatch.setattr(errors, "current_rank", lambda r=rank: r)
        monkeypatch.setattr(errors, "world_size", lambda: 4)
        assert errors.report_known_error(ArgumentError("--x: bad")) == 2
        assert slept == expect_sleep
    assert err.getvalue() == "error: --x: bad\nerror: --x: bad\n"


def test_rank_0_keeps_the_store_until_the_other_ranks_saw_its_report(monkeypatch):
    """Rank 0 hosts the store: had it exited at once after printing, a rank that reaches the error a little later
    would lose the store while waiting for the mark, and print the report a second time."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    local, out = threading.local(), io.StringIO()
    monkeypatch.setattr(errors, "_default_store", lambda: local.store)
    monkeypatch.setattr(errors, "current_rank", lambda: local.rank)
    monkeypatch.setattr(errors, "world_size", lambda: 2)
    monkeypatch.setattr(errors.sys, "stderr", out)
    host = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)

    def rank_1():
        local.rank = 1
        local.store = TCPStore("127.0.0.1", host.port, 2, False, timeout=timedelta(seconds=30))
        time.sleep(0.5)  # reaches the error after rank 0 printed
        errors.report_known_error(ArgumentError("--x: bad"))

    other = threading.Thread(target=rank_1)
    other.start()
    local.rank, local.store = 0, host
    errors.report_known_error(ArgumentError("--x: bad"))
    seen_when_rank_0_left = host.add("megatron_cai/error_report_seen", 0)
    other.join()
    assert seen_when_rank_0_left == 1
    assert out.getvalue() == "error: --x: bad\n"

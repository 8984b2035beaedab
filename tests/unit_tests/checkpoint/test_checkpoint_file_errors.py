"""Checkpoint file errors name what they found: truncated, empty or foreign torch files, corrupt JSON, and
Squinch error-feedback state that a resume drops (with the reason)."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_cai.core.distributed.reducers import AllReduceReducer
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer
from megatron_cai.training.checkpoint.file_io import (
    CheckpointError,
    CheckpointIOError,
    read_json,
    save_torch,
)
from megatron_cai.training.checkpoint.safe_load import load_torch
from megatron_cai.training.checkpoint.torch_format import reducer_state_dropped


def test_load_torch_names_what_it_found(tmp_path):
    good = str(tmp_path / "good.pt")
    save_torch({"a": torch.arange(1000)}, good)
    assert torch.equal(load_torch(good)["a"], torch.arange(1000))
    data = open(good, "rb").read()
    cases = {"trunc.pt": data[: len(data) // 2], "empty.pt": b"", "text.pt": b"hello world"}
    expect = {"trunc.pt": "truncated or corrupt torch file", "empty.pt": "empty file (0 bytes): truncated",
              "text.pt": "not a torch file"}
    for name, content in cases.items():
        p = str(tmp_path / name)
        open(p, "wb").write(content)
        with pytest.raises(CheckpointIOError) as e:
            load_torch(p)
        assert p in str(e.value) and expect[name] in str(e.value) and "rank 0" in str(e.value)
    with pytest.raises(CheckpointIOError, match="missing"):
        load_torch(str(tmp_path / "none.pt"))


def test_read_json_names_the_file(tmp_path):
    p = str(tmp_path / "metadata.json")
    open(p, "w").write('{"a": 1,')
    with pytest.raises(CheckpointError, match=r"metadata\.json is corrupt: invalid JSON at line 1"):
        read_json(p)
    open(p, "w").write("")
    with pytest.raises(CheckpointError, match="an empty file"):
        read_json(p)
    open(p, "w").write("[1]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_json(p)


def test_squinch_state_dropped_is_reported(tmp_path):
    rank_dir = tmp_path / "mp_rank_00"
    rank_dir.mkdir()
    rpath = str(rank_dir / "reducer_dp_000.pt")
    squinch, plain = [SquinchReducer(None, 1)], [AllReduceReducer(None, 1)]
    meta = {"data_parallel_size": 2, "args": {"squinch": True}}
    assert reducer_state_dropped(rpath, True, squinch, meta) is None  # nothing saved, nothing dropped
    open(rpath, "wb").write(b"x")
    assert reducer_state_dropped(rpath, True, squinch, meta) is None
    assert "does not use --squinch: dropping it" in reducer_state_dropped(rpath, True, plain, meta)
    assert "another DP size: dropping it" in reducer_state_dropped(rpath, False, squinch, meta)
    os.remove(rpath)
    assert "start at zero" in reducer_state_dropped(rpath, True, squinch, {"args": {"squinch": False}})

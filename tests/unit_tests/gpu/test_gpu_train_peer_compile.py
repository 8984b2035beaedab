"""bench/gpu/train.py's compiled peer is compiled once: one Dynamo graph shared by every transformer layer,
no graph break, its attention calls counted outside the compiled region (issue 40: a call counter inside
the layers was guarded on, every layer call recompiled and the "compiled" peer ran eagerly). And a peer
that recompiles fails its own row. On the CPU with Dynamo's eager backend (what the dry run compiles)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import train  # noqa: E402


def _peer_argv(tmp_path, layers: int) -> list[str]:
    data = str(tmp_path / "corpus")
    train.build_corpus(data, 4 * 2 * 33)
    argv = train.base_flags("toy", 32, 2, 2, data, dry_run=True)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return argv


def test_compiled_peer_is_one_graph_for_24_layers(tmp_path) -> None:
    r = train.run_peer(_peer_argv(tmp_path, 24), warmup=1, device=torch.device("cpu"), compiled=True, dry_run=True)
    assert r["compile"]["unique_graphs"] == 1, r["compile"]
    assert r["compile"]["graph_breaks"] == 0, r["compile"]
    assert "error" not in r, r["error"]
    assert r["calls"] == {"scaled_dot_product_attention": 24}  # one eager forward, outside the compiled layers


def test_peer_that_recompiles_fails_its_row(tmp_path, monkeypatch) -> None:
    """The defect of issue 40 put back: SDPA counted inside the compiled layers. Each layer call then
    sees a new count, Dynamo recompiles, and the peer reports it instead of timing an eager model."""
    calls = {"n": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    r = train.run_peer(_peer_argv(tmp_path, 3), warmup=1, device=torch.device("cpu"), compiled=True, dry_run=True)
    assert r["compile"]["unique_graphs"] > 1, r["compile"]
    assert "not compiled once" in r["error"], r.get("error")


@pytest.mark.parametrize("compiled", [False])
def test_eager_peer_records_no_compile_stats(tmp_path, compiled) -> None:
    r = train.run_peer(_peer_argv(tmp_path, 2), warmup=1, device=torch.device("cpu"), compiled=compiled,
                       dry_run=True)
    assert "compile" not in r and "error" not in r and r["calls"] == {"scaled_dot_product_attention": 2}

"""Acceptance: two runs of 20 iterations at DP = 2 with Squinch and --deterministic-mode give identical losses
and weights (and the mode is on in the ranks: PyTorch's deterministic algorithms, Megatron's environment)."""
from __future__ import annotations

import hashlib
import os

import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL

ARGV = [*TINY_MODEL, "--num-layers", "2", "--mock-data", "--train-iters", "20", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--squinch", "--deterministic-mode", "--log-interval", "10", "--lr", "1e-3"]


def _worker(rank: int, world_size: int, argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    state = trainer.train()
    digest = hashlib.sha256()
    for name, p in sorted(trainer.model[0].module.state_dict().items()):
        digest.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    return {"losses": [h["lm loss"] for h in state.extra["history"]], "weights": digest.hexdigest(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "env": {k: os.environ.get(k) for k in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}}


def test_two_deterministic_runs_are_identical():
    first = run_distributed(_worker, 2, (ARGV,))
    second = run_distributed(_worker, 2, (ARGV,))
    assert len(first[0]["losses"]) == 20
    assert first[0]["losses"] == second[0]["losses"]
    assert [r["weights"] for r in first] == [r["weights"] for r in second]
    assert first[0]["weights"] == first[1]["weights"]  # the DP replicas agree too
    assert first[0]["losses"][-1] < first[0]["losses"][0]  # it trained
    assert all(r["deterministic"] for r in first)
    assert first[0]["env"] == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

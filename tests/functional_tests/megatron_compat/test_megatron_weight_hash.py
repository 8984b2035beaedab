"""--check-weight-hash-across-dp-replicas-interval: DP replicas that agree train on; corrupting one replica's
weight stops every rank at the next check with one error naming that rank."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL

from megatron_cai.training.arguments import ArgumentError, parse_config

ARGV = [*TINY_MODEL, "--num-layers", "2", "--mock-data", "--train-iters", "4", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--check-weight-hash-across-dp-replicas-interval", "2"]


def _worker(rank: int, world_size: int, argv: list[str], corrupt_rank: int | None) -> str:
    import pretrain_gpt
    from megatron_cai.training.features.weight_hash import WeightReplicaMismatchError
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    step = trainer.train_step

    def corrupting_step():
        result = step()
        if rank == corrupt_rank and trainer.state.iteration == 2:  # after iteration 3's update: one element
            with torch.no_grad():
                next(trainer.model[0].module.parameters()).view(-1)[0] += 1e-3
        return result

    trainer.train_step = corrupting_step
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            state = trainer.train()
    except WeightReplicaMismatchError as e:
        return f"stopped at {trainer.state.iteration}: {e}"
    return f"trained {state.iteration}"


@pytest.mark.parametrize("corrupt", [None, 1])
def test_replicas_checked(corrupt):
    results = run_distributed(_worker, 3, (ARGV + ["--global-batch-size", "3"], corrupt))
    if corrupt is None:
        assert results == ["trained 4"] * 3
    else:
        expected = ("stopped at 4: --check-weight-hash-across-dp-replicas-interval: at iteration 4 the weights of "
                    "rank(s) 1 differ from their data-parallel replicas' (ranks 0, 1, 2; the others agree)")
        assert results == [expected] * 3


def test_refused_with_fsdp2():
    with pytest.raises(ArgumentError, match="does not run with --use-torch-fsdp2"):
        parse_config(ARGV + ["--use-torch-fsdp2", "--ckpt-format", "torch_dist"], world_size=1)

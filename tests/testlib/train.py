"""Helpers that run short trainings in-process (inside a gloo rank or a single process) for tests."""
from __future__ import annotations

import pretrain_gpt
from megatron_cai.core import parallel_state as ps
from megatron_cai.training.training import Trainer

TINY_MODEL = ["--squared-relu",
              "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--vocab-size", "100", "--make-vocab-size-divisible-by", "8",
              # what the tests were written against (Megatron-LM's defaults differ: GeLU, learned_absolute,
              # linear, 2)
              "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0",
              # no final evaluation (Megatron-LM's: --eval-iters 100 batches of each set after training); a test
              # that evaluates passes its own --eval-iters after these
              "--eval-iters", "0"]


def with_activation(argv: list[str], *flags: str) -> list[str]:
    """``argv`` with TINY_MODEL's ``--squared-relu`` replaced by ``flags`` (another MLP activation)."""
    return [a for a in argv if a != "--squared-relu"] + list(flags)


def train(argv: list[str], world_size: int = 1, trainer_hook=None) -> dict:
    """Run pretrain_gpt's training with these flags; return the per-iteration history (last stage)."""
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    if trainer_hook is not None:
        trainer_hook(trainer)
    state = trainer.train()
    return {"history": state.extra["history"], "iteration": state.iteration,
            "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True), "rank": ps.get_rank(),
            "skipped": state.skipped_iterations, "exit_code": state.exit_code}


def last_stage_history(results: list[dict]) -> list[dict]:
    return [r for r in results if r["last_stage"]][-1]["history"]

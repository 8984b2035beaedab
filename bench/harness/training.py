"""Training from a bench: a ``Trainer`` built from Megatron flags through ``pretrain_gpt``'s public pieces,
the small GPT most benches train, evaluation on fixed batches and training in chunks.

Every run happens in the calling process (``parallel_state`` is re-initialised per Trainer). The Trainer's
data loaders are reached through ``loader`` and ``microbatches`` only, here.
"""
from __future__ import annotations

import os


def small_gpt_argv(*, layers: int, hidden: int, heads: int, seq: int, batch: int, iters: int, lr: float,
                   seed: int, data: str, tok: str, cache: str, weight_decay: float = 0.1,
                   warmup: int | None = None, bf16: bool = True, valid_batches: int = 8) -> list[str]:
    """Megatron flags of one small-GPT run on the demo corpus (CPU, no dropout, cosine LR).

    ``valid_batches``: the most validation batches any evaluation of the run reads (sizes the valid split).
    """
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(batch),
            "--global-batch-size", str(batch), "--train-iters", str(iters), "--lr", str(lr),
            "--min-lr", str(lr / 10), "--lr-warmup-iters", str(max(1, iters // 10) if warmup is None else warmup),
            "--lr-decay-style", "cosine", "--weight-decay", str(weight_decay), "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(seed), "--data-path", data,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok, "--split", "949,50,1",
            "--data-cache-path", os.path.join(cache, "index"), "--eval-interval", str(iters),
            "--eval-iters", str(valid_batches),
            "--log-interval", str(max(1, iters)), "--device", "cpu", "--make-vocab-size-divisible-by", "128",
            "--no-exit-signal-handler",
            "--position-embedding-type", "rope", "--num-workers", "0", "--squared-relu"]
    return argv + (["--bf16"] if bf16 else [])


def build_trainer(argv: list[str], world_size: int = 1, datasets_provider=None):
    """A ``Trainer`` for these Megatron flags (``pretrain_gpt.build_run``; its datasets and forward step)."""
    import pretrain_gpt
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.training.training import Trainer

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
    return Trainer(config, datasets_provider or pretrain_gpt.train_valid_test_datasets_provider,
                   pretrain_gpt.forward_step, tokenizer)


def core_model(trainer):
    """The GPT module of a single-chunk Trainer (under its DDP wrapper)."""
    return trainer.model[0].module


def loader(trainer, dataset, consumed: int = 0):
    """The Trainer's data loader over ``dataset`` from sample ``consumed`` on (the same batches every time)."""
    return trainer._loader(dataset, consumed)


def microbatches(trainer) -> list[dict]:
    """The next iteration's micro-batches of the training data."""
    return trainer._next_microbatches(trainer.train_iter)


def fixed_valid_loss(trainer, batches: int) -> float:
    """Validation ``lm loss`` over the first ``batches`` batches of the valid split (the same every call)."""
    log = trainer.config.logging
    saved = log.eval_iters, trainer.state.consumed_valid_samples
    log.eval_iters = batches
    trainer.valid_iter = loader(trainer, trainer.valid_ds)
    try:
        return float(trainer.evaluate()["lm loss"])
    finally:
        log.eval_iters, trainer.state.consumed_valid_samples = saved


def train_chunk(trainer, iters: int) -> list[dict]:
    """Train ``iters`` more iterations (``--train-iters`` is the schedule's end); return their history."""
    trainer.config.training.train_iters = trainer.state.iteration + iters
    trainer.config.checkpoint.save = None  # the benches save and evaluate between chunks themselves
    trainer.config.logging.eval_interval = 0
    return list(trainer.train().extra["history"])

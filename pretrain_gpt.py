"""Pretrain a GPT model (Megatron-LM's entry point and flag names).

    python pretrain_gpt.py --data-path data/demo_text_document --tokenizer-model data/tok.model ...
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...
    srun python pretrain_gpt.py ...            (ranks from SLURM_PROCID / SLURM_NTASKS)
"""
from __future__ import annotations

if __name__ == "__main__":  # before torch's import (seconds): a signal from here on asks for a clean exit
    from megatron_cai.training.preemption import exit_signal

    exit_signal.install()

import functools

import torch

from megatron_cai.core.context_parallel import get_batch_on_this_cp_rank
from megatron_cai.core.datasets.mock_dataset import MockGPTDataset
from megatron_cai.training.arguments import build_config, parse_args
from megatron_cai.training.config import ArgumentError, TrainConfig
from megatron_cai.training.errors import KNOWN_ERRORS, exit_process, run_cli
from megatron_cai.training.initialize import discover_env
from megatron_cai.training.preemption import exit_signal
from megatron_cai.training.training import pretrain


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor, normalizer: torch.Tensor | None = None):
    """Masked mean of the per-token losses of one micro-batch (a weighted mean for tree data with
    ``--tree-loss-weighting branch``, whose loss_mask holds branch weights).

    ``normalizer`` (context parallelism): the whole sequence's mask total / CP instead of this rank's mask
    total, so that the DP x CP mean of the ranks' losses (and gradients) is the sequence's mean."""
    losses = output.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum() / (mask.sum().clamp(min=1.0) if normalizer is None else normalizer)
    return loss, {"lm loss": loss.detach()}


def get_batch(data_iterator) -> tuple[dict, object]:
    """The next micro-batch as this rank computes on it, and the visibility its attention takes: this CP
    rank's share under context parallelism (``core.context_parallel.get_batch_on_this_cp_rank``), the
    intervals of packed or tree data, or None (plain causal)."""
    batch = get_batch_on_this_cp_rank(next(data_iterator))
    visibility = batch.get("visibility")
    if visibility is None and "visibility_start" in batch:
        visibility = (batch["visibility_start"], batch["visibility_limit"])
    return batch, visibility


def forward_step(data_iterator, model, distiller=None):
    """One micro-batch through one model chunk: returns its output and the loss function to apply.

    ``distiller``: the run's :class:`~megatron_cai.training.features.distill.Distiller`, bound by the Trainer when
    distillation is on (None: plain LM training)."""
    batch, visibility = get_batch(data_iterator)
    if distiller is not None and distiller.applies(model, batch):  # (1 - alpha) CE + alpha KD, last stage
        return distiller.forward(model, batch, visibility)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], visibility=visibility,
                   label_positions=batch.get("label_positions"))  # tree data: predictions across branches
    if "loss_normalizer" in batch:  # context parallelism: this rank's share of the sequence's mean
        return output, functools.partial(loss_func, batch["loss_mask"], normalizer=batch["loss_normalizer"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def build_tokenizer_from_args(args):
    """The tokenizer the flags name (None for --mock-data without a tokenizer model)."""
    from megatron_cai.training.arguments import tokenizer_type
    from megatron_cai.training.tokenizer import build_tokenizer

    ttype = tokenizer_type(args)
    needs = ("--vocab-file", args.vocab_file) if ttype == "GPT2BPETokenizer" else \
        ("--tokenizer-model", args.tokenizer_model)
    if needs[1] is None and ttype != "NullTokenizer":
        if args.mock_data:
            return None
        raise ArgumentError(f"--tokenizer-type {ttype} needs {needs[0]}")
    return build_tokenizer(ttype, args.tokenizer_model, args.vocab_size, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tiktoken_pattern=args.tiktoken_pattern,
                           tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                           tiktoken_special_tokens=args.tiktoken_special_tokens)


def build_run(argv=None, world_size: int | None = None) -> tuple[TrainConfig, object]:
    """Parse the flags once; return the run's TrainConfig (for ``world_size``, default the launcher's) and
    its tokenizer."""
    args = parse_args(argv, machine=True)  # the flags and what they need from this machine, in one report
    tokenizer = build_tokenizer_from_args(args)
    world = world_size if world_size is not None else discover_env().world_size
    config = build_config(args, world, vocab_size=tokenizer.vocab_size if tokenizer is not None else None)
    return config, tokenizer


def train_valid_test_datasets_provider(config: TrainConfig, tokenizer, num_samples):
    """(train, valid, test) datasets from --data-path/--split, or synthetic ones with --mock-data."""
    data, seq_length, seed = config.data, config.model.seq_length, config.training.seed
    if data.mock_data:
        vocab = config.model.vocab_size
        return tuple(MockGPTDataset(n, seq_length, vocab, seed=seed + i) if n else None
                     for i, n in enumerate(num_samples))
    from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
    from megatron_cai.core.datasets.tree_dataset import TreeDataset, TreeDatasetConfig
    from megatron_cai.training.flags.fim import fim_config
    from megatron_cai.training.logging import print_rank_0

    ds_config = TreeDatasetConfig(sequence_length=seq_length, random_seed=seed, split=data.split or "1,0,0",
                                  path_to_cache=data.data_cache_path, reset_position_ids=data.reset_position_ids,
                                  reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
                                  eod_token_id=_eod_or_none(tokenizer), data_format=data.data_format,
                                  tree_loss_weighting=data.tree_loss_weighting,
                                  vocab_size=config.model.vocab_size,  # token ids checked once per .bin
                                  fim=fim_config(data.fim, tokenizer) if data.fim is not None else None)
    if data.train_data_path is not None:  # Megatron's per-split blends: each split reads all of its prefixes
        per_split = (data.train_data_path, data.valid_data_path, data.test_data_path)
        whole = ("1,0,0", "0,1,0", "0,0,1")
        datasets = tuple(
            build_train_valid_test_datasets(paths, whole[i], [n if j == i else 0 for j in range(3)], ds_config)[i]
            if paths else None for i, (paths, n) in enumerate(zip(per_split, num_samples)))
    else:
        datasets = build_train_valid_test_datasets(data.data_path, data.split, num_samples, ds_config)
    trees = [(name, ds) for name, ds in zip(("train", "valid", "test"), datasets) if isinstance(ds, TreeDataset)]
    if trees and config.distill.enabled:
        raise ArgumentError("distillation (--distill-*) does not support tree data; use plain documents")
    for name, ds in trees:
        print_rank_0(f" > tree data: {ds.stats.summary(name)}")
    return datasets


def _eod_or_none(tokenizer):
    if tokenizer is None:
        return None
    try:
        return tokenizer.eod
    except ValueError:
        return None


def main(argv=None):
    """Parse, train, shut down; a known error (bad flags, data, checkpoint, layout, divergence) prints one
    ``error:`` line (rank 0, or the rank that found it) and returns 2, without a traceback.

    SIGTERM, SIGINT and SIGUSR1 are recorded from the first line on (``training.preemption.exit_signal``):
    during start-up the run stops before training, during training it saves; either way every rank exits 0."""
    exit_signal.install()
    return run_cli(functools.partial(_main, argv), KNOWN_ERRORS + (FileNotFoundError,))


def _main(argv=None) -> int:
    try:
        config, tokenizer = build_run(argv)
    except ValueError as e:  # a bad flag value or tokenizer file
        raise ArgumentError(str(e)) from None
    pretrain(config, train_valid_test_datasets_provider, forward_step, tokenizer)
    if torch.distributed.is_initialized():  # a clean shutdown: no process-group teardown at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main)

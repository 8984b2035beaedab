"""Pretrain a GPT model (Megatron-LM's entry point and flag names).

    python pretrain_gpt.py --data-path data/demo_text_document --tokenizer-model data/tok.model ...
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...
    srun python pretrain_gpt.py ...            (ranks from SLURM_PROCID / SLURM_NTASKS)
"""
from __future__ import annotations

import functools
import sys

import torch

from megatron_cai.core.datasets.mock_dataset import MockGPTDataset
from megatron_cai.training.arguments import ArgumentError, parse_args
from megatron_cai.training.distill import get_distiller
from megatron_cai.training.training import pretrain


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Masked mean of the per-token losses of one micro-batch (a weighted mean for tree data with
    ``--tree-loss-weighting branch``, whose loss_mask holds branch weights)."""
    losses = output.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """One micro-batch through one model chunk: returns its output and the loss function to apply."""
    batch = next(data_iterator)
    visibility = None
    if "visibility_start" in batch:
        visibility = (batch["visibility_start"], batch["visibility_limit"])
    distiller = get_distiller()
    if distiller is not None and distiller.applies(model, batch):  # (1 - alpha) CE + alpha KD, last stage
        return distiller.forward(model, batch, visibility)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], visibility=visibility,
                   label_positions=batch.get("label_positions"))  # tree data: predictions across branches
    return output, functools.partial(loss_func, batch["loss_mask"])


def build_tokenizer_from_args(args):
    from megatron_cai.training.tokenizer import build_tokenizer

    if args.tokenizer_model is None and args.tokenizer_type != "NullTokenizer":
        if args.mock_data:
            return None
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


def train_valid_test_datasets_provider(args, tokenizer, num_samples):
    """(train, valid, test) datasets from --data-path/--split, or synthetic ones with --mock-data."""
    if args.mock_data:
        vocab = tokenizer.vocab_size if tokenizer is not None else args.vocab_size
        return tuple(MockGPTDataset(n, args.seq_length, vocab, seed=args.seed + i) if n else None
                     for i, n in enumerate(num_samples))
    from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
    from megatron_cai.core.datasets.tree_dataset import TreeDataset, TreeDatasetConfig
    from megatron_cai.training.logging import print_rank_0

    config = TreeDatasetConfig(sequence_length=args.seq_length, random_seed=args.seed, split=args.split or "1,0,0",
                               path_to_cache=args.data_cache_path, reset_position_ids=args.reset_position_ids,
                               reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                               eod_token_id=_eod_or_none(tokenizer), data_format=args.data_format,
                               tree_loss_weighting=args.tree_loss_weighting)
    if args.train_data_path is not None:  # Megatron's per-split blends: each split reads all of its prefixes
        per_split = (args.train_data_path, args.valid_data_path, args.test_data_path)
        whole = ("1,0,0", "0,1,0", "0,0,1")
        datasets = tuple(
            build_train_valid_test_datasets(paths, whole[i], [n if j == i else 0 for j in range(3)], config)[i]
            if paths else None for i, (paths, n) in enumerate(zip(per_split, num_samples)))
    else:
        datasets = build_train_valid_test_datasets(args.data_path, args.split, num_samples, config)
    trees = [(name, ds) for name, ds in zip(("train", "valid", "test"), datasets) if isinstance(ds, TreeDataset)]
    if trees and (args.distill_samples or args.distill_teacher_load):
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
    try:
        args = parse_args(argv)
        tokenizer = build_tokenizer_from_args(args)
    except (ArgumentError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pretrain(args, train_valid_test_datasets_provider, forward_step, tokenizer)
    if torch.distributed.is_initialized():  # a clean shutdown: no process-group teardown at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

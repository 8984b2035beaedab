#!/usr/bin/env python
"""Run a teacher checkpoint over the train split of a preprocessed dataset; store k sampled tokens per position.

    python tools/dump_teacher_samples.py --load checkpoints/teacher --output data/teacher_k32 --k 32 \\
        --data-path data/stdlib_text_document --split 969,30,1 --seq-length 256 --seed 1234 \\
        --train-iters 2000 --global-batch-size 32

The data flags must be the *student's* (``--data-path``, ``--split``, ``--seq-length``, ``--seed``,
``--train-iters``/``--train-samples``, ``--global-batch-size``, ``--data-cache-path`` and the EOD flags):
they rebuild the student's train split, and the store is keyed by its sample index (sample ``i`` of the
store is what ``dataset[i]`` returns during training). The student's ``--distill-samples`` checks the corpus
fingerprint, the sample order, the sequence length, the vocabulary and the temperature, and refuses a store
that does not line up.

For each position the store keeps the ``--k`` ids drawn by Gumbel-top-k from ``softmax(logits / tau)``
(``--sampler topk``: the k most likely ids, a baseline), their logits (fp16 by default), kappa and lse; see
``megatron_cai/core/distillation/teacher_samples.py`` for the format. Padded vocabulary columns are sliced
off before sampling. The Gumbel noise of (sample, position, token) is a counter-based hash of ``--seed``,
so the dump is deterministic: any shard can be recomputed bit for bit (same device type and
``--micro-batch-size``), and the noise does not depend on batching or on how many processes share the dump.

Resumable: shards are written atomically; rerunning the same command computes only the shards that are
missing or unfinished. Under ``torchrun --nproc-per-node N`` (or with RANK/WORLD_SIZE set) rank r computes
the pending shards whose index is r mod N; no process group is needed. The teacher may be saved with any
TP/PP layout (it is loaded as one TP = 1, PP = 1 model in memory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_cai.core import device as device_mod  # noqa: E402
from megatron_cai.core import parallel_state as ps  # noqa: E402
from megatron_cai.core.datasets.indexed_dataset import get_idx_path  # noqa: E402
from megatron_cai.core.distillation import (  # noqa: E402
    TeacherSamplesError,
    TeacherSamplesMismatchError,
    TeacherSamplesWriter,
    counter_gumbel,
    dataset_fingerprint,
    gumbel_topk,
    position_keys,
    topk_select,
)
from megatron_cai.core.distillation.dataset import sample_order_fingerprint  # noqa: E402
from megatron_cai.training.checkpoint import (  # noqa: E402
    CheckpointError,
    ConversionError,
    checkpoint_trust,
    load_canonical,
    trust_from_flags,
)
from megatron_cai.training.features.distill import build_teacher  # noqa: E402
from megatron_cai.training.flags.checkpoint_flags import add_checkpoint_trust_flags  # noqa: E402
from megatron_cai.training.tokenizer import build_tokenizer  # noqa: E402


class DumpError(RuntimeError):
    """The dump cannot proceed as asked; the message says why."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("teacher and store")
    t.add_argument("--load", required=True, help="teacher checkpoint directory (any TP/PP layout)")
    t.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the latest)")
    t.add_argument("--output", required=True, help="store directory (created, or resumed if it exists)")
    t.add_argument("--k", type=int, default=32, help="ids kept per position")
    t.add_argument("--temperature", type=float, default=1.0, help="tau: sample from softmax(logits / tau)")
    t.add_argument("--sampler", choices=["gumbel", "topk"], default="gumbel")
    t.add_argument("--shard-size", type=int, default=1024, help="samples per shard file")
    t.add_argument("--micro-batch-size", type=int, default=8, help="samples per teacher forward")
    t.add_argument("--logits-dtype", choices=["float16", "bfloat16"], default="float16")
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    t.add_argument("--bf16", action="store_true", help="teacher forward under bf16 autocast")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_checkpoint_trust_flags(t)
    d = p.add_argument_group("data (the student's flags)")
    d.add_argument("--data-path", nargs="+", required=True, help="one preprocessed prefix")
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--seq-length", type=int, required=True)
    d.add_argument("--seed", type=int, default=1234, help="the student's --seed (data order) and the noise seed")
    d.add_argument("--train-iters", type=int, default=None)
    d.add_argument("--train-samples", type=int, default=None)
    d.add_argument("--global-batch-size", type=int, required=True)
    d.add_argument("--data-cache-path", default=None)
    d.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"],
                   help="default: the teacher checkpoint's")
    d.add_argument("--tokenizer-model", default=None, help="default: the copy saved with the checkpoint")
    d.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    d.add_argument("--eod-mask-loss", action="store_true")
    d.add_argument("--reset-position-ids", action="store_true")
    d.add_argument("--reset-attention-mask", action="store_true")
    return p


def student_num_samples(args) -> int:
    """Train samples the student builds its dataset for (Trainer: train_iters x global batch)."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise DumpError("set exactly one of --train-iters and --train-samples (the student's)")
    iters = args.train_iters if args.train_iters is not None else math.ceil(args.train_samples / args.global_batch_size)
    return iters * args.global_batch_size


def _tokenizer(args, ck):
    """The tokenizer from the flags, else the teacher checkpoint's (None when neither is available)."""
    ttype = args.tokenizer_type or ck.args.get("tokenizer_type") or "SentencePieceTokenizer"
    model = args.tokenizer_model
    if model is None and ttype != "NullTokenizer" and ck.args.get("tokenizer_model"):
        saved = os.path.join(ck.tokenizer_dir or "", os.path.basename(str(ck.args["tokenizer_model"]).rstrip("/")))
        model = saved if ck.tokenizer_dir and os.path.exists(saved) else ck.args["tokenizer_model"]
        if not os.path.exists(model):
            return None
    if ttype == "NullTokenizer":
        vocab = args.vocab_size if args.vocab_size is not None else ck.args.get("vocab_size")
        return build_tokenizer(ttype, None, vocab) if vocab is not None else None
    return build_tokenizer(ttype, model) if model else None


def build_train_dataset(args, tokenizer, num_samples: int, vocab_size: int):
    """The student's train split, built by pretrain_gpt's own provider from the same flags."""
    import pretrain_gpt

    if len(args.data_path) != 1:
        raise DumpError(f"--data-path: give one preprocessed prefix, got {args.data_path} (a store is keyed by "
                        "the samples of one GPT dataset; blends are not supported)")
    from megatron_cai.training.arguments import build_config
    from megatron_cai.training.arguments import build_parser as training_parser

    ns = training_parser().parse_args([])  # every training flag at its default, then the student's data flags
    flags = vars(args)
    vars(ns).update({name: flags[name] for name in ("data_path", "split", "seq_length", "seed", "data_cache_path",
                                                    "reset_position_ids", "reset_attention_mask", "eod_mask_loss")})
    vars(ns).update(distill_samples=args.output, train_iters=1)
    config = build_config(ns, world_size=1, vocab_size=vocab_size)
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider(config, tokenizer, (num_samples, 0, 0))
    if train is None:
        raise DumpError(f"--data-path {args.data_path[0]} --split {args.split}: the train split is empty")
    return train


def _batch(dataset, start: int, end: int, device) -> dict[str, torch.Tensor]:
    items = [dataset[i] for i in range(start, end)]
    return {k: torch.stack([it[k] for it in items]).to(device) for k in items[0]}


@torch.no_grad()
def sample_shard(model, dataset, writer: TeacherSamplesWriter, shard: int, args, device, progress=None):
    """Teacher samples of one shard: ``(ids, logits, kappa, lse)`` over its samples."""
    start, end = writer.shard_range(shard)
    vocab, seq = writer.vocab_size, writer.seq_length
    parts = []
    for b0 in range(start, end, args.micro_batch_size):
        b1 = min(b0 + args.micro_batch_size, end)
        batch = _batch(dataset, b0, b1, device)
        top = int(batch["tokens"].max())
        if top >= vocab:
            raise DumpError(f"{args.data_path[0]}: sample {b0 + int(batch['tokens'].max(1).values.argmax())} holds "
                            f"token id {top} but the teacher's vocabulary has {vocab} tokens: the corpus was "
                            "tokenized with another tokenizer")
        visibility = ((batch["visibility_start"], batch["visibility_limit"])
                      if "visibility_start" in batch else None)
        with device_mod.autocast(device, args.bf16):
            logits = model(batch["tokens"], batch["position_ids"], visibility=visibility)
        logits = logits[..., :vocab].float()  # drop the padded vocabulary columns
        if writer.sampler == "topk":
            parts.append(topk_select(logits, writer.k, tau=writer.tau))
        else:
            noise = counter_gumbel(writer.seed, position_keys(b0, b1 - b0, seq).to(device), vocab)
            parts.append(gumbel_topk(logits, writer.k, tau=writer.tau, gumbel=noise))
        if progress is not None:
            progress.update(b1 - b0)
    return tuple(torch.cat([p[i] for p in parts]) for i in range(4))


def dump(args) -> list[int]:
    """Write the pending shards of this rank; returns the shard indices computed here."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.k < 1 or args.shard_size < 1 or args.micro_batch_size < 1 or not args.temperature > 0:
        raise DumpError("--k, --shard-size and --micro-batch-size must be >= 1 and --temperature > 0")
    num_samples = student_num_samples(args)
    try:
        with checkpoint_trust(trust_from_flags(args)):
            ck = load_canonical(args.load, args.ckpt_step, load_optimizer=False)
    except (ConversionError, CheckpointError, FileNotFoundError) as e:
        raise DumpError(f"--load {args.load}: {e}") from None
    vocab = ck.config.vocab_size
    tokenizer = _tokenizer(args, ck)
    if tokenizer is not None and tokenizer.vocab_size != vocab:
        raise DumpError(f"the tokenizer has {tokenizer.vocab_size} tokens but the teacher {args.load} was trained "
                        f"with {vocab}: the student, the teacher and the corpus must share one tokenizer")
    if args.k > vocab:
        raise DumpError(f"--k {args.k} exceeds the teacher's vocabulary ({vocab} tokens)")
    positions = ck.config.max_position_embeddings
    if positions is not None and args.seq_length > positions:  # as pretrain_gpt.py's start-up check
        raise DumpError(f"--seq-length {args.seq_length} exceeds the {positions} max-position-embeddings of the "
                        f"teacher {args.load}; lower --seq-length")
    dataset = build_train_dataset(args, tokenizer, num_samples, vocab)
    prefix = args.data_path[0]
    order = sample_order_fingerprint(dataset)
    extra = {"teacher": os.path.abspath(args.load), "teacher_iteration": ck.iteration,
             "noise": "counter_gumbel(seed, sample * seq_length + position, token)", "split": args.split,
             "split_name": "train", "data_seed": args.seed, "dataset_samples": len(dataset),
             "sample_order_fingerprint": order, "bf16_forward": bool(args.bf16),
             "eod_mask_loss": args.eod_mask_loss, "reset_position_ids": args.reset_position_ids,
             "reset_attention_mask": args.reset_attention_mask}
    writer = TeacherSamplesWriter(args.output, k=args.k, tau=args.temperature, vocab_size=vocab,
                                  seq_length=args.seq_length, num_samples=num_samples, shard_size=args.shard_size,
                                  seed=args.seed, dataset_path=os.path.abspath(prefix),
                                  idx_fingerprint=dataset_fingerprint(get_idx_path(prefix)),
                                  logits_dtype=args.logits_dtype, sampler=args.sampler, extra=extra)
    old = writer.metadata.get("extra", {}).get("sample_order_fingerprint")
    if old is not None and old != order:
        raise TeacherSamplesMismatchError(
            f"{args.output}: the existing store was dumped for a train split with another sample order (split "
            f"{writer.metadata['extra'].get('split')!r}, seed {writer.metadata['extra'].get('data_seed')!r}); "
            "use a new --output or the same data flags")
    pending = writer.pending_shards()
    mine = [i for i in pending if i % world == rank]  # by shard index: independent of timing
    done = writer.num_shards - len(pending)
    if rank == 0:
        print(f" teacher {args.load} (iteration {ck.iteration}, vocab {vocab}) -> {args.output}: {writer.num_shards} "
              f"shards of {args.shard_size} samples x {args.seq_length} positions, k={args.k}, tau={args.temperature}, "
              f"sampler {args.sampler}; {done} finished, {len(pending)} to compute", flush=True)
    if not mine:
        return []
    device = device_mod.resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    own_ps = not ps.model_parallel_is_initialized()
    if own_ps:
        ps.initialize_model_parallel(1, 1)
    try:
        rows = ck.model["embedding.word_embeddings.weight"].shape[0]
        model = build_teacher(ck, padded_vocab_size=rows, device=device)
        total = sum(writer.shard_range(i)[1] - writer.shard_range(i)[0] for i in mine)
        with tqdm(total=total, unit="sample", desc=f"teacher samples (rank {rank})" if world > 1 else "teacher samples",
                  disable=args.no_progress, file=sys.stderr, dynamic_ncols=True) as bar:
            for shard in mine:
                writer.write_shard(shard, *sample_shard(model, dataset, writer, shard, args, device, bar))
    finally:
        if own_ps:
            ps.destroy_model_parallel()
    return mine


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    try:
        computed = dump(args)
    except (DumpError, TeacherSamplesError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.output, "metadata.json")) as f:
        meta = json.load(f)
    per_token = args.k * (4 if meta["ids_dtype"] == "int32" else 2) + args.k * 2 + 8
    print(f" computed {len(computed)} shard(s) in {time.time() - t0:.1f} s; store {args.output}: "
          f"{meta['dataset']['num_samples']} samples, {per_token} bytes per position (k={args.k})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

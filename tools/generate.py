"""Sample text from a checkpoint (any TP/PP layout; runs in one process with a KV cache).

    python tools/generate.py --load checkpoints/demo --prompt "def main(" --max-new-tokens 64
    python tools/generate.py --load checkpoints/demo --prompt "import" --temperature 0.8 --top-p 0.9 --seed 1
    python tools/generate.py --load checkpoints/demo --prompt "class A:" --branches "  def f(" "  def g("

``--temperature 0`` is greedy decoding. The tokenizer is the copy saved with the checkpoint
(``iter_*/tokenizer/``) unless ``--tokenizer-model`` is given. Prints the prompt and its continuation.
``--branches`` decodes several continuations of one prompt together, the prompt computed once
(``megatron_cai.inference.branches``); with ``--num-samples K`` each branch is sampled K times.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cai.core import device as device_mod  # noqa: E402
from megatron_cai.core.transformer.int8_kv_cache import KV_CACHE_DTYPES  # noqa: E402
from megatron_cai.inference.branches import decode_branches  # noqa: E402
from megatron_cai.inference.generation import (  # noqa: E402
    checkpoint_tokenizer,
    generate,
    generation_length,
    load_model,
)
from megatron_cai.training.checkpoint import (  # noqa: E402
    CheckpointError,
    ConversionError,
    checkpoint_trust,
    trust_from_flags,
)
from megatron_cai.training.flags.checkpoint_flags import add_checkpoint_trust_flags  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (written by pretrain_gpt.py --save)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the latest)")
    p.add_argument("--prompt", default=None, help="prompt text (default: read from stdin)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--num-samples", type=int, default=1, help="independent continuations of the prompt")
    p.add_argument("--branches", nargs="+", default=None, metavar="TEXT",
                   help="continuations of the prompt decoded together as branches (the prompt is computed "
                        "once); each branch text is fed after the prompt before decoding ('' for none)")
    p.add_argument("--ignore-eod", action="store_true", help="keep generating after the end-of-document token")
    p.add_argument("--tokenizer-model", default=None, help="override the checkpoint's tokenizer file")
    p.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; int8: int8 blocks scaled per head by dynamic clamping")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    add_checkpoint_trust_flags(p)
    return p


def _eod(tokenizer) -> int | None:
    try:
        return tokenizer.eod
    except ValueError:
        return None


def _print_branches(args, model, tokenizer, ids: list[int], eos: int | None) -> None:
    """Decode every ``--branches`` suffix (x --num-samples) after the shared prompt in one batch."""
    suffixes = [tokenizer.tokenize(text) for text in args.branches]
    rows = [s for s in suffixes for _ in range(args.num_samples)]
    out = decode_branches(model, ids, args.max_new_tokens, branches=rows, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eos,
                          kv_cache_dtype=args.kv_cache_dtype)
    for r, new in enumerate(out.new_tokens):
        b, i = divmod(r, args.num_samples)
        print(f"----- branch {b + 1}" + (f" sample {i + 1}" if args.num_samples > 1 else "") + " -----")
        print(tokenizer.detokenize(ids + rows[r] + new.tolist()), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 0:
        print(f"error: --max-new-tokens must be >= 0, got {args.max_new_tokens}", file=sys.stderr)
        return 2
    device = args.device or device_mod.default_device_name()
    try:
        with checkpoint_trust(trust_from_flags(args)):
            model, ck = load_model(args.load, args.ckpt_step, device)
        tokenizer = checkpoint_tokenizer(ck, args.tokenizer_model, args.tokenizer_type)
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        ids = tokenizer.tokenize(prompt)
        if not ids:  # an empty prompt starts from BOS, or from EOD (the start of a new document)
            start = tokenizer.bos if tokenizer.bos is not None else _eod(tokenizer)
            if start is None or start >= model.config.vocab_size:
                raise ValueError("the prompt is empty and the tokenizer has no BOS/EOD token in the model's vocabulary")
            ids = [start]
        cfg = model.config
        error, warning = generation_length(len(ids), args.max_new_tokens, cfg.seq_length, cfg.max_position_embeddings,
                                           cfg.position_embedding_type == "learned_absolute")
        if error:
            raise ValueError(error)
        if warning:
            print(f"WARNING: {warning}", file=sys.stderr, flush=True)
        eos = None if args.ignore_eod else _eod(tokenizer)
        if args.branches is not None:
            _print_branches(args, model, tokenizer, ids, eos)
            return 0
        for i in range(args.num_samples):
            out = generate(model, ids, args.max_new_tokens, tokenizer=tokenizer, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p,
                           seed=None if args.seed is None else args.seed + i, eos_id=eos,
                           kv_cache_dtype=args.kv_cache_dtype)
            if args.num_samples > 1:
                print(f"----- sample {i + 1} -----")
            print(out.text[0], flush=True)
    except (ConversionError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Megatron-LM's checkpoint converter command line, running this repository's converters underneath.

    python tools/checkpoint/convert.py --model-type GPT --loader core --saver core \\
        --load-dir megatron_ckpt --save-dir megatron_ckpt_tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

Loaders: ``core`` (``mcore``): a Megatron-LM GPT checkpoint, ``torch`` or ``torch_dist`` format
(``megatron_cai.interop.megatron``); ``hf`` / ``llama_mistral``: a local Hugging Face Llama directory
(``megatron_cai.interop.hf``). Savers: ``core`` (``mcore``): a Megatron-LM ``torch`` checkpoint with
megatron-core's parameter names for ``--saver-transformer-impl`` (default ``transformer_engine``, as Megatron-LM's),
at the target TP / PP (default: the source's); ``hf``: a Hugging Face directory. The weights pass through this
repository's layout-free form, exactly (no dtype change); the iteration and consumed-sample counters are kept, the
optimizer state is not (as Megatron-LM's converter). Loaders and savers this repository lacks (``legacy``:
pre-megatron-core parameter names; ``mixtral_hf``: MoE; ``llava``, ``hf_llava``: multimodal) are refused by name.
``--megatron-path``, ``--max-queue-size``, ``--no-checking`` and ``--loader-transformer-impl`` (both layer
specs' names are read) have no effect here.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_cai.training.checkpoint import (  # noqa: E402
    ConversionError,
    check_conversion_target,
    checkpoint_trust,
    trust_from_flags,
)
from megatron_cai.training.errors import KNOWN_ERRORS, run_cli  # noqa: E402
from megatron_cai.training.flags.checkpoint_flags import add_checkpoint_trust_flags  # noqa: E402

LOADERS = {"core": "core", "mcore": "core", "hf": "hf", "llama_mistral": "hf"}
SAVERS = {"core": "core", "mcore": "core", "hf": "hf"}
REFUSED = {"legacy": "pre-megatron-core (legacy) parameter names are not read or written here; convert with "
                     "Megatron-LM's own tool first",
           "mixtral_hf": "Mixtral's Hugging Face layout is not read or written here (MoE models are exported with "
                         "tools/convert_checkpoint.py --to-megatron)",
           "llava": "multimodal models are not supported here", "hf_llava": "multimodal models are not supported here",
           "megatron": "Megatron-LM's default plugin name is the legacy one: pass --loader core / --saver core"}
IGNORED = ("megatron_path", "max_queue_size", "loader_transformer_impl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-type", required=True, choices=["GPT", "BERT"])
    p.add_argument("--loader", default="megatron", help="core (mcore), hf, llama_mistral")
    p.add_argument("--saver", default="megatron", help="core (mcore), hf")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--max-queue-size", type=int, default=50, help="no effect here")
    p.add_argument("--no-checking", dest="checking", action="store_false", help="no effect here")
    p.add_argument("--megatron-path", default=None, help="no effect here: this repository's converters run")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-expert-parallel-size", type=int, default=1, help="1 only (an MoE model is written "
                   "with every expert on each rank)")
    p.add_argument("--saver-transformer-impl", default="transformer_engine", choices=["local", "transformer_engine"],
                   help="core saver: the megatron-core layer spec whose parameter names are written")
    p.add_argument("--loader-transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine"], help="no effect here: both specs' names are read")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="refused unless it equals the checkpoint's vocabulary: padded rows are kept here")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --save-dir (ours)")
    p.add_argument("--megatron-trust-pickle", action="store_true",
                   help="core loader: rank files that do not load with torch.load(weights_only=True) (ours)")
    add_checkpoint_trust_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: _trusted(args), KNOWN_ERRORS + (FileNotFoundError, OSError))


def _trusted(args: argparse.Namespace) -> int:
    with checkpoint_trust(trust_from_flags(args)):
        return convert(args)


def _plugin(kind: str, name: str, table: dict[str, str]) -> str:
    if name in table:
        return table[name]
    if name in REFUSED:
        raise ConversionError(f"--{kind} {name}: refused: {REFUSED[name]}")
    raise ConversionError(f"--{kind} {name}: unknown; the {kind}s here are {', '.join(sorted(set(table)))}")


def convert(args: argparse.Namespace) -> int:
    if args.model_type != "GPT":
        raise ConversionError(f"--model-type {args.model_type}: refused: GPT models only")
    loader, saver = _plugin("loader", args.loader, LOADERS), _plugin("saver", args.saver, SAVERS)
    if args.target_expert_parallel_size != 1:
        raise ConversionError("--target-expert-parallel-size: refused: experts are written with expert parallel "
                              "size 1 here (every expert on each rank; use 1)")
    for name in (n for n in IGNORED if getattr(args, n) != build_parser().get_default(n)):
        print(f" > --{name.replace('_', '-')}: no effect here (this repository's converters run)")
    check_conversion_target(args.load_dir, args.save_dir, args.overwrite)
    with tempfile.TemporaryDirectory(prefix="convert_") as tmp:
        ours = os.path.join(tmp, "ours")
        tp, pp = _load(loader, args, ours)
        tp = args.target_tensor_parallel_size or tp
        pp = args.target_pipeline_parallel_size or pp
        _check_true_vocab(args, ours)
        if saver == "core":
            from megatron_cai.interop.megatron import export_to_megatron

            export_to_megatron(ours, args.save_dir, tp=tp, pp=pp, spec=args.saver_transformer_impl,
                               ckpt_format="torch")
        else:
            from megatron_cai.interop.hf import export_to_hf

            export_to_hf(ours, args.save_dir)
    return 0


def _load(loader: str, args: argparse.Namespace, ours: str) -> tuple[int, int]:
    """The source as a checkpoint of ours (TP = PP = 1: a layout-free copy); the source's TP and PP."""
    if loader == "core":
        from megatron_cai.interop.megatron import import_from_megatron
        from megatron_cai.training.checkpoint import read_metadata, read_tracker

        import_from_megatron(args.load_dir, ours, tp=1, pp=1, trust_pickle=args.megatron_trust_pickle,
                             log=lambda *a: None)
        source = read_metadata(ours, read_tracker(ours))["converted_from"]  # the layout of the rank files,
        return source["tensor_model_parallel_size"], source["pipeline_model_parallel_size"]  # 1 x 1 for torch_dist
    from megatron_cai.interop.hf import import_from_hf

    import_from_hf(args.load_dir, ours, tp=1, pp=1, log=lambda *a: None)
    return 1, 1


def _check_true_vocab(args: argparse.Namespace, ours: str) -> None:
    if args.true_vocab_size is None:
        return
    from megatron_cai.training.checkpoint import load_canonical

    vocab = load_canonical(ours, load_optimizer=False).config.vocab_size
    if args.true_vocab_size != vocab:
        raise ConversionError(f"--true-vocab-size {args.true_vocab_size}: refused: the checkpoint's padded rows "
                              f"({vocab}) stay vocabulary here, as Megatron-LM trains them")


if __name__ == "__main__":
    sys.exit(main())

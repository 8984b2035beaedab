"""Convert checkpoints: reshard TP/PP(/VPP), export to Hugging Face, import from Hugging Face.

Reshard (model, Adam state, scheduler, counters; see docs/conversion.md)::

    python tools/convert_checkpoint.py --load ckpt --save ckpt_tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 1

Export a checkpoint of any layout to a ``transformers`` model directory::

    python tools/convert_checkpoint.py --to hf --load ckpt --save hf_model [--hf-architecture auto]

Change the format: torch (per-rank files) <-> torch_dist (torch.distributed.checkpoint, layout-free)::

    python tools/convert_checkpoint.py --load ckpt --save ckpt_dist --target-ckpt-format torch_dist
    python tools/convert_checkpoint.py --load ckpt_dist --save ckpt_torch --target-ckpt-format torch \
        [--target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2]

Initialise a training checkpoint from a local Hugging Face Llama / GPT-2 / Nemotron directory::

    python tools/convert_checkpoint.py --from hf --load hf_model --save ckpt_init \\
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2

Import a Megatron-LM GPT checkpoint (torch or torch_dist format), or write ours as a Megatron-LM one::

    python tools/convert_checkpoint.py --from-megatron --load megatron_ckpt --save ckpt_from_megatron
    python tools/convert_checkpoint.py --to-megatron --load ckpt --save megatron_ckpt \\
        [--megatron-ckpt-format torch_dist]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cai.training.checkpoint import (  # noqa: E402
    ConversionError,
    check_conversion_target,
    checkpoint_trust,
    detect_format,
    dist_to_torch,
    read_metadata,
    read_tracker,
    reshard_checkpoint,
    torch_to_dist,
    trust_from_flags,
)
from megatron_cai.training.errors import KNOWN_ERRORS, run_cli  # noqa: E402
from megatron_cai.training.flags.checkpoint_flags import add_checkpoint_trust_flags  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--load", required=True, help="source checkpoint directory (or Hugging Face directory)")
    p.add_argument("--save", required=True, help="output directory (new or empty; must differ from --load)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --save directory (files of the same iteration are replaced)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--to", choices=["hf"], default=None, help="export to a Hugging Face model directory")
    direction.add_argument("--from", dest="from_", choices=["hf"], default=None,
                           help="import a Hugging Face model directory")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None,
                   help="default: the source's (1 for --from hf)")
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=None,
                   help="default: the source's (1 for --from hf)")
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline chunks of this many layers (as --num-layers-per-virtual-pipeline-stage)")
    p.add_argument("--target-data-parallel-size", type=int, default=None,
                   help="recorded in metadata.json only (DP follows the world size at run time)")
    p.add_argument("--ckpt-step", type=int, default=None, help="source iteration (default: the latest)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocabulary padding of the target (default: the source run's, else 128)")
    p.add_argument("--no-optimizer", action="store_true", help="reshard the model only (drop the Adam state)")
    p.add_argument("--hf-architecture", default="auto", choices=["auto", "llama", "gpt2", "nemotron", "megatron_cai"],
                   help="--to hf: the transformers architecture (auto: the first that represents the model exactly)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="--to hf: dtype of the exported weights")
    p.add_argument("--tokenizer-model", default=None, help="--to hf: override the checkpoint's tokenizer file")
    p.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    # --- checkpoint formats (torch <-> torch_dist): megatron_cai/training/checkpoint/format_conversion.py
    p.add_argument("--target-ckpt-format", choices=["torch", "torch_dist"], default=None,
                   help="output format (default: torch; the source's format is detected from its files)")
    _add_megatron_flags(p)
    return p


def _add_megatron_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM checkpoints (megatron_cai.interop.megatron; docs/conversion.md)."""
    g = p.add_argument_group("Megatron-LM checkpoints")
    g.add_argument("--from-megatron", action="store_true",
                   help="--load is a Megatron-LM GPT checkpoint (torch or torch_dist format): convert it into ours "
                        "(at the target TP/PP; default: the source's)")
    g.add_argument("--to-megatron", action="store_true",
                   help="write our checkpoint in --load as a Megatron-LM torch checkpoint (mp_rank_* files)")
    g.add_argument("--megatron-ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="--to-megatron: legacy per-rank files (torch) or megatron-core dist_checkpointing (torch_dist)")
    g.add_argument("--megatron-spec", choices=["local", "transformer_engine"], default="local",
                   help="--to-megatron: the megatron-core layer spec whose parameter names to write")
    g.add_argument("--megatron-trust-pickle", action="store_true",
                   help="--from-megatron: allow rank files that do not load with torch.load(weights_only=True)")
    add_checkpoint_trust_flags(p.add_argument_group("checkpoints of ours (docs/checkpoints.md)"))


def _convert_megatron(a: argparse.Namespace) -> int:
    from megatron_cai.interop import megatron as mlm

    if a.from_megatron and (a.to_megatron or a.to or a.from_):
        raise ConversionError("--from-megatron cannot be combined with --to-megatron, --to or --from")
    if a.to_megatron and (a.to or a.from_):
        raise ConversionError("--to-megatron cannot be combined with --to or --from")
    if a.from_megatron:
        mlm.import_from_megatron(a.load, a.save, tp=a.target_tensor_parallel_size,
                                 pp=a.target_pipeline_model_parallel_size,
                                 vp_layers=a.target_num_layers_per_virtual_pipeline_stage, step=a.ckpt_step,
                                 trust_pickle=a.megatron_trust_pickle)
    else:
        mlm.export_to_megatron(a.load, a.save, tp=a.target_tensor_parallel_size,
                               pp=a.target_pipeline_model_parallel_size, step=a.ckpt_step, spec=a.megatron_spec,
                               make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                               ckpt_format=a.megatron_ckpt_format)
    return 0


def _convert_format(a: argparse.Namespace) -> bool:
    """torch -> torch_dist, or torch_dist -> torch (any TP/PP); False when this is a plain torch reshard."""
    step = a.ckpt_step if a.ckpt_step is not None else read_tracker(a.load)
    source = detect_format(a.load, step) if step is not None else None
    target = a.target_ckpt_format or "torch"
    if target == "torch_dist":
        if source == "torch_dist":
            raise ConversionError(f"{a.load} is already a torch_dist checkpoint: it loads into any layout as it is")
        given = [f"--{n.replace('_', '-')}" for n in _SIZE_FLAGS if vars(a)[n] is not None]
        if given:
            raise ConversionError(f"a torch_dist checkpoint has no fixed layout: drop {', '.join(given)}")
        torch_to_dist(a.load, a.save, a.ckpt_step, with_optimizer=not a.no_optimizer)
        return True
    if source != "torch_dist":
        return False
    dist_to_torch(a.load, a.save, a.ckpt_step, tp=a.target_tensor_parallel_size,
                  pp=a.target_pipeline_model_parallel_size, vp_layers=a.target_num_layers_per_virtual_pipeline_stage,
                  dp=a.target_data_parallel_size, with_optimizer=not a.no_optimizer,
                  make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    return True
    # --- end of checkpoint formats


_SIZE_FLAGS = ("target_tensor_parallel_size", "target_pipeline_model_parallel_size",
               "target_num_layers_per_virtual_pipeline_stage", "target_data_parallel_size")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_cli(lambda: _trusted_convert(a), KNOWN_ERRORS + (FileNotFoundError, ValueError, OSError))


def _trusted_convert(a: argparse.Namespace) -> int:
    with checkpoint_trust(trust_from_flags(a)):
        return _convert(a)


def _convert(a: argparse.Namespace) -> int:
    for name in _SIZE_FLAGS:
        value = vars(a)[name]
        if value is not None and value < 1:
            raise ConversionError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_conversion_target(a.load, a.save, a.overwrite)  # never replace the source or another run
    if a.from_megatron or a.to_megatron:
        return _convert_megatron(a)
    if a.to == "hf":
        from megatron_cai.interop.hf import export_to_hf

        export_to_hf(a.load, a.save, step=a.ckpt_step, architecture=a.hf_architecture, dtype=a.dtype,
                     tokenizer_model=a.tokenizer_model, tokenizer_type=a.tokenizer_type)
    elif a.from_ == "hf":
        from megatron_cai.interop.hf import import_from_hf

        import_from_hf(a.load, a.save, tp=a.target_tensor_parallel_size or 1,
                       pp=a.target_pipeline_model_parallel_size or 1,
                       vp_layers=a.target_num_layers_per_virtual_pipeline_stage,
                       make_vocab_size_divisible_by=a.make_vocab_size_divisible_by or 128)
    elif _convert_format(a):
        pass
    else:
        tp, pp = a.target_tensor_parallel_size, a.target_pipeline_model_parallel_size
        if tp is None or pp is None:
            step = a.ckpt_step if a.ckpt_step is not None else read_tracker(a.load)
            meta = read_metadata(a.load, step) if step is not None else {}
            tp = tp if tp is not None else meta.get("tensor_model_parallel_size", 1)
            pp = pp if pp is not None else meta.get("pipeline_model_parallel_size", 1)
        reshard_checkpoint(a.load, a.save, tp, pp, a.target_num_layers_per_virtual_pipeline_stage,
                           dp=a.target_data_parallel_size, step=a.ckpt_step, with_optimizer=not a.no_optimizer,
                           make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    return 0


if __name__ == "__main__":
    sys.exit(main())

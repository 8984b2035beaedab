"""Megatron-LM's fill-in-the-middle data flags (``--fim-data`` and the ``--fim-*`` family).

The transform is :mod:`megatron_cai.core.datasets.fim_dataset` (megatron-core's ``GPTFIMDataset``, sample for
sample). Here: the flags with Megatron-LM's defaults, its checks (``validate_args``: not with mock data, a non-zero
``--fim-rate`` and ``--fim-spm-rate``; and ``--fim-fragment-rate`` with ``--fim-split-sample``, where megatron-core
would fail at the first sample), and the run's tokenizer seen as the transform's :class:`FimTokenizer`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...core.datasets.fim_dataset import FimConfig
from .report import FlagProblems

logger = logging.getLogger(__name__)

_TOKENS = ("prefix", "middle", "suffix", "pad", "eod")
_DEFAULT_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")


@dataclass(frozen=True)
class FimSettings:
    """The --fim-* flags (token strings, resolved against the tokenizer when the data is built)."""

    rate: float
    spm_rate: float
    tokens: tuple[str, str, str, str, str]  # prefix, middle, suffix, pad, eod
    split_sample: str | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fill-in-the-middle data (Megatron-LM's --fim-*; megatron-core's GPTFIMDataset)")
    g.add_argument(
        "--fim-data",
        action="store_true",
        help="turn samples into fill-in-the-middle samples (<prefix> P <suffix> S <middle> M), as "
        "megatron-core's GPTFIMDataset does, sample for sample",
    )
    g.add_argument("--fim-rate", type=float, default=0.5, help="probability that a piece of a sample is FIM'd")
    g.add_argument(
        "--fim-spm-rate", type=float, default=0.5, help="probability that a FIM piece uses the SPM order instead of PSM"
    )
    g.add_argument(
        "--fim-split-sample",
        type=str,
        default=None,
        help="a token that cuts a sample into fragments, each FIM'd on its own",
    )
    g.add_argument(
        "--fim-fragment-rate",
        type=float,
        default=None,
        help="probability that a fragment is FIM'd (with --fim-split-sample)",
    )
    g.add_argument(
        "--fim-no-prefix", type=str, default=None, help="pieces whose text starts with this are left as they are"
    )
    for name, default in zip(_TOKENS, _DEFAULT_TOKENS):
        g.add_argument(
            f"--fim-{name}-token",
            type=str,
            default=default,
            help=f"the FIM {name} token (a token of the vocabulary; one that is not maps to the "
            "EOD token, as megatron-core's GPT-2 tokenizer maps unknown tokens)",
        )


def check(args: argparse.Namespace, problems: FlagProblems) -> None:
    if not args.fim_data:
        return
    if args.mock_data:
        problems.conflict("--fim-data with --mock-data: the FIM transform needs text (Megatron-LM's rule)")
    for flag, value in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate)):
        if not value:  # a value outside [0, 1] is FLAG_RANGES' problem
            problems.conflict(f"--fim-data needs a non-zero {flag} (Megatron-LM's rule), got {value}")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        problems.conflict(
            "--fim-split-sample needs --fim-fragment-rate (megatron-core fails at the first sample without it)"
        )
    if args.data_format == "tree":
        problems.conflict("--fim-data reads plain documents; it does not apply to --data-format tree")


def settings(args: argparse.Namespace) -> FimSettings | None:
    if not args.fim_data:
        return None
    tokens = tuple(vars(args)[f"fim_{name}_token"] for name in _TOKENS)
    return FimSettings(
        args.fim_rate, args.fim_spm_rate, tokens, args.fim_split_sample, args.fim_fragment_rate, args.fim_no_prefix
    )


class TokenizerFim:
    """A tokenizer of ``training/tokenizer.py`` as the transform's :class:`FimTokenizer`: text without the
    special tokens (EOD, BOS, pad and the FIM tokens), and the ids of a text."""

    def __init__(self, tokenizer, special: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.special = np.array(sorted(set(special)), dtype=np.int64)

    def fim_text(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        return self.tokenizer.detokenize(ids[~np.isin(ids, self.special)].tolist())

    def fim_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize(text)) if text else []


def token_id(tokenizer, token: str) -> int:
    """The id of a token string: one token of the vocabulary, else the EOD token (megatron-core's GPT-2
    tokenizer gives its unknown token, ``<|endoftext|>``), said once in the log."""
    ids = list(tokenizer.tokenize(token))
    if len(ids) == 1 and tokenizer.detokenize(ids) == token:
        return int(ids[0])
    logger.warning(
        "FIM token %r is not one token of the vocabulary: it maps to the EOD token (id %d)", token, tokenizer.eod
    )
    return int(tokenizer.eod)


def fim_config(fim: FimSettings, tokenizer) -> FimConfig:
    """The transform's configuration for this run's tokenizer."""
    prefix, middle, suffix, pad, eod = (token_id(tokenizer, t) for t in fim.tokens)
    specials = [
        i for i in (prefix, middle, suffix, pad, eod, tokenizer.eod, tokenizer.bos, tokenizer.pad) if i is not None
    ]
    split_id = token_id(tokenizer, fim.split_sample) if fim.split_sample is not None else None
    return FimConfig(
        TokenizerFim(tokenizer, specials),
        fim.rate,
        fim.spm_rate,
        prefix,
        middle,
        suffix,
        pad,
        eod,
        split_id,
        fim.fragment_rate,
        fim.no_prefix,
    )

"""Fill-in-the-middle samples (Megatron-LM's ``--fim-data``; megatron-core's ``GPTFIMDataset``), sample for sample.

Each sample of a :class:`GPTDataset` is cut at its EOD tokens; each piece (and, with ``split_sample_id``, each
fragment between those tokens) becomes, with probability ``rate``, ``<prefix> P <suffix> S <middle> M`` (PSM) or,
with probability ``spm_rate`` of those, ``<prefix> <suffix> S <middle> P M`` (SPM), where P, M, S are the text of
the piece cut at two uniformly drawn character positions and tokenized again. The sample is then cut or padded (with
the pad token) to its length. One ``numpy.random.RandomState(seed)`` per dataset draws every decision, in the
order megatron-core draws them, so the same data, seed and order of reads give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .gpt_dataset import GPTDataset


class FimTokenizer(Protocol):
    """What the transform needs from a tokenizer (megatron-core's ``tokenizer._tokenizer``)."""

    def fim_text(self, ids: np.ndarray) -> str:
        """The text of these ids, special tokens left out (``ids_to_text(ids, remove_special_tokens=True)``)."""
        ...

    def fim_ids(self, text: str) -> list[int]:
        """The ids of this text (``text_to_ids``)."""
        ...


@dataclass(frozen=True)
class FimConfig:
    """Megatron-LM's --fim-* flags, the tokens resolved to ids."""

    tokenizer: FimTokenizer
    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    split_sample_id: int | None = None  # --fim-split-sample: FIM each fragment between these tokens
    fragment_rate: float | None = None  # --fim-fragment-rate: the rate of each fragment
    no_prefix: str | None = None  # --fim-no-prefix: pieces whose text starts with this stay as they are


class FimGPTDataset(GPTDataset):
    """:class:`GPTDataset` whose samples go through the FIM transform (``config.fim``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fim: FimConfig = self.config.fim
        self.fim_rng = np.random.RandomState(seed=self.config.random_seed)

    def get_text(self, idx: int) -> np.ndarray:
        sample = super().get_text(idx)
        pieces: list = []
        start = 0
        for loc in np.flatnonzero(sample == self.fim.eod_id):
            if loc > start:  # an empty piece (and its EOD) is dropped, as megatron-core drops it
                pieces += [self._split_and_permute(sample[start:loc]), [self.fim.eod_id]]
            start = loc + 1
        pieces.append(self._split_and_permute(sample[start:]))
        out = np.concatenate(pieces).astype(np.int64)[: len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.fim.pad_id, dtype=np.int64)])

    def _split_and_permute(self, piece: np.ndarray) -> np.ndarray:
        fim = self.fim
        breaks = np.flatnonzero(piece == fim.split_sample_id) if fim.split_sample_id is not None else []
        if len(breaks) == 0:
            return self._permute(piece, fim.rate)
        if not self.fim_rng.binomial(1, fim.rate):
            return piece
        fragments: list = []
        start = 0
        for loc in breaks:
            if loc > start:
                fragments += [self._permute(piece[start:loc], fim.fragment_rate), [fim.split_sample_id]]
            start = loc + 1
        fragments.append(self._permute(piece[start:], fim.fragment_rate))
        return np.concatenate(fragments)

    def _permute(self, piece: np.ndarray, rate: float) -> np.ndarray:
        fim = self.fim
        if not self.fim_rng.binomial(1, rate):
            return piece
        text = fim.tokenizer.fim_text(piece)
        if fim.no_prefix is not None and text.startswith(fim.no_prefix):
            return piece
        lo, hi = sorted(self.fim_rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (
            np.array(fim.tokenizer.fim_ids(t), dtype=np.int64) for t in (text[:lo], text[lo:hi], text[hi:])
        )
        if self.fim_rng.binomial(1, fim.spm_rate):
            return np.concatenate([[fim.prefix_id, fim.suffix_id], suffix, [fim.middle_id], prefix, middle])
        return np.concatenate([[fim.prefix_id], prefix, [fim.suffix_id], suffix, [fim.middle_id], middle])

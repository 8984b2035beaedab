"""GPT pretraining dataset with Megatron-LM semantics, built in pure numpy.

A ``GPTDataset`` exposes the documents ``indexed_indices`` (a contiguous split of an
:class:`IndexedDataset`) as fixed-length samples. Three index arrays define it, exactly as in
Megatron-LM (same RNG stream, so the same seed gives the same sample order):

* ``document_index`` (int32): the split's documents tiled over the epochs needed for ``num_samples``
  and shuffled with ``numpy.random.RandomState(random_seed)``. If the final epoch contributes fewer
  than 80% of an epoch's samples, it is shuffled separately so the partial epoch does not bias
  sampling.
* ``sample_index`` ([S+1, 2]): row j = (position in ``document_index``, token offset) where sample j
  starts, i.e. token ``j * seq_length`` of the concatenated shuffled documents. Sample j reads the
  ``seq_length + 1`` tokens from row j to row j+1 inclusive, so samples cross document boundaries
  and consecutive samples share one token. The last partial sample is dropped.
* ``shuffle_index``: a permutation of the samples (two ranges with the separate final epoch).

The arrays are cached as ``.npy`` under ``path_to_cache`` (default ``<prefix dir>/cache/
GPTDataset_indices/``), keyed by the MD5 of a description of their inputs (dataset path, the content
fingerprints of the ``.idx``/``.bin`` (core/datasets/fingerprint.py), split range, num_samples, seed,
sequence length); stale entries are never read because any input change changes the key.

``dataset[i]`` is a dict of tensors (the batch contract)::

    tokens        int64   [seq]   input ids
    labels        int64   [seq]   tokens shifted by one
    loss_mask     float32 [seq]   1.0, or 0.0 where the *input* token is EOD under eod_mask_loss
    position_ids  int64   [seq]   0..seq-1, or restarting at 0 after every EOD (reset_position_ids)
    visibility_start, visibility_limit   int32 [seq]   only with reset_attention_mask

With ``reset_attention_mask`` documents end at (and include) EOD tokens; key j of the document
``[a, b)`` gets ``(visibility_start, visibility_limit) = (j, b)``: query i may attend key j iff
``visibility_start[j] <= i < visibility_limit[j]`` (see docs/design.md, "Key decisions"). The
intervals and position ids come from the layout builders of
:mod:`megatron_cai.core.transformer.visibility_layouts`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_cai.core.datasets.fingerprint import prefix_fingerprint
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
from megatron_cai.core.datasets.utils import (
    description_hash,
    load_or_build_indices,
    parse_and_normalize_split,
    to_json,
)
from megatron_cai.core.transformer.visibility_layouts import document_position_ids, from_document_lengths

logger = logging.getLogger(__name__)

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass
class GPTDatasetConfig:
    """Configuration of GPT datasets (the data flags of ``pretrain_gpt.py``).

    ``eod_token_id`` is the tokenizer's EOD id; it is required when any of ``reset_position_ids``,
    ``reset_attention_mask`` or ``eod_mask_loss`` is set. ``path_to_cache`` is ``--data-cache-path``.
    ``mid_level_dataset_surplus`` is the extra fraction of samples requested from each blended
    dataset (Megatron's ``--mid-level-dataset-surplus``).
    """

    sequence_length: int
    random_seed: int = 1234
    split: str = "969,30,1"
    path_to_cache: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_token_id: int | None = None
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = 0.005
    vocab_size: int | None = None  # token ids are checked against it once per .bin (None: no check)
    fim: Any = None  # fill-in-the-middle (fim_dataset.FimConfig): samples go through Megatron's FIM transform

    def __post_init__(self) -> None:
        if int(self.sequence_length) < 1:
            raise ValueError(f"sequence_length must be >= 1, got {self.sequence_length}")
        parse_and_normalize_split(self.split)
        needs_eod = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if needs_eod and self.eod_token_id is None:
            raise ValueError(
                "--reset-position-ids, --reset-attention-mask and --eod-mask-loss need the tokenizer's "
                "EOD id (GPTDatasetConfig.eod_token_id)"
            )
        if self.mid_level_dataset_surplus < 0:
            raise ValueError("mid_level_dataset_surplus must be >= 0")


def get_ltor_masks_and_position_ids(
    tokens: np.ndarray, eod_token: int | None, reset_position_ids: bool, reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> dict[str, np.ndarray]:
    """Loss mask, position ids and (with ``reset_attention_mask``) visibility intervals of one sample.

    Equivalent of Megatron's ``_get_ltor_masks_and_position_ids``: an EOD at position k belongs to the
    document it ends, the next document starts at k + 1 (an EOD in the last position starts nothing).
    """
    seq = tokens.shape[0]
    out: dict[str, np.ndarray] = {}
    is_eod = tokens == eod_token if eod_token is not None else np.zeros(seq, dtype=bool)
    loss_mask = np.ones(seq, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    out["loss_mask"] = loss_mask
    lengths = None
    if reset_position_ids or reset_attention_mask:
        bounds = np.concatenate([[0], np.flatnonzero(is_eod[:-1]) + 1, [seq]])
        lengths = np.diff(bounds).tolist()  # the packed documents, each >= 1 token
    if reset_position_ids:
        out["position_ids"] = document_position_ids(lengths).numpy()
    else:
        out["position_ids"] = np.arange(seq, dtype=np.int64)
    if reset_attention_mask:
        start, limit = from_document_lengths(lengths)  # causal documents: key j -> (j, document end)
        out["visibility_start"] = start.numpy().astype(np.int32)
        out["visibility_limit"] = limit.numpy().astype(np.int32)
    return out


def _build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                          separate_final_epoch: bool) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times and shuffled (Megatron's order of RNG draws)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_sample_index(sizes: np.ndarray, document_index: np.ndarray, sequence_length: int,
                        num_samples: int) -> np.ndarray:
    """[num_samples+1, 2] start (document_index position, offset) of every sample, vectorized.

    Sample j starts at token ``j * sequence_length`` of the concatenation of
    ``sizes[document_index]``; this reproduces Megatron's ``helpers.build_sample_idx`` row for row.
    """
    doc_sizes = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    starts = ends - doc_sizes
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    doc_pos = np.searchsorted(ends, positions, side="right")
    dtype = np.int32 if len(document_index) < np.iinfo(np.int32).max else np.int64
    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[:, 0] = doc_pos
    sample_index[:, 1] = positions - starts[doc_pos]
    sample_index[0] = (0, 0)
    return sample_index


def _build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffled ``[0, num_samples)`` followed by shuffled ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length samples over a contiguous document range of an :class:`IndexedDataset`.

    Args:
        indexed_dataset: the token store.
        dataset_path: its path prefix (for the cache key and messages).
        indexed_indices: the document (sequence) ids of this split, e.g. ``np.arange(beg, end)``.
        num_samples: samples wanted; the dataset covers whole epochs so ``len`` may be larger.
            ``None``: exactly one epoch.
        index_split: ``"train"``, ``"valid"`` or ``"test"`` (part of the cache key).
        config: :class:`GPTDatasetConfig`.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: np.ndarray,
                 num_samples: int | None, index_split: str, config: GPTDatasetConfig) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indexed_indices, dtype=np.int64)
        self.index_split = index_split
        self.config = config
        seq = int(config.sequence_length)
        self.tokens_per_epoch = int(self.dataset.sequence_lengths[self.indices].astype(np.int64).sum())
        if self.tokens_per_epoch < 2:
            raise ValueError(
                f"{dataset_path}: the {index_split} split (documents {self._doc_range()}) has "
                f"{self.tokens_per_epoch} tokens; at least 2 are needed to form a sample"
            )
        if num_samples is None:
            self.num_epochs = 1
        else:
            if num_samples < 0:
                raise ValueError(f"num_samples must be >= 0, got {num_samples}")
            self.num_epochs = max(1, -(-(num_samples * seq + 1) // self.tokens_per_epoch))
        self.num_samples = num_samples
        self.unique_description = to_json({
            "class": type(self).__name__,
            "dataset_path": os.path.abspath(dataset_path),
            **prefix_fingerprint(dataset_path),  # "idx", "bin": content, never size + mtime
            "index_split": index_split,
            "documents": self._doc_range(),
            "num_samples": num_samples,
            "random_seed": int(config.random_seed),
            "sequence_length": seq,
            "format": 1,
        })
        self.unique_description_hash = description_hash(self.unique_description)
        cache_dir = config.path_to_cache
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(dataset_path)), "cache",
                                     f"{type(self).__name__}_indices")
        self.cache_dir = cache_dir
        base = f"{self.unique_description_hash}-{type(self).__name__}-{index_split}"
        arrays, self.built_anew_on_cache_miss = load_or_build_indices(
            cache_dir, base, self.unique_description, _INDEX_NAMES, self._build_indices)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _doc_range(self) -> list[int] | str:
        """``[begin, end)`` of a contiguous document range, else an MD5 of the indices."""
        if len(self.indices) == 0:
            return [0, 0]
        beg, end = int(self.indices[0]), int(self.indices[-1]) + 1
        if end - beg == len(self.indices) and (np.diff(self.indices) == 1).all():
            return [beg, end]
        return "md5:" + description_hash(self.indices.tobytes().hex())

    def _build_indices(self) -> dict[str, np.ndarray]:
        t0 = time.time()
        seq, tpe, epochs = int(self.config.sequence_length), self.tokens_per_epoch, self.num_epochs
        separate_final_epoch = False
        if epochs > 1:
            sans_final = ((epochs - 1) * tpe - 1) // seq
            from_final = self.num_samples - sans_final
            per_epoch = (tpe - 1) // seq
            separate_final_epoch = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, epochs, rng, separate_final_epoch)
        total = (epochs * tpe - 1) // seq
        sample_index = _build_sample_index(self.dataset.sequence_lengths, document_index, seq, total)
        first = ((epochs - 1) * tpe - 1) // seq if separate_final_epoch else total
        shuffle_index = _build_shuffle_index(first, total, rng)
        logger.info(
            "built %s %s indices for %s: %d documents, %d tokens/epoch, %d epochs, %d samples "
            "(separate final epoch: %s) in %.2f s", type(self).__name__, self.index_split,
            self.dataset_path, len(self.indices), tpe, epochs, total, separate_final_epoch,
            time.time() - t0)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def get_text(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` token ids of sample ``idx`` (after shuffling), int64."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples ({self.index_split})")
        j = int(self.shuffle_index[idx])
        d0, o0 = (int(x) for x in self.sample_index[j])
        d1, o1 = (int(x) for x in self.sample_index[j + 1])
        doc = self.document_index
        if d0 == d1:
            parts = [self.dataset.get(int(doc[d0]), offset=o0, length=o1 - o0 + 1)]
        else:
            parts = [self.dataset.get(int(doc[d0]), offset=o0)]
            parts += [self.dataset.get(int(doc[d])) for d in range(d0 + 1, d1)]
            parts.append(self.dataset.get(int(doc[d1]), offset=0, length=o1 + 1))
        text = np.concatenate(parts).astype(np.int64)
        assert text.shape[0] == self.config.sequence_length + 1, "sample index is inconsistent"
        return text

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = self.get_text(int(idx))
        tokens, labels = text[:-1], text[1:]
        cfg = self.config
        extra = get_ltor_masks_and_position_ids(tokens, cfg.eod_token_id, cfg.reset_position_ids,
                                                cfg.reset_attention_mask, cfg.eod_mask_loss)
        sample = {"tokens": torch.from_numpy(tokens.copy()), "labels": torch.from_numpy(labels.copy())}
        sample.update({k: torch.from_numpy(v) for k, v in extra.items()})
        return sample

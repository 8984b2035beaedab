"""Build the train/valid/test datasets from ``--data-path``, ``--split`` and the sample counts."""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from megatron_cai.core.datasets.blended_dataset import BlendedDataset
from megatron_cai.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetError, get_idx_path
from megatron_cai.core.datasets.token_range import check_token_ids
from megatron_cai.core.datasets.utils import SPLIT_NAMES, get_blend_from_list, split_ranges

logger = logging.getLogger(__name__)

Dataset = torch.utils.data.Dataset


def _open(prefix: str, config: GPTDatasetConfig) -> IndexedDataset:
    if not IndexedDataset.exists(prefix):
        raise IndexedDatasetError(
            f"--data-path {prefix}: {get_idx_path(prefix)} or .bin not found (pass the prefix written by "
            f"tools/preprocess_data.py, e.g. '<output-prefix>_text_document', without .bin/.idx)"
        )
    return IndexedDataset(prefix, mmap=config.mmap_bin_files)


def build_train_valid_test_datasets(
    data_path: str | Sequence[str], split: str, num_samples: Sequence[int | None], config: GPTDatasetConfig,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """The (train, valid, test) datasets of ``--data-path`` under ``--split``.

    ``data_path`` follows Megatron's ``--data-path`` rules: one prefix, a list of prefixes, or
    ``[W1, P1, W2, P2, ...]`` weight/prefix pairs. Each prefix is split into contiguous document
    ranges by ``split`` (e.g. ``"969,30,1"``). ``num_samples`` holds the samples wanted per split
    (Megatron: train = train_iters * global_batch; valid = (train_iters // eval_interval + 1) *
    eval_iters * global_batch; test = eval_iters * global_batch); ``None`` means one epoch.

    A split is ``None`` when its weight in ``split`` is 0, it was asked for 0 samples, or it has
    no documents (a tiny corpus); the training loop then skips it. One prefix gives
    :class:`GPTDataset` objects (:class:`TreeDataset` for tree prefixes, see ``config.data_format``);
    several give :class:`BlendedDataset` objects. An unweighted list of prefixes is blended as Megatron's
    ``BlendedMegatronDatasetBuilder`` blends it: each prefix's split is one epoch, weighted by its samples,
    and the blend has ``min(requested, total)`` samples (sample for sample Megatron's); only where more
    samples are requested than one epoch of everything holds (where Megatron's data would run out) are the
    components extended to further epochs.
    """
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must give (train, valid, test), got {num_samples}")
    prefixes, weights = get_blend_from_list(data_path)
    if weights is not None:
        keep = [i for i, w in enumerate(weights) if w > 0]
        prefixes, weights = [prefixes[i] for i in keep], [weights[i] for i in keep]
    indexed = [_open(p, config) for p in prefixes]
    if config.vocab_size is not None:  # once per .bin, cached with the index cache
        for ds in indexed:
            check_token_ids(ds, config.vocab_size, config.path_to_cache)
    dataset_class = _dataset_class(prefixes, config)
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    out: list[Dataset | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        n = num_samples[s]
        if n is not None and n <= 0:
            out.append(None)
            continue
        parts: list[tuple[str, IndexedDataset, np.ndarray, float]] = []
        for i, (prefix, ds) in enumerate(zip(prefixes, indexed)):
            rng = ranges[i][s]
            if rng is None:
                continue
            docs = np.arange(rng[0], rng[1], dtype=np.int64)
            tokens = int(ds.sequence_lengths[docs].astype(np.int64).sum()) if len(docs) else 0
            if tokens < 2:
                logger.warning("%s: the %s split of --split %s has %d documents (%d tokens); skipped",
                               prefix, name, split, len(docs), tokens)
                continue
            parts.append((prefix, ds, docs, weights[i] if weights is not None else None))
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            prefix, ds, docs, _ = parts[0]
            out.append(dataset_class(ds, prefix, docs, n, name, config))
        elif weights is None:
            out.append(_build_unweighted_blend(parts, n, name, config, dataset_class))
        else:
            out.append(_build_blend(parts, n, name, config, dataset_class))
    return out[0], out[1], out[2]


def _dataset_class(prefixes: Sequence[str], config: GPTDatasetConfig) -> type:
    """GPTDataset, or TreeDataset for tree prefixes (``config.data_format``: tree, or auto with a sidecar)."""
    from megatron_cai.core.datasets.tree_dataset import TreeDataset
    from megatron_cai.core.datasets.tree_format import tree_exists, tree_path

    fmt = getattr(config, "data_format", "plain")
    if config.fim is not None:
        from megatron_cai.core.datasets.fim_dataset import FimGPTDataset

        return FimGPTDataset
    if fmt == "plain":
        return GPTDataset
    has_tree = [tree_exists(p) for p in prefixes]
    if fmt == "tree" and not all(has_tree):
        missing = prefixes[has_tree.index(False)]
        raise IndexedDatasetError(f"--data-format tree: {tree_path(missing)} not found (preprocess the corpus with "
                                  f"tools/preprocess_data.py --tree)")
    if any(has_tree) and not all(has_tree):
        raise IndexedDatasetError(f"--data-path mixes tree prefixes ({prefixes[has_tree.index(True)]}) and plain "
                                  f"ones ({prefixes[has_tree.index(False)]}); blend only one kind, or pass "
                                  f"--data-format plain to read the trees as plain documents")
    return TreeDataset if all(has_tree) else GPTDataset


def _build_unweighted_blend(parts: list[tuple[str, IndexedDataset, np.ndarray, None]], n: int | None, name: str,
                            config: GPTDatasetConfig, dataset_class: type = GPTDataset) -> BlendedDataset:
    """Megatron's unweighted blend: one-epoch components weighted by their lengths, ``min(n, total)`` samples."""
    singles = [dataset_class(ds, prefix, docs, None, name, config) for prefix, ds, docs, _ in parts]
    lengths = [len(d) for d in singles]
    total = sum(lengths)
    if n is None or n <= total:
        return BlendedDataset(singles, [float(x) for x in lengths], total if n is None else n, name,
                              config.path_to_cache)
    logger.warning("%s: %d samples requested from an unweighted --data-path blend of %d samples (one epoch); "
                   "continuing into further epochs (Megatron-LM would run out here)", name, n, total)
    w = np.asarray(lengths, dtype=np.float64) / total
    datasets = [dataset_class(ds, prefix, docs, int(math.ceil(wi * n)), name, config)
                for (prefix, ds, docs, _), wi in zip(parts, w)]
    return BlendedDataset(datasets, w.tolist(), n, name, config.path_to_cache)


def _build_blend(parts: list[tuple[str, IndexedDataset, np.ndarray, float]], n: int | None, name: str,
                 config: GPTDatasetConfig, dataset_class: type = GPTDataset) -> BlendedDataset:
    """Blend the splits in ``parts`` with Megatron's per-dataset sizes (target * (1 + surplus))."""
    w = np.asarray([p[3] for p in parts], dtype=np.float64)
    w = w / w.sum()
    if n is None:  # one epoch of everything, in proportion to the weights
        singles = [dataset_class(ds, prefix, docs, None, name, config) for prefix, ds, docs, _ in parts]
        n = sum(len(d) for d in singles)
    targets = [int(math.ceil(n * wi)) for wi in w]
    size = sum(targets)
    datasets = []
    for (prefix, ds, docs, _), target, wi in zip(parts, targets, w):
        # The greedy interleave never takes more than ceil(w_i * size) samples from dataset i
        # (BlendedDataset re-checks); the surplus follows Megatron.
        surplus = int(math.ceil(target * (1.0 + config.mid_level_dataset_surplus)))
        want = max(int(math.ceil(wi * size)), surplus)
        datasets.append(dataset_class(ds, prefix, docs, want, name, config))
    return BlendedDataset(datasets, w.tolist(), size, name, config.path_to_cache)

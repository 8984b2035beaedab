"""Weighted blend of several datasets, with Megatron-LM's deterministic interleave."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from megatron_cai.core.datasets.utils import description_hash, load_or_build_indices, to_json

logger = logging.getLogger(__name__)


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy "largest error first" interleave (no RNG).

    At step s every dataset i has error ``w_i * max(s, 1) - count_i``; the dataset with the largest
    error (first one on ties) supplies the next sample. Returns ``dataset_index`` (int16) and
    ``dataset_sample_index`` (int64: the running count of the chosen dataset). Pure Python,
    O(size * len(weights)); the result is cached by :class:`BlendedDataset`.
    """
    w = [float(x) for x in weights]
    if len(w) > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended")
    counts = [0] * len(w)
    dataset_index = [0] * size
    sample_index = [0] * size
    rng = range(1, len(w))
    for s in range(size):
        sd = float(s) if s > 1 else 1.0
        best, best_err = 0, w[0] * sd - counts[0]
        for i in rng:
            err = w[i] * sd - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
    return np.asarray(dataset_index, dtype=np.int16), np.asarray(sample_index, dtype=np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Args:
        datasets: the component datasets (each needs ``unique_description`` for the cache key, as
            :class:`GPTDataset` has).
        weights: non-negative weights (normalized here).
        size: number of samples.
        split_name: ``"train"``/``"valid"``/``"test"`` (part of the cache key).
        path_to_cache: cache directory; ``None`` -> ``<first dataset dir>/cache/BlendedDataset_indices``.

    Raises ``ValueError`` when a component is too short for its share of the blend.
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 split_name: str = "train", path_to_cache: str | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset and at least one dataset")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"blend weights must be finite, >= 0 and not all 0: {list(weights)}")
        self.datasets = list(datasets)
        self.weights = (w / w.sum()).tolist()
        self.size = int(size)
        self.split_name = split_name
        self.unique_description = to_json({
            "class": type(self).__name__,
            "datasets": [getattr(d, "unique_description", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": self.size,
            "split": split_name,
        })
        self.unique_description_hash = description_hash(self.unique_description)
        if path_to_cache is None:
            first = getattr(self.datasets[0], "dataset_path", None)
            if first is not None:
                path_to_cache = os.path.join(os.path.dirname(os.path.abspath(first)), "cache",
                                             f"{type(self).__name__}_indices")
        base = f"{self.unique_description_hash}-{type(self).__name__}-{split_name}"
        arrays, self.built_anew_on_cache_miss = load_or_build_indices(
            path_to_cache, base, self.unique_description, ("dataset_index", "dataset_sample_index"),
            self._build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for i, (c, d) in enumerate(zip(counts, self.datasets)):
            if c > len(d):
                raise ValueError(
                    f"blended {split_name} dataset needs {c} samples from component {i} "
                    f"({getattr(d, 'dataset_path', d)}) but it has {len(d)}"
                )

    def _build(self) -> dict[str, np.ndarray]:
        t0 = time.time()
        dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        logger.info("built %s %s indices: %d samples from %d datasets in %.2f s", type(self).__name__,
                    self.split_name, self.size, len(self.datasets), time.time() - t0)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} blended samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

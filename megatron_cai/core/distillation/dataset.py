"""Attach teacher samples to the samples of a GPT dataset, and check that a store lines up with it.

The teacher-sample store (:mod:`.teacher_samples`) is keyed by the *global sample index* of the train
split: the index the pretraining sampler hands to ``dataset[i]``. :class:`TeacherSamplesDataset` wraps the
train dataset and adds, for sample ``i``::

    distill_index   int64   []         i (online distillation draws its counter noise from it)
    distill_ids     int64   [seq, k]   teacher sample ids           (offline: from the store)
    distill_logits  fp16/bf16 [seq, k] teacher logits at those ids
    distill_kappa   fp32    [seq]      (k+1)-th Gumbel key
    distill_lse     fp32    [seq]      logsumexp(teacher logits / tau)

so the data loader, its resume position (``consumed_samples``) and DP slicing are untouched.

Alignment: which tokens sample ``i`` holds is fixed by the corpus (the ``.idx`` file, fingerprinted in the
store's metadata) and by the dataset's three index arrays (built from ``--split``, ``--seq-length``,
``--seed`` and the number of samples the run needs). :func:`sample_order_fingerprint` hashes those arrays;
the dump records it in ``metadata.extra`` and :func:`open_teacher_samples` compares it with the student's
train split, so a store dumped for another split/seed/length/run size is refused with a message.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from .gumbel import ESTIMATORS
from .teacher_samples import TeacherSamples, TeacherSamplesMismatchError

__all__ = ["DISTILL_KEYS", "TeacherSamplesDataset", "open_teacher_samples", "sample_order_fingerprint"]

DISTILL_KEYS = ("distill_ids", "distill_logits", "distill_kappa", "distill_lse")
_STORE_FIELDS = ("ids", "logits", "kappa", "lse")


def sample_order_fingerprint(dataset) -> str:
    """``"sha256:<hex>"`` of a GPTDataset's document/sample/shuffle index arrays (what each sample holds).

    Two datasets over the same ``.idx`` with equal fingerprints give identical tokens for every sample.
    """
    missing = [a for a in ("document_index", "sample_index", "shuffle_index") if not hasattr(dataset, a)]
    if missing:
        raise TeacherSamplesMismatchError(
            f"teacher samples need a single preprocessed --data-path prefix (a GPTDataset); got "
            f"{type(dataset).__name__} without {missing}: blended or mock datasets are not supported")
    h = hashlib.sha256()
    for name in ("document_index", "sample_index", "shuffle_index"):
        arr = np.ascontiguousarray(np.asarray(getattr(dataset, name)).astype("<i8"))
        h.update(f"{name}:{arr.shape}".encode())
        h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()


def open_teacher_samples(path: str, dataset, *, idx_path: str, seq_length: int, vocab_size: int, tau: float,
                         estimator: str, num_samples: int) -> TeacherSamples:
    """Open the store at ``path`` for training on ``dataset`` (the student's train split), or raise.

    Checks: the corpus (``.idx`` fingerprint), sequence length, tokenizer vocabulary, temperature, the
    sample order of the split (see :func:`sample_order_fingerprint`), that the store covers the
    ``num_samples`` samples the run will consume, and that ``estimator`` fits how the ids were drawn
    (priority / self-normalized weights need a Gumbel store; ``topk`` works with either).
    """
    if estimator not in ESTIMATORS:
        raise TeacherSamplesMismatchError(f"--distill-estimator {estimator!r} cannot use stored samples; "
                                          f"expected one of {ESTIMATORS} (full needs --distill-teacher-load)")
    store = TeacherSamples(path, idx_path=idx_path, seq_length=seq_length, vocab_size=vocab_size, tau=tau)
    if store.sampler != "gumbel" and estimator != "topk":
        raise TeacherSamplesMismatchError(
            f"{path}: the store holds deterministic top-k ids (sampler {store.sampler!r}); the {estimator!r} "
            "estimator needs Gumbel samples (dump with --sampler gumbel) or use --distill-estimator topk")
    want = store.metadata.get("extra", {}).get("sample_order_fingerprint")
    have = sample_order_fingerprint(dataset)
    if want is not None and want != have:
        extra = store.metadata.get("extra", {})
        raise TeacherSamplesMismatchError(
            f"{path}: teacher samples do not line up with this run's train split: the store was dumped for "
            f"a dataset with another sample order (dump settings: split {extra.get('split')!r}, seed "
            f"{extra.get('data_seed')!r}, {extra.get('dataset_samples')!r} samples built). Dump with the "
            "student's --data-path, --split, --seq-length, --seed, --train-iters and --global-batch-size")
    if store.num_samples < num_samples:
        raise TeacherSamplesMismatchError(
            f"{path}: the store covers samples [0, {store.num_samples}) but this run consumes {num_samples} "
            "train samples (--train-iters x --global-batch-size); dump at least as many")
    return store


class TeacherSamplesDataset(torch.utils.data.Dataset):
    """``dataset[i]`` plus ``distill_index`` and (with a store) the teacher sample of ``i`` (see module doc)."""

    def __init__(self, dataset: torch.utils.data.Dataset, store: TeacherSamples | None = None) -> None:
        self.dataset = dataset
        self.store = store

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        if name in ("dataset", "store"):  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        idx = int(idx)
        sample = dict(self.dataset[idx])
        sample["distill_index"] = torch.tensor(idx, dtype=torch.int64)
        if self.store is not None:
            if idx >= self.store.num_samples:
                raise IndexError(f"{self.store.path}: no teacher sample for train sample {idx} (the store "
                                 f"covers [0, {self.store.num_samples}))")
            got = self.store.get(idx)
            for key, field in zip(DISTILL_KEYS, _STORE_FIELDS):
                sample[key] = got[field]
        return sample

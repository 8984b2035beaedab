"""Gumbel top-k teacher sampling, sparse-target distillation losses and the teacher-sample store."""
from .dataset import DISTILL_KEYS, TeacherSamplesDataset, open_teacher_samples, sample_order_fingerprint
from .gumbel import (
    ESTIMATORS,
    counter_gumbel,
    estimator_weights,
    gumbel_noise,
    gumbel_topk,
    priority_weights,
    self_normalized_weights,
    topk_select,
    topk_weights,
    vocab_parallel_gumbel_topk,
)
from .kd_loss import full_kd_loss, sparse_kd_loss, vocab_parallel_full_kd_loss, vocab_parallel_sparse_kd_loss
from .teacher_samples import (
    TeacherSamples,
    TeacherSamplesError,
    TeacherSamplesMismatchError,
    TeacherSamplesWriter,
    dataset_fingerprint,
    position_keys,
    shard_seed,
)

__all__ = [
    "DISTILL_KEYS",
    "ESTIMATORS",
    "TeacherSamples",
    "TeacherSamplesError",
    "TeacherSamplesMismatchError",
    "TeacherSamplesDataset",
    "TeacherSamplesWriter",
    "counter_gumbel",
    "dataset_fingerprint",
    "estimator_weights",
    "full_kd_loss",
    "gumbel_noise",
    "gumbel_topk",
    "open_teacher_samples",
    "position_keys",
    "priority_weights",
    "sample_order_fingerprint",
    "self_normalized_weights",
    "shard_seed",
    "sparse_kd_loss",
    "topk_select",
    "topk_weights",
    "vocab_parallel_full_kd_loss",
    "vocab_parallel_gumbel_topk",
    "vocab_parallel_sparse_kd_loss",
]

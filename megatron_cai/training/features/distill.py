"""Knowledge distillation in the training loop: offline (stored teacher samples) and online (a live teacher).

Loss per micro-batch, with masked token means as for the plain LM loss::

    loss = (1 - alpha) * CE + alpha * KD

``CE`` is the usual vocab-parallel cross entropy (logged as ``lm loss``, so curves stay comparable with
plain runs), ``KD`` the distillation loss (logged as ``distill loss``; its cross-entropy form, i.e. the KL
plus the teacher entropy) and ``distill kl`` the matching estimate of KL(teacher || student). The student
always normalises over its full real vocabulary (padded rows are excluded, as in the CE). No ``tau**2``
factor is applied; scale ``alpha`` yourself when distilling at ``tau != 1``.

* **offline** (``--distill-samples PATH``): the train dataset is wrapped in a
  :class:`~megatron_cai.core.distillation.dataset.TeacherSamplesDataset`, so each batch carries the stored
  ids/logits/kappa/lse of its samples; KD is the sparse loss with ``--distill-estimator`` weights.
* **online** (``--distill-teacher-load DIR``): a teacher checkpoint (any TP/PP layout) is loaded on every
  rank of the last pipeline stage, sharded over the student's tensor-parallel group exactly like the
  student's own layers (so its logits are vocab-parallel and line up with the student's shards), and run
  under ``no_grad`` on each micro-batch. ``--distill-estimator full`` uses its whole distribution; the
  other estimators draw ``--distill-k`` ids per position with Gumbel-top-k (``topk``: the k largest) from
  the same counter-based noise as ``tools/dump_teacher_samples.py`` (seed ``--seed``, row key
  ``sample_index * seq_length + position``), so an online run sees the samples an offline dump would
  store, on any TP/PP/DP layout. The teacher must fit the student's TP size (heads divisible by TP).

Validation batches carry no teacher samples: evaluation reports the plain ``lm loss``. Distillation applies
to the train split only, which is what the store is keyed by (its global sample index).
"""
from __future__ import annotations

import functools
import os

import torch

from ...core import parallel_state as ps
from ...core.context_parallel.batch import ContextParallelVisibility
from ...core.distillation import (
    counter_gumbel,
    full_kd_loss,
    gumbel_topk,
    sparse_kd_loss,
    topk_select,
    vocab_parallel_full_kd_loss,
    vocab_parallel_gumbel_topk,
    vocab_parallel_sparse_kd_loss,
)
from ...core.distillation.dataset import DISTILL_KEYS, TeacherSamplesDataset, open_teacher_samples
from ...core.distributed.contracts import ModelChunk
from ...core.models.gpt.config import GPTConfig
from ...core.models.gpt.model import GPTModel
from ...core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ...core.tensor_parallel.utils import shard_tensor
from ..config import DistillConfig

__all__ = ["Distiller", "build_teacher", "setup_distillation"]

_PADDING_LOGIT = -1e9  # student logits of padded vocab rows: exp() underflows to 0, and 0 * it stays finite


# ------------------------------------------------------------------------------------------- teacher
def build_teacher(ck, *, padded_vocab_size: int, device: torch.device | str = "cpu",
                  attention_backend: str | None = None, where: str = "(the teacher)") -> GPTModel:
    """A whole (all layers) GPTModel from a canonical checkpoint, sharded over this process's TP group.

    ``ck`` is a :class:`~megatron_cai.training.checkpoint.CanonicalCheckpoint` (any saved
    layout). Vocabulary rows are re-padded to ``padded_vocab_size``; dropout and training-only terms are
    off; the model is in eval mode with ``requires_grad=False``. The global RNG state is left untouched.
    """
    from ...core.models.gpt.model import WORD_EMBEDDINGS
    from ..checkpoint import OUTPUT_WEIGHT, RankLocalShapeError, check_shapes, fit_vocab_rows

    cfg = GPTConfig.from_dict(ck.config.to_dict())
    cfg.padded_vocab_size = padded_vocab_size
    cfg.sequence_parallel = False
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    cfg.attention_zreg_coeff = cfg.output_zreg_coeff = 0.0
    cfg.attention_backend = attention_backend
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    cfg.recompute_granularity = None
    with torch.random.fork_rng(devices=[]):  # nn.Embedding etc. draw from the global RNG when built
        model = GPTModel(cfg, pre_process=True, post_process=True)  # attaches QAT quantizers (cfg.qat)
    params = dict(model.named_parameters())
    state = {}
    for name in model.state_dict():
        if name not in ck.model:
            continue  # check_shapes names it
        full = ck.model[name]
        if name in (WORD_EMBEDDINGS, OUTPUT_WEIGHT):
            full = fit_vocab_rows(full, padded_vocab_size)
        p = params.get(name)
        if p is not None and getattr(p, "tp_dim", None) is not None and tp > 1:
            full = shard_tensor(full, p.tp_dim, tp_rank, tp, getattr(p, "tp_sections", None))
        state[name] = full
    # some ranks only load a teacher (the last pipeline stage): a rank-local error, no collective
    check_shapes(where, {k: v.shape for k, v in state.items()}, {k: v.shape for k, v in model.state_dict().items()},
                 collective=False, error=RankLocalShapeError)
    model.load_state_dict(state)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_teacher(path: str, student: GPTConfig, device: torch.device, step: int | None = None) -> GPTModel:
    """Load the checkpoint at ``path`` (any TP/PP layout) as an online teacher for ``student``."""
    from ..checkpoint import RankLocalShapeError, load_canonical

    ck = load_canonical(path, step, load_optimizer=False)
    if ck.config.vocab_size != student.vocab_size:  # only the ranks that hold a teacher load it: rank-local
        raise RankLocalShapeError(f"--distill-teacher-load {path}: the teacher's vocabulary has "
                                  f"{ck.config.vocab_size} tokens, the student's {student.vocab_size}: they must "
                                  f"share the tokenizer")
    return build_teacher(ck, padded_vocab_size=student.padded_vocab_size, device=device,
                         attention_backend=student.attention_backend, where=f"--distill-teacher-load {path}")


# -------------------------------------------------------------------------------------------- losses
def _vocab_range(logits: torch.Tensor) -> tuple[int, int]:
    n_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * n_local
    return start, start + n_local


def _mask_padding(logits: torch.Tensor, vocab_size: int, value: float) -> torch.Tensor:
    """Vocab-parallel logits with the columns of padded rows (ids >= vocab_size) set to ``value``."""
    start, end = _vocab_range(logits)
    if end <= vocab_size:
        return logits
    pad = torch.arange(start, end, device=logits.device) >= vocab_size
    return logits.float().masked_fill(pad, value)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor | None = None) -> torch.Tensor:
    return (values.float() * mask).sum() / (mask.sum().clamp(min=1.0) if normalizer is None else normalizer)


def distill_loss_func(loss_mask: torch.Tensor, kd: torch.Tensor, kl: torch.Tensor, alpha: float,
                      ce: torch.Tensor, normalizer: torch.Tensor | None = None):
    """``(1 - alpha) * CE + alpha * KD`` (masked token means) and the logged stats. ``normalizer``: under
    context parallelism the whole sequence's mask total / CP (see pretrain_gpt.loss_func)."""
    mask = loss_mask.float()
    lm = _masked_mean(ce, mask, normalizer)
    kd_mean = _masked_mean(kd, mask, normalizer)
    loss = (1.0 - alpha) * lm + alpha * kd_mean
    return loss, {"lm loss": lm.detach(), "distill loss": kd_mean.detach(),
                  "distill kl": _masked_mean(kl.detach(), mask, normalizer)}


class Distiller:
    """Computes CE + KD for the last pipeline stage (see the module docstring)."""

    def __init__(self, *, alpha: float, tau: float, estimator: str, k: int, seed: int,
                 teacher: GPTModel | None = None) -> None:
        self.alpha, self.tau, self.estimator, self.k, self.seed = alpha, tau, estimator, k, seed
        self.teacher = teacher

    def applies(self, model: ModelChunk, batch: dict) -> bool:
        """True on the last stage for batches of the train split (they carry ``distill_index``)."""
        return model.module.post_process and "distill_index" in batch

    def forward(self, model: ModelChunk, batch: dict, visibility=None):
        """Student forward + CE + KD; returns ``(per-token CE, loss_func)`` for the schedule."""
        cfg = model.module.config
        logits = model(batch["tokens"], batch["position_ids"], visibility=visibility)  # [b, s, V/TP]
        ce = vocab_parallel_cross_entropy(logits, batch["labels"], cfg.vocab_size, cfg.output_zreg_coeff)
        if self.teacher is None:
            sample = tuple(batch[k] for k in DISTILL_KEYS)
            kd, kl = self._sparse(logits, sample, cfg.vocab_size, self.estimator)
        else:
            kd, kl = self._online(logits, batch, visibility, cfg.vocab_size)
        return ce, functools.partial(distill_loss_func, batch["loss_mask"], kd, kl, self.alpha,
                                     normalizer=batch.get("loss_normalizer"))

    def _sparse(self, logits, sample, vocab_size: int, estimator: str):
        ids, tl, kappa, lse = sample
        if ps.get_tensor_model_parallel_world_size() == 1:
            return sparse_kd_loss(logits[..., :vocab_size], ids, tl, kappa, lse, estimator=estimator, tau=self.tau)
        student = _mask_padding(logits, vocab_size, _PADDING_LOGIT)
        return vocab_parallel_sparse_kd_loss(student, ids, tl, kappa, lse, group=ps.get_tensor_model_parallel_group(),
                                             estimator=estimator, tau=self.tau)

    @torch.no_grad()
    def _teacher_sample(self, t_logits, rows, vocab_size: int):
        tp = ps.get_tensor_model_parallel_world_size()
        if tp == 1:
            t = t_logits[..., :vocab_size]
            if self.estimator == "topk":
                return topk_select(t, self.k, tau=self.tau)
            return gumbel_topk(t, self.k, tau=self.tau, gumbel=counter_gumbel(self.seed, rows, vocab_size))
        start, end = _vocab_range(t_logits)
        noise = (torch.zeros(t_logits.shape, device=t_logits.device) if self.estimator == "topk"
                 else counter_gumbel(self.seed, rows, end, vocab_start=start))  # zero noise: plain top-k
        return vocab_parallel_gumbel_topk(t_logits, self.k, group=ps.get_tensor_model_parallel_group(),
                                          tau=self.tau, vocab_size=vocab_size, gumbel=noise)

    def _online(self, logits, batch, visibility, vocab_size: int):
        with torch.no_grad():
            t_logits = self.teacher(batch["tokens"], batch["position_ids"], visibility=visibility)
        tp = ps.get_tensor_model_parallel_world_size()
        if self.estimator == "full":
            if tp == 1:
                return full_kd_loss(logits[..., :vocab_size], t_logits[..., :vocab_size], self.tau)
            return vocab_parallel_full_kd_loss(_mask_padding(logits, vocab_size, _PADDING_LOGIT),
                                               _mask_padding(t_logits, vocab_size, float("-inf")), self.tau,
                                               group=ps.get_tensor_model_parallel_group())
        seq = batch["tokens"].shape[1]
        positions = torch.arange(seq, device=t_logits.device)
        if isinstance(visibility, ContextParallelVisibility):  # this CP rank's tokens of the whole sequence
            seq, positions = visibility.split.seq_length, visibility.local_index
        rows = batch["distill_index"].long().unsqueeze(1) * seq + positions  # the noise of the dump's rows
        sample = self._teacher_sample(t_logits, rows, vocab_size)
        return self._sparse(logits, sample, vocab_size, self.estimator)


# ------------------------------------------------------------------------------------------------ setup
def setup_distillation(config: DistillConfig, model_config: GPTConfig, *, seed: int, num_train_samples: int,
                       device: torch.device, train_ds) -> tuple[Distiller | None, object]:
    """The run's :class:`Distiller` (None without distillation) and the train dataset to use.

    Offline: opens and checks ``--distill-samples`` against the train split and wraps it. Online: loads
    the teacher on the last pipeline stage and wraps the train split to carry sample indices. The caller
    binds the distiller into its forward step explicitly (``Trainer`` passes ``distiller=``).
    """
    if not config.enabled or train_ds is None:
        return None, train_ds
    teacher = None
    if config.samples:
        from ...core.datasets.indexed_dataset import get_idx_path

        prefix = getattr(train_ds, "dataset_path", None)
        if prefix is None:
            raise ValueError("--distill-samples needs a single preprocessed --data-path prefix (not mock or "
                             "blended data)")
        store = open_teacher_samples(
            config.samples, train_ds, idx_path=get_idx_path(prefix), seq_length=model_config.seq_length,
            vocab_size=model_config.vocab_size, tau=config.temperature, estimator=config.estimator,
            num_samples=num_train_samples)
        wrapped = TeacherSamplesDataset(train_ds, store)
    else:
        if not os.path.isdir(config.teacher_load):
            raise FileNotFoundError(f"--distill-teacher-load {config.teacher_load}: no such directory")
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            teacher = load_teacher(config.teacher_load, model_config, device)
        wrapped = TeacherSamplesDataset(train_ds)
    distiller = Distiller(alpha=config.alpha, tau=config.temperature, estimator=config.estimator, k=config.k,
                          seed=seed, teacher=teacher)
    return distiller, wrapped

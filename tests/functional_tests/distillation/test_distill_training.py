"""Distillation in the training loop: the loss against a hand-written reference, alpha = 0 is the plain run,
TP = 2, PP = 2 and CP = 2 match one process (offline and online), online samples = the dump's, mismatches refused."""
import math

import pytest
import torch
from testlib.distill import SEQ, dump_argv, make_teacher, run_dump, train_argv, write_corpus
from testlib.distributed import run_distributed
from testlib.train import train

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_cai.core.distillation import TeacherSamples, TeacherSamplesMismatchError
from megatron_cai.core.distillation.dataset import TeacherSamplesDataset
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.training.arguments import ArgumentError
from megatron_cai.training.features.distill import Distiller

ITERS = 3
KEYS = ("lm loss", "distill loss", "distill kl", "grad norm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    prefix = write_corpus(str(root / "data" / "corpus_text_document"))
    teacher = make_teacher(prefix, str(root / "teacher"))
    stores = {}
    for sampler in ("gumbel", "topk"):
        stores[sampler] = str(root / sampler)
        assert run_dump(dump_argv(teacher, prefix, stores[sampler], ITERS, ["--sampler", sampler])) == 0
    return prefix, teacher, stores


def _run(argv):
    out = train(argv)
    ps.destroy_model_parallel()
    return out["history"]


def _assert_same(got, ref, keys=KEYS, rel=1e-5):
    assert len(got) == len(ref) == ITERS
    for i, (a, b) in enumerate(zip(got, ref)):
        for key in keys:
            # The KL is the KD loss minus the teacher entropy: compare it at the loss's absolute precision.
            tol = pytest.approx(b[key], rel=rel, abs=rel * b["distill loss"] if key == "distill kl" else 0)
            assert a[key] == tol, f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"


class _Chunk(torch.nn.Module):
    """The ``ModelChunk`` members the Distiller uses (``module``, calling it), without data parallelism."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_loss_and_gradient_match_a_reference(setup):
    """(1 - alpha) CE + alpha KD with masked means, the student normalised over its 100 real tokens only."""
    prefix, _, stores = setup
    ps.initialize_model_parallel(1, 1)
    try:
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, padded_vocab_size=104,
                        seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(cfg)
        model.initialize(3)
        train_ds, _, _ = build_train_valid_test_datasets([prefix], "90,10,0", (12, 0, 0),
                                                         GPTDatasetConfig(sequence_length=SEQ, random_seed=11))
        ds = TeacherSamplesDataset(train_ds, TeacherSamples(stores["gumbel"]))
        items = [ds[i] for i in (5, 2)]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch["loss_mask"][0, :5] = 0.0
        alpha = 0.3
        ce, loss_func = Distiller(alpha=alpha, tau=1.0, estimator="priority", k=8, seed=11).forward(_Chunk(model),
                                                                                                    batch)
        loss, stats = loss_func(ce)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()

        z = model(batch["tokens"], batch["position_ids"])[..., :100].double()
        log_q = z - torch.logsumexp(z, -1, keepdim=True)
        ce_ref = -torch.gather(log_q, -1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        s = batch["distill_logits"].double()
        w = torch.exp(s - batch["distill_lse"].double().unsqueeze(-1)) / (
            1 - torch.exp(-torch.exp(s - batch["distill_kappa"].double().unsqueeze(-1))))
        kd_ref = -(w * torch.gather(log_q, -1, batch["distill_ids"])).sum(-1)
        kl_ref = (w * (s - batch["distill_lse"].double().unsqueeze(-1))).sum(-1) + kd_ref
        m = batch["loss_mask"].double()
        ref = {"lm loss": (ce_ref * m).sum() / m.sum(), "distill loss": (kd_ref * m).sum() / m.sum(),
               "distill kl": (kl_ref * m).sum() / m.sum()}
        total = (1 - alpha) * ref["lm loss"] + alpha * ref["distill loss"]
        total.backward()
        for k, v in ref.items():
            assert stats[k].item() == pytest.approx(v.item(), rel=1e-5)
        assert loss.item() == pytest.approx(total.item(), rel=1e-5)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad.float(), rtol=1e-4, atol=1e-6)
        assert torch.all(batch["distill_ids"] < 100) and stats["distill kl"] > 0
    finally:
        ps.destroy_model_parallel()


def test_alpha_zero_reproduces_the_plain_run(setup):
    prefix, teacher, stores = setup
    plain = _run(train_argv(prefix, ITERS))
    offline = _run(train_argv(prefix, ITERS, ["--distill-samples", stores["gumbel"], "--distill-alpha", "0"]))
    online = _run(train_argv(prefix, ITERS, ["--distill-teacher-load", teacher, "--distill-alpha", "0",
                                             "--distill-estimator", "full"]))
    for got in (offline, online):
        assert [h["lm loss"] for h in got] == [h["lm loss"] for h in plain]  # bit for bit
        assert [h["grad norm"] for h in got] == [h["grad norm"] for h in plain]
        assert all(h["distill loss"] > 0 for h in got)
    # the exact (full-distribution) KL is positive; the sampled estimate is unbiased but may dip below 0
    assert all(h["distill kl"] > 0 for h in online)
    assert all(abs(h["distill kl"]) < 1.0 for h in offline)
    assert "distill loss" not in plain[0]


def test_online_gumbel_draws_the_dumped_samples(setup):
    """Online sampling uses the dump's counter noise: the same ids, so the same losses up to fp16 logits."""
    prefix, teacher, stores = setup
    flags = ["--distill-alpha", "0.7", "--distill-k", "8"]
    offline = _run(train_argv(prefix, ITERS, ["--distill-samples", stores["gumbel"], *flags]))
    online = _run(train_argv(prefix, ITERS, ["--distill-teacher-load", teacher, *flags]))
    _assert_same(online, offline, rel=2e-3)
    assert offline[0]["distill kl"] != online[0]["distill kl"]  # fp16 storage is visible, not silently shared


def _parallel_worker(rank, world_size, runs):
    out = []
    for argv in runs:
        result = train(argv, world_size)
        ps.destroy_model_parallel()
        out.append(result)
    return out


def test_tp2_pp2_and_cp2_match_one_process(setup):
    prefix, teacher, stores = setup
    modes = {"offline-priority": ["--distill-samples", stores["gumbel"], "--distill-alpha", "0.5"],
             "offline-topk": ["--distill-samples", stores["topk"], "--distill-estimator", "topk",
                              "--distill-alpha", "0.5"],
             "online-gumbel": ["--distill-teacher-load", teacher, "--distill-alpha", "0.5", "--distill-k", "8"],
             "online-full": ["--distill-teacher-load", teacher, "--distill-estimator", "full", "--distill-alpha", "1"]}
    layouts = {"tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
               "cp2": ["--context-parallel-size", "2"]}  # CP: teacher samples split like the tokens
    runs = [(mode, layout) for mode in modes for layout in layouts if (mode, layout) != ("offline-topk", "pp2")]
    results = run_distributed(_parallel_worker, 2, ([train_argv(prefix, ITERS, modes[m] + layouts[lay])
                                                     for m, lay in runs],))
    refs = {mode: _run(train_argv(prefix, ITERS, flags)) for mode, flags in modes.items()}
    for i, (mode, _) in enumerate(runs):
        got = [r[i] for r in results if r[i]["last_stage"]][-1]["history"]
        _assert_same(got, refs[mode])
        assert all(math.isfinite(h["distill kl"]) for h in got)


@pytest.mark.parametrize("flags,error,match", [
    (["--seed", "12"], TeacherSamplesMismatchError, "do not line up"),
    (["--split", "80,20,0"], TeacherSamplesMismatchError, "do not line up"),
    (["--seq-length", "8"], TeacherSamplesMismatchError, "seq_length is 16 in the store but 8"),
    (["--train-iters", str(ITERS + 1)], TeacherSamplesMismatchError, "covers samples \\[0, 12\\) but this run"),
    (["--distill-temperature", "2"], TeacherSamplesMismatchError, "tau is 1.0 in the store but 2.0"),
    (["--vocab-size", "120"], TeacherSamplesMismatchError, "vocab_size is 100 in the store but 121"),
    (["--distill-estimator", "full"], ArgumentError, "full needs the whole teacher distribution"),
    (["--distill-alpha", "1.5"], ArgumentError, "--distill-alpha 1.5: out of range"),
])
def test_training_refuses_a_store_that_does_not_fit(setup, flags, error, match):
    prefix, _, stores = setup
    with pytest.raises(error, match=match):
        _run(train_argv(prefix, ITERS, ["--distill-samples", stores["gumbel"], *flags]))
    ps.destroy_model_parallel()


def test_topk_store_needs_the_topk_estimator(setup):
    prefix, _, stores = setup
    with pytest.raises(TeacherSamplesMismatchError, match="deterministic top-k ids"):
        _run(train_argv(prefix, ITERS, ["--distill-samples", stores["topk"], "--distill-estimator", "priority"]))
    ps.destroy_model_parallel()

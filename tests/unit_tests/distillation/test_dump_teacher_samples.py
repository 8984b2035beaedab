"""tools/dump_teacher_samples.py: contents vs an independent teacher forward, reproducibility, resume, errors."""
import os

import pytest
import torch
from testlib.distill import SEQ, dump_argv, make_teacher, run_dump, write_corpus
from testlib.distill import dump_tool as dts

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_cai.core.distillation import TeacherSamples, counter_gumbel
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.training.checkpoint import reshard_checkpoint

ITERS = 4  # the student run the dumps are for: 4 iterations x 4 samples = 16 samples = shards of 5, 5, 5, 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    prefix = write_corpus(str(root / "data" / "corpus_text_document"))
    teacher = make_teacher(prefix, str(root / "teacher"))
    full = str(root / "full")
    assert run_dump(dump_argv(teacher, prefix, full, ITERS)) == 0
    return root, prefix, teacher, full


def _shards(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.startswith("shard_")}


def _reference_logits(teacher, prefix):
    """Teacher logits [16, SEQ, vocab] of the student's train samples, computed without the tool's code."""
    payload = torch.load(os.path.join(teacher, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"),
                         map_location="cpu", weights_only=False)
    cfg = GPTConfig.from_dict(payload["model_config"])
    ps.initialize_model_parallel(1, 1)
    try:
        model = GPTModel(cfg)
        model.load_state_dict(payload["model"]["model0"])
        model.eval()
        train, _, _ = build_train_valid_test_datasets([prefix], "90,10,0", (16, 0, 0),
                                                      GPTDatasetConfig(sequence_length=SEQ, random_seed=11))
        tokens = torch.stack([train[i]["tokens"] for i in range(16)])
        with torch.no_grad():
            logits = model(tokens, torch.arange(SEQ).expand(16, SEQ))
    finally:
        ps.destroy_model_parallel()
    assert logits.shape[-1] == cfg.padded_vocab_size > cfg.vocab_size == 100
    return logits[..., : cfg.vocab_size].double()


@pytest.mark.parametrize("sampler", ["gumbel", "topk"])
def test_store_holds_the_teachers_samples_of_each_train_sample(setup, tmp_path, sampler):
    _, prefix, teacher, _ = setup
    out = str(tmp_path / sampler)
    assert run_dump(dump_argv(teacher, prefix, out, ITERS, ["--temperature", "1.5", "--sampler", sampler])) == 0
    got = TeacherSamples(out).get_batch(range(16))
    logits = _reference_logits(teacher, prefix)
    s = logits / 1.5
    rows = torch.arange(16).unsqueeze(1) * SEQ + torch.arange(SEQ)
    keys = s + (counter_gumbel(11, rows, 100).double() if sampler == "gumbel" else 0.0)
    order = torch.argsort(keys, dim=-1, descending=True)
    assert torch.equal(got["ids"], order[..., :8])  # never a padded column (ids >= 100)
    torch.testing.assert_close(got["logits"].double(), torch.gather(logits, -1, order[..., :8]), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got["kappa"].double(), torch.gather(keys, -1, order[..., 8:9]).squeeze(-1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["lse"].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_dump_is_reproducible_and_resumes_after_interruption(setup, tmp_path, monkeypatch, capsys):
    _, prefix, teacher, full = setup
    reference = _shards(full)
    assert len(reference) == 4
    part = str(tmp_path / "part")
    args = dts.build_parser().parse_args(dump_argv(teacher, prefix, part, ITERS))
    real_write, calls = dts.TeacherSamplesWriter.write_shard, []

    def interrupted_write(self, shard, *tensors):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while computing the third shard
        calls.append(shard)
        real_write(self, shard, *tensors)

    monkeypatch.setattr(dts.TeacherSamplesWriter, "write_shard", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        dts.dump(args)
    monkeypatch.setattr(dts.TeacherSamplesWriter, "write_shard", real_write)
    assert sorted(_shards(part)) == ["shard_00000.bin", "shard_00001.bin"]
    assert dts.dump(args) == [2, 3]  # the finished shards are skipped
    assert _shards(part) == reference  # byte-identical to an uninterrupted dump from the same seed
    os.remove(os.path.join(part, "shard_00001.bin"))
    with open(os.path.join(part, "shard_00003.bin"), "r+b") as f:  # a torn write under the final name
        f.truncate(100)
    assert dts.dump(args) == [1, 3]
    assert _shards(part) == reference
    assert dts.dump(args) == []
    capsys.readouterr()
    # Split over two processes (RANK/WORLD_SIZE, as under torchrun): each takes every other pending shard.
    split = str(tmp_path / "split")
    args = dts.build_parser().parse_args(dump_argv(teacher, prefix, split, ITERS))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert dts.dump(args) == [1, 3]
    monkeypatch.setenv("RANK", "0")
    assert dts.dump(args) == [0, 2]
    assert _shards(split) == reference
    # Another seed draws other samples.
    other = str(tmp_path / "other")
    assert run_dump(dump_argv(teacher, prefix, other, ITERS, ["--seed", "12"])) == 0
    assert _shards(other)["shard_00000.bin"] != reference["shard_00000.bin"]


def test_teacher_saved_with_tp2_pp2_gives_the_same_samples(setup, tmp_path):
    _, prefix, teacher, full = setup
    resharded = str(tmp_path / "tp2pp2")
    reshard_checkpoint(teacher, resharded, tp=2, pp=2, log=lambda *a: None)
    assert os.path.isdir(os.path.join(resharded, "iter_0000004", "mp_rank_01_001"))
    out = str(tmp_path / "out")
    assert run_dump(dump_argv(resharded, prefix, out, ITERS)) == 0
    a, b = TeacherSamples(full).get_batch(range(16)), TeacherSamples(out).get_batch(range(16))
    assert torch.equal(a["ids"], b["ids"])
    torch.testing.assert_close(a["logits"], b["logits"], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(a["lse"], b["lse"])


def _error(argv, capsys) -> str:
    capsys.readouterr()
    assert run_dump(argv) == 2
    return capsys.readouterr().err


def test_mismatch_errors(setup, tmp_path, capsys):
    root, prefix, teacher, full = setup
    err = _error(dump_argv(teacher, prefix, full, ITERS, ["--k", "4"]), capsys)
    assert "does not match this dump" in err and "k: store has 8, requested 4" in err
    err = _error(dump_argv(teacher, prefix, full, ITERS, ["--split", "80,20,0"]), capsys)
    assert "another sample order" in err
    err = _error(dump_argv(teacher, prefix, full, ITERS * 2), capsys)
    assert "num_samples" in err  # a store for another run size is not mixed into this one
    err = _error(dump_argv(teacher, prefix, str(tmp_path / "a"), ITERS, ["--vocab-size", "50"]), capsys)
    assert "tokenizer has 51 tokens but the teacher" in err and "100" in err
    other = write_corpus(str(tmp_path / "big" / "corpus_text_document"), vocab=400)
    err = _error(dump_argv(teacher, other, str(tmp_path / "b"), ITERS), capsys)
    # the dataset builder's vocabulary check (once per .bin) names the file, document and id first
    assert "corpus_text_document.bin: document" in err and "outside the vocabulary of 100 ids" in err
    err = _error(dump_argv(str(tmp_path / "nothing"), prefix, str(tmp_path / "c"), ITERS), capsys)
    assert "--load" in err
    err = _error(dump_argv(teacher, prefix, str(tmp_path / "d"), ITERS, ["--k", "101"]), capsys)
    assert "exceeds the teacher's vocabulary" in err

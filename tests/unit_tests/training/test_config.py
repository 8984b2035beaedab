"""TrainConfig: built once from the flags by a pure function, passed explicitly, saved and compared on resume."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
from testlib import TESTS
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL

import pretrain_gpt
from megatron_cai.core.distributed.config import DDPConfig, SquinchConfig
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.quantization.qat_config import QATConfig
from megatron_cai.training import checkpoint
from megatron_cai.training.arguments import (
    ArgumentError,
    build_config,
    parse_args,
    parse_config,
    rebuild_for_world_size,
)
from megatron_cai.training.config import TrainConfig, config_diff, flatten, format_config
from megatron_cai.training.training import Trainer

FIXTURE = os.path.join(TESTS, "fixtures", "ckpt_main_db88585")
# The flags the fixture was saved with (see tests/fixtures/README.md), minus the length and --save.
FIXTURE_FLAGS = ["--squared-relu",
                 "--mock-data", "--vocab-size", "60", "--make-vocab-size-divisible-by", "8", "--num-layers", "2",
                 "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                 "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr",
                 "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters",
                 "0", "--log-interval", "1", "--seed", "5", "--qat", "int8", "--qat-clamp", "static",
                 # the defaults of main at db88585, when the fixture was saved (Megatron-LM's differ since)
                 "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]
FLAGS = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--train-samples", "20", "--lr-warmup-fraction",
                      "0.25", "--squinch", "--no-squinch-error-feedback", "--qat", "fp8", "--qat-clamp-alpha", "16",
                      "--attention-zreg-coeff", "0.1", "--recompute-granularity", "full", "--data-path", "a", "b"]


def test_building_twice_from_the_same_flags_gives_equal_configs_and_leaves_the_flags_alone():
    args = parse_args(FLAGS)
    before = copy.deepcopy(vars(args))
    first, second = build_config(args, 4), build_config(args, 4)
    assert vars(args) == before  # pure: the Namespace is not mutated
    assert first == second and first is not second
    assert first.model is not second.model
    assert rebuild_for_world_size(first, 4) == first
    assert build_config(parse_args(FLAGS), 4) == first  # and from a fresh parse


def test_flags_land_in_their_component_configs():
    cfg = build_config(parse_args(FLAGS), 4)
    # derived from the world size: DP 4, global batch = micro x DP, length from samples, warmup fraction
    assert (cfg.parallel.data_parallel_size, cfg.training.global_batch_size, cfg.training.num_microbatches) == (4, 8, 1)
    assert cfg.training.train_iters == 20 // 8 == 2  # Megatron floors (update_train_iters)
    # the schedule counts samples, as Megatron's: decay over --train-samples, warmup a fraction of it
    assert (cfg.scheduler.lr_warmup_samples, cfg.scheduler.lr_decay_samples) == (0.25 * 20, 20)
    assert cfg.ddp == DDPConfig(reducer="squinch", squinch=SquinchConfig(error_feedback=False))
    assert cfg.model.qat == QATConfig(fmt="fp8", alpha=16.0, fp8_format="hybrid")
    assert cfg.model.recompute_granularity == "full"
    assert (cfg.model.attention_zreg_coeff, cfg.model.attention_zreg_scale) == (0.1, 1.0)
    assert cfg.model.padded_vocab_size == 104  # 100 rounded up to a multiple of 8
    assert cfg.data.data_path == ["a", "b"]
    two = build_config(parse_args(FLAGS + ["--global-batch-size", "8"]), 2)  # 2 micro-batches per step
    assert (two.training.num_microbatches, two.model.attention_zreg_scale) == (2, 0.5)


def test_every_flag_is_recorded_and_the_listing_shows_every_field():
    args = parse_args(FLAGS)
    cfg = build_config(args, 1)
    assert cfg.flags == vars(args)
    listing = format_config(cfg)
    for name, value in flatten(cfg.to_dict()).items():
        if name != "flags":
            assert f"  {name} " in listing and str(value) in listing
    json.dumps(cfg.to_dict())  # the saved form is JSON


@pytest.mark.parametrize("extra,needle", [
    (["--squinch-hierarchical"], "--squinch-hierarchical needs --squinch"),
    (["--distill-alpha", "2", "--distill-teacher-load", "t"], "--distill-alpha"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    (["--train-iters", "3"], "exactly one of --train-iters and --train-samples"),
])
def test_bad_flags_fail_with_one_message_naming_the_flag(extra, needle):
    argv = [a for a in FLAGS if a != "--squinch"] if extra[0] == "--squinch-hierarchical" else FLAGS
    with pytest.raises(ArgumentError, match=needle):
        build_config(parse_args(argv + extra), 1)


def _train_samples_worker(rank, world_size, argv):
    guessed = pretrain_gpt.build_run(argv, world_size=1)[0]  # a first guess of one rank
    config, tokenizer = pretrain_gpt.build_run(argv)  # the launcher's world size
    trainer = Trainer(guessed, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    state = trainer.train()
    return {"guessed": guessed.training.train_iters, "built": config.training, "used": trainer.config.training,
            "dp": trainer.config.parallel.data_parallel_size, "iterations": state.iteration,
            "consumed": state.consumed_train_samples, "equal": trainer.config == config}


def test_train_samples_with_two_processes_and_a_world_size_that_differs_from_the_guess():
    argv = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--train-samples", "11", "--log-interval", "100",
                         "--eval-interval", "0", "--eval-iters", "0", "--no-exit-signal-handler"]
    results = run_distributed(_train_samples_worker, 2, (argv,))
    for r in results:
        assert r["guessed"] == 11 // 2  # a world of one: global batch 2 (whole batches, as Megatron)
        assert r["dp"] == 2 and r["used"].global_batch_size == 4  # rebuilt for two ranks: global batch 4
        assert r["used"].train_iters == 11 // 4 == 2 and r["used"] == r["built"] and r["equal"]
        assert r["iterations"] == 2 and r["consumed"] == 8


# ------------------------------------------------------------------------------------ checkpoints
def _trainer(argv):
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    return Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)


def test_the_config_is_saved_and_compared_field_by_field_on_resume(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    base = FIXTURE_FLAGS + ["--train-iters", "2", "--no-exit-signal-handler"]
    _trainer(base + ["--save", save]).train()
    meta = checkpoint.read_metadata(save, 2)
    config = pretrain_gpt.build_run(base + ["--save", save], world_size=1)[0]
    assert meta["train_config"] == json.loads(json.dumps({k: v for k, v in config.to_dict().items() if k != "flags"}))
    assert GPTConfig.from_dict(meta["model_config"]) == config.model
    capsys.readouterr()
    _trainer(base + ["--load", save, "--lr", "5e-4", "--train-iters", "3"])
    out = capsys.readouterr().out
    assert "configuration differs from checkpoint" in out
    for line in ("optimizer.lr: 0.001 (checkpoint) -> 0.0005", "scheduler.lr: 0.001 (checkpoint) -> 0.0005",
                 "training.train_iters: 2 (checkpoint) -> 3", "scheduler.lr_decay_samples: 4 (checkpoint) -> 6"):
        assert line in out


def test_config_diff_lists_changed_added_and_removed_fields():
    saved = {"model": {"a": 1, "qat": {"fmt": "none"}}, "data": {"path": ["x"]}, "flags": {"z": 1}}
    now = {"model": {"a": 2, "qat": {"fmt": "none", "new": 0}}, "data": {"path": ("x",)}, "flags": {"z": 2}}
    assert config_diff(saved, now) == [("model.a", 1, 2), ("model.qat.new", "<absent>", 0)]


def _copy_fixture(tmp_path) -> str:
    root = str(tmp_path / "old")
    shutil.copytree(FIXTURE, root)
    return root


def test_a_checkpoint_saved_before_the_typed_config_loads_and_resumes(tmp_path, capsys):
    root = _copy_fixture(tmp_path)
    payload = torch.load(os.path.join(root, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    trainer = _trainer(FIXTURE_FLAGS + ["--train-iters", "3", "--load", root, "--no-exit-signal-handler"])
    assert "predates saved training configurations" in capsys.readouterr().out
    assert trainer.state.iteration == 2 and trainer.state.consumed_train_samples == 4
    loaded = trainer.model[0].module.state_dict()
    saved = payload["model"]["model0"]
    assert set(saved) == set(loaded)  # the static QAT clamps came back too (buffers of the typed QATConfig)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    assert any(k.endswith("input_static_c") and torch.isfinite(v) for k, v in loaded.items())
    old = GPTConfig.from_dict(json.load(open(os.path.join(root, "iter_0000002", "metadata.json")))["model_config"])
    assert old.qat == QATConfig(fmt="int8", clamp="static", fp8_format="hybrid") == trainer.config.model.qat
    state = trainer.train()
    assert state.iteration == 3 and math.isfinite(state.extra["history"][-1]["lm loss"])


def test_an_incompatible_old_checkpoint_is_refused_naming_the_difference(tmp_path):
    root = _copy_fixture(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"hidden_size: 16 \(checkpoint\) vs 32 \(this run\)"):
        _trainer([a if a != "16" else "32" for a in FIXTURE_FLAGS] + ["--train-iters", "3", "--load", root])
    meta_path = os.path.join(root, "iter_0000002", "metadata.json")
    meta = json.load(open(meta_path))
    meta["checkpoint_version"] = 7
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint_version 7.*up to 1"):
        _trainer(FIXTURE_FLAGS + ["--train-iters", "3", "--load", root])


def test_component_configs_are_dataclasses_composed_into_train_config():
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    assert list(fields) == ["model", "parallel", "training", "ddp", "optimizer", "scheduler", "data", "tokenizer",
                            "checkpoint", "logging", "distill", "diloco", "flags"]
    cfg = parse_config(FLAGS, world_size=1)
    for name in fields:
        if name != "flags":
            assert dataclasses.is_dataclass(getattr(cfg, name)), name


@pytest.mark.parametrize("granularity,forwards", [(None, 1), ("full", 2)])
def test_recompute_granularity_is_a_model_config_field(granularity, forwards, monkeypatch):
    """--recompute-granularity full reaches the block through GPTConfig: each layer's forward runs again
    in backward; gradients are unchanged."""
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.core.transformer.block import TransformerLayer

    calls = []
    forward = TransformerLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(id(self))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerLayer, "forward", counted)

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    grads = []
    for recompute in (None, granularity):
        cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8,
                        hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity=recompute)
        model = GPTModel(cfg)
        model.initialize(3)
        calls.clear()
        tokens = torch.arange(16).view(2, 8) % 32
        model(tokens, torch.arange(8).expand(2, 8), labels=tokens).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(calls) == forwards * cfg.num_layers
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_seq_length_may_not_exceed_max_position_embeddings():
    """Megatron's start-up rule, for every position embedding type; equal is fine."""
    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--max-position-embeddings", "32"]
    for kind in ("rope", "learned_absolute"):
        assert parse_config(base + ["--seq-length", "32", "--position-embedding-type", kind], world_size=1)
        with pytest.raises(ArgumentError, match="--seq-length 64 is larger than --max-position-embeddings 32; raise"):
            parse_config(base + ["--seq-length", "64", "--position-embedding-type", kind], world_size=1)

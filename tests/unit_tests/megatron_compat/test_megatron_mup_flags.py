"""--use-mup's flags (megatron-core 0.19.2's names and defaults): what they build (model, optimizer and scheduler
configs), the start-up report for bad values and unsupported combinations, and the conversions (a MuP model's
checkpoint config, Megatron-LM args both ways, Hugging Face export refused). The numerics are checked against
megatron-core in tests/unit_tests/model/test_mup.py."""
from __future__ import annotations

import pytest

from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.mup import MupConfig
from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--seq-length", "16",
        "--max-position-embeddings", "16"]


def test_flags_build_the_model_optimizer_and_scheduler_configs():
    cfg = parse_config(BASE + ["--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "2.5",
                               "--mup-base-head-dim", "8", "--mup-attn-scale-power", "0.5"], world_size=1)
    assert cfg.model.mup == MupConfig(True, 16, 2.5, 1.0, 8.0, 0.5)
    assert cfg.optimizer.mup_width_mult == 4.0 and cfg.scheduler.mup_lr_mult == 0.25
    assert cfg.model.mup.logit_mult(64) == 0.25 and cfg.model.mup.softmax_scale(16) == pytest.approx(8 ** 0.5 / 4)
    sgd = parse_config(BASE + ["--use-mup", "--mup-base-hidden-size", "16", "--optimizer", "sgd"], world_size=1)
    assert sgd.scheduler.mup_lr_mult == 4.0  # SGD: the vector-like parameters' rate x m
    off = parse_config(BASE + ["--mup-base-hidden-size", "16", "--mup-width-mult", "3"], world_size=1)
    assert not off.model.mup.enabled and off.optimizer.mup_width_mult == 1.0 and off.scheduler.mup_lr_mult == 1.0
    assert off.model.mup.q_scale(16) == 1.0 and off.model.mup.logit_mult(64) == 1.0


@pytest.mark.parametrize("extra, message", [
    (["--mup-base-hidden-size", "0"], "--mup-base-hidden-size 0: out of range, must be finite and >= 1"),
    (["--mup-base-head-dim", "-1"], "--mup-base-head-dim -1.0: out of range, must be finite and > 0"),
    (["--num-experts", "4"], "--use-mup with --num-experts"),
    (["--multi-latent-attention", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8"],
     "--use-mup with --multi-latent-attention"),
])
def test_bad_values_and_unsupported_combinations_are_reported(extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_config(BASE + ["--use-mup"] + extra, world_size=1)


def test_conversions_carry_or_refuse_mup():
    from megatron_cai.interop.hf import ARCHITECTURES, unsupported_reasons
    from megatron_cai.interop.megatron import config_from_megatron_args, megatron_args

    mup = MupConfig(True, 16, 1.5, 0.5, 8.0, 0.75)
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, mup=mup)
    assert GPTConfig.from_dict(config.to_dict()).mup == mup  # as a checkpoint saves and reads it
    assert config.architecture_diff(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64))
    assert all(any("--use-mup" in why for why in unsupported_reasons(config, arch)) for arch in ARCHITECTURES)
    args = megatron_args(config, tp=1, pp=1, padded_vocab_size=64, divisible=1, iteration=0, counters={})
    assert config_from_megatron_args(args).mup == mup

"""--apply-wd-to-qk-layernorm (and --no-weight-decay-cond-type apply_wd_to_qk_layernorm): the query / key
layernorms' parameters decay, other 1-D parameters do not, as megatron-core's get_standard_config_overrides
decides; one AdamW step differs from the step without the flag by exactly lr x wd x p on those parameters."""
from __future__ import annotations

import contextlib
import io
import typing

import pytest
import torch
from testlib.train import TINY_MODEL

import pretrain_gpt
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.optimizer.config import applies_weight_decay
from megatron_cai.training.training import Trainer

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
mopt = pytest.importorskip("megatron.core.optimizer")

RUN = [*TINY_MODEL, "--mock-data", "--train-iters", "1", "--qk-layernorm", "--normalization", "LayerNorm",
       "--lr", "0.01", "--weight-decay", "0.1", "--lr-decay-style", "constant", "--micro-batch-size", "2",
       "--clip-grad", "0", "--seed", "5"]


@pytest.mark.parametrize("flag", [False, True])
def test_decisions_are_megatron_cores(flag):
    from megatron_cai.training.arguments import parse_config

    config = parse_config(RUN + ["--add-qkv-bias"], world_size=1)
    model = GPTModel(config.model)
    overrides = mopt.get_standard_config_overrides(mopt.OptimizerConfig(apply_wd_to_qk_layernorm=flag))
    (key, override), = [(k, v) for k, v in overrides.items() if v.get("wd_mult") == 0.0]
    seen_qk = False
    for name, p in model.named_parameters():
        no_wd = key.matches(p, name)  # megatron-core's own matching of its no-weight-decay key
        assert applies_weight_decay(name, p.dim() > 1, flag) == (not no_wd), name
        seen_qk |= "q_layernorm." in name
    assert seen_qk


def _one_step(extra: list[str]) -> tuple[dict, dict]:
    config, tokenizer = pretrain_gpt.build_run(RUN + extra, world_size=1)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return before, {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}


@pytest.mark.parametrize("flag", [["--apply-wd-to-qk-layernorm"],
                                  ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"]])
def test_one_step_decays_exactly_the_qk_layernorms(flag):
    p0, plain = _one_step([])
    _, decayed = _one_step(flag)
    qk = [n for n in p0 if "q_layernorm." in n or "k_layernorm." in n]
    assert len(qk) == 4 * 4  # 4 layers x q / k x weight / bias
    for name in p0:
        if name in qk:  # AdamW: p <- p (1 - lr wd) - lr u, the same u in both runs (1 ulp at 1)
            torch.testing.assert_close(plain[name] - decayed[name], 0.01 * 0.1 * p0[name], atol=1.2e-7, rtol=0)
        else:
            assert torch.equal(plain[name], decayed[name]), name
    assert any(p0[n].abs().sum() > 0 for n in qk)  # the layernorm weights (ones) moved by lr wd

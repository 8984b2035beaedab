"""--overlap-param-gather-with-optimizer-step, --num-distributed-optimizer-instances and --fp8-recipe: mapped onto
what runs here (one start-up line each), with Megatron-LM's rules; the tensorwise recipe is per-tensor current
scaling, checked against the hand-computed FP8 cast."""

from __future__ import annotations

import pytest
import torch

from megatron_cai.core.quantization.fake_quant import fake_quant
from megatron_cai.training.arguments import ArgumentError, parse_config

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--seq-length", "32", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "1"]
OVERLAP = ["--overlap-param-gather-with-optimizer-step"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
               "--global-batch-size", "4"]


def _notes(config, flag):
    return [n for n in config.logging.megatron_notes if flag in n]


def test_overlap_with_optimizer_step_is_mapped():
    argv = BASE + INTERLEAVED + ["--use-distributed-optimizer", "--overlap-param-gather"] + OVERLAP
    config = parse_config(argv, world_size=4)
    assert len(_notes(config, OVERLAP[0])) == 1


@pytest.mark.parametrize("drop,needs", [
    ("--use-distributed-optimizer", "--use-distributed-optimizer"),
    ("--overlap-param-gather", "--overlap-param-gather"),
    ("--num-layers-per-virtual-pipeline-stage", "an interleaved pipeline"),
])
def test_overlap_with_optimizer_step_needs_megatrons_prerequisites(drop, needs):
    argv = BASE + INTERLEAVED + ["--use-distributed-optimizer", "--overlap-param-gather"] + OVERLAP
    if drop == "--num-layers-per-virtual-pipeline-stage":
        argv = argv[: argv.index(drop)] + argv[argv.index(drop) + 2:]
    else:
        argv.remove(drop)
    with pytest.raises(ArgumentError) as err:
        parse_config(argv, world_size=4)
    assert f"--overlap-param-gather-with-optimizer-step needs {needs}" in str(err.value)


def test_distributed_optimizer_instances_are_mapped():
    argv = BASE + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    config = parse_config(argv, world_size=4)
    assert len(_notes(config, "--num-distributed-optimizer-instances 2")) == 1
    one = parse_config(BASE + ["--use-distributed-optimizer"], world_size=4)
    assert config.optimizer == one.optimizer and config.ddp == one.ddp  # one instance runs either way


@pytest.mark.parametrize("extra,world,message", [
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"], 4,
     "--num-distributed-optimizer-instances 3 does not divide the data-parallel x context-parallel size 4"),
    (["--num-distributed-optimizer-instances", "2"], 2,
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer"),
])
def test_distributed_optimizer_instances_rules(extra, world, message):
    with pytest.raises(ArgumentError) as err:
        parse_config(BASE + extra, world_size=world)
    assert message in str(err.value)


def test_fp8_tensorwise_is_per_tensor_current_scaling():
    config = parse_config(BASE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], world_size=1)
    qat = config.model.qat
    assert (qat.fmt, qat.clamp, qat.granularity, qat.weight_clamp, qat.weight_granularity) == \
        ("fp8", "absmax", "tensor", "absmax", "tensor")
    assert len(_notes(config, "--fp8-recipe tensorwise")) == 1
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    scale = 448.0 / x.abs().max()  # Transformer Engine's current scaling: the E4M3 maximum over this tensor's amax
    expected = (x * scale).to(torch.float8_e4m3fn).float() / scale
    got = fake_quant(x, "fp8_e4m3", clamp=qat.clamp, granularity=qat.granularity)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    delayed = parse_config(BASE + ["--fp8-format", "hybrid"], world_size=1).model.qat
    assert (delayed.clamp, delayed.weight_granularity) == ("rms", "row")  # the default recipe keeps the QAT rules


@pytest.mark.parametrize("argv,message", [
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise needs FP8 training"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: refused"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--qat-granularity", "row"],
     "it conflicts with --qat-clamp rms --qat-granularity row"),
])
def test_fp8_recipe_rules(argv, message):
    with pytest.raises(ArgumentError) as err:
        parse_config(BASE + argv, world_size=1)
    assert message in str(err.value)

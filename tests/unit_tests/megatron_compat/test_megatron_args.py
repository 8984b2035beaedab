"""Our argument parser next to megatron-core 0.19.2's own (installed with pip install --no-deps).

Every flag of Megatron-LM's GPT-3 175B and Llama-3 8B FP8 example scripts parses in ours to the value
megatron-core parses it to; shared flags have Megatron's defaults unless our --help names the difference;
allow_abbrev is off; every commonly set GPT flag is implemented, an announced no-op, or refused by name.
"""
from __future__ import annotations

import argparse
import enum
import typing

import pytest

from megatron_cai.training.arguments import (
    ArgumentError,
    build_parser,
    parse_args,
    parse_config,
    resolve_megatron_flags,
)
from megatron_cai.training.flags import megatron_compat as compat

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
margs = pytest.importorskip("megatron.training.arguments")

from testlib.megatron_scripts import GPT3, LLAMA, flags_of, script_argv  # noqa: E402

MOCK = []
REAL = ["ckpt", "tb", "tokenizer_dir", "data/corpus_text_document"]
GPT3_ARGS = ["ckpt", "tb", "gpt2-vocab.json", "gpt2-merges.txt", "data/corpus_text_document"]
MINIMAL = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]


def resolved(extra: list[str]):
    """The flags after Megatron-LM's aliases and rules (pure: a copy of the parsed namespace)."""
    return resolve_megatron_flags(parse_args(MINIMAL + extra))


def build(extra: list[str]):
    return parse_config(MINIMAL + extra, world_size=1)

# Flags a dense GPT pretraining script commonly sets (besides the two example scripts).
COMMON_GPT_FLAGS = [
    "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling",
    "--tp-comm-overlap", "--num-experts", "--expert-model-parallel-size", "--context-parallel-size",
    "--recompute-activations", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--distribute-saved-activations", "--use-rotary-position-embeddings", "--no-position-embedding",
    "--use-rope-scaling", "--squared-relu", "--openai-gelu", "--qk-layernorm", "--add-qkv-bias",
    "--log-params-norm", "--log-num-zeros-in-grad", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
    "--no-log-loss-scale-to-tensorboard", "--tensorboard-log-interval", "--tensorboard-queue-size",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--timing-log-level",
    "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--use-checkpoint-args", "--async-save",
    "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--dataloader-type", "--train-data-path",
    "--valid-data-path", "--test-data-path", "--data-cache-path", "--reset-position-ids", "--reset-attention-mask",
    "--eod-mask-loss", "--adam-eps", "--sgd-momentum", "--optimizer", "--weight-decay-incr-style",
    "--start-weight-decay", "--end-weight-decay", "--lr-warmup-iters", "--lr-warmup-init", "--seed",
    "--distributed-backend", "--local-rank", "--exit-interval", "--exit-signal-handler", "--no-load-optim",
    "--no-load-rng", "--no-save-optim", "--finetune", "--ckpt-step", "--exit-on-missing-checkpoint",
    "--make-vocab-size-divisible-by", "--norm-epsilon", "--num-layers-per-virtual-pipeline-stage",
    "--use-torch-fsdp2", "--no-check-for-nan-in-loss-and-grad", "--deterministic-mode", "--profile-ranks",
    "--use-pytorch-profiler", "--fp8-margin", "--fp8-interval", "--fp8-recipe", "--transformer-impl",
    "--main-grads-dtype", "--exp-avg-dtype", "--use-precision-aware-optimizer", "--ddp-average-in-collective",
    "--manual-gc-interval", "--no-save-rng", "--pretrained-checkpoint", "--spec", "--yaml-cfg",
]


@pytest.fixture(scope="module")
def megatron_parser() -> argparse.ArgumentParser:
    return margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    return value


def _switch(action: argparse.Action) -> bool:
    return action.nargs == 0


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("scripts")
    return {"gpt3": script_argv(GPT3, GPT3_ARGS, tmp), "llama-mock": script_argv(LLAMA, MOCK, tmp),
            "llama-real": script_argv(LLAMA, REAL, tmp)}


def test_fixture_scripts_have_the_flags_the_issue_counts(scripts):
    assert len(flags_of(scripts["gpt3"])) == 34
    assert {"--rampup-batch-size", "--fp16", "--vocab-file", "--merge-file"} <= set(scripts["gpt3"])
    assert "'99,1,0'" in scripts["llama-mock"]  # the quotes the array expansion leaves in place


@pytest.mark.parametrize("name", ["gpt3", "llama-mock", "llama-real"])
def test_every_script_flag_parses_to_megatrons_value(name, scripts, megatron_parser):
    argv = scripts[name]
    ours_parser = build_parser()
    ours, theirs = _actions(ours_parser), _actions(megatron_parser)
    missing = [f for f in flags_of(argv) if f not in ours]
    assert not missing, f"{name}: flags our parser lacks: {missing}"
    our_args = ours_parser.parse_args(argv)
    their_args = megatron_parser.parse_args(argv)
    for flag in flags_of(argv):
        a, b = ours[flag], theirs[flag]
        assert _switch(a) == _switch(b), f"{flag}: a switch in one parser, a value in the other"
        mine, megatron = getattr(our_args, a.dest), getattr(their_args, b.dest)
        if _switch(a):  # store_true here may be store_false there (--no-X): compare "was given"
            assert (mine != a.default) and (megatron != b.default), flag
        else:
            assert _plain(mine) == _plain(megatron), f"{flag}: ours {mine!r}, megatron-core {megatron!r}"


def test_shared_defaults_are_megatrons_or_explained_in_help(megatron_parser):
    ours, theirs = _actions(build_parser()), _actions(megatron_parser)
    unexplained = []
    for flag, a in ours.items():
        if flag not in theirs or flag in ("-h", "--help"):
            continue
        b = theirs[flag]
        if _switch(a) and _switch(b):
            # off when absent in both: store_true False/None, or megatron's store_false --no-X (default True)
            store_false = (isinstance(a, argparse._StoreFalseAction), isinstance(b, argparse._StoreFalseAction))
            same = (store_false[0] and store_false[1]) or (
                not store_false[0] and not a.default and (not b.default or store_false[1]))
        else:
            same = _plain(a.default) == _plain(b.default)
        if not same and "Megatron-LM" not in (a.help or ""):
            unexplained.append(f"{flag}: ours {a.default!r}, megatron-core {b.default!r}")
    assert not unexplained, unexplained


@pytest.mark.parametrize("flag,ours", [("--lr-decay-style", "linear"),
                                       ("--position-embedding-type", "learned_absolute"),
                                       ("--log-interval", 100), ("--eval-iters", 100), ("--num-workers", 2)])
def test_defaults_the_issue_names(flag, ours, megatron_parser):
    mine = _actions(build_parser())[flag].default
    assert mine == ours == _actions(megatron_parser)[flag].default


def test_allow_abbrev_is_off_in_both(megatron_parser):
    assert build_parser().allow_abbrev is False and megatron_parser.allow_abbrev is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--num-lay", "2"])  # a prefix of --num-layers is not taken for it


def test_compat_tables_copy_megatrons_flag_shapes(megatron_parser):
    theirs = _actions(megatron_parser)
    ours = _actions(build_parser())
    for f in compat.NO_OP_FLAGS + compat.MAPPED_FLAGS + compat.REFUSED_FLAGS:
        assert f.flag in theirs, f"{f.flag} is not a megatron-core 0.19.2 flag"
        b = theirs[f.flag]
        assert _switch(ours[f.flag]) == _switch(b), f.flag
        if not _switch(b):
            assert _plain(b.default) == f.default, f.flag
            assert (tuple(map(_plain, b.choices)) if b.choices else None) == f.choices, f.flag
    names = [f.flag for f in compat.NO_OP_FLAGS + compat.MAPPED_FLAGS + compat.REFUSED_FLAGS]
    assert len(names) == len(set(names))


def test_common_gpt_flags_are_each_implemented_no_op_or_refused(megatron_parser):
    ours, theirs = _actions(build_parser()), _actions(megatron_parser)
    no_op = {f.flag for f in compat.NO_OP_FLAGS}
    refused = {f.flag for f in compat.REFUSED_FLAGS}
    for flag in COMMON_GPT_FLAGS:
        assert flag in theirs, f"{flag} is not a megatron-core flag"
        assert flag in ours, f"{flag} does not parse here"
        implemented = flag not in no_op and flag not in refused
        assert implemented + (flag in no_op) + (flag in refused) == 1


_SAMPLE = {int: ("4", "7"), float: ("0.5", "0.37"), str: ("x",)}


@pytest.mark.parametrize("entry", compat.REFUSED_FLAGS, ids=lambda f: f.flag)
def test_refused_flags_fail_with_one_line_naming_them(entry):
    if entry.nargs == 0:
        extra = [entry.flag]
    else:
        candidates = entry.choices or _SAMPLE[entry.type]
        value = next(c for c in candidates if c not in entry.allowed and c != entry.default and [c] != entry.default
                     and entry.type(c) not in entry.allowed and entry.type(c) != entry.default)
        extra = [entry.flag, str(value)]
    with pytest.raises(ArgumentError) as err:
        build(extra)
    message = str(err.value)
    assert message.startswith(entry.flag) and "refused" in message and "\n" not in message
    assert entry.reason in message


@pytest.mark.parametrize("extra", [["--context-parallel-size", "1"], ["--expert-model-parallel-size", "1"],
                                   ["--dataloader-type", "single"], ["--recompute-modules", "core_attn"]])
def test_refused_flags_accept_the_values_that_mean_the_same(extra):
    build(extra)


def test_no_op_flags_are_listed_once():
    args = resolved(["--use-mcore-models", "--no-bias-gelu-fusion", "--fp8-margin", "3"])
    assert sorted(args.megatron_no_op_flags) == ["--fp8-margin", "--no-bias-gelu-fusion", "--use-mcore-models"]
    message = compat.no_op_message(args.megatron_no_op_flags)
    assert "accepted for Megatron-LM compatibility, no effect here" in message
    assert message.count("--use-mcore-models") == 1
    assert compat.no_op_message(resolved([]).megatron_no_op_flags) is None


@pytest.mark.parametrize("value", ["'99,1,0'", '"99,1,0"', "99,1,0", "99, 1, 0", "99/1/0", "99,1"])
def test_split_is_read_as_megatron_reads_it(value):
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from megatron_cai.core.datasets.utils import parse_and_normalize_split as ours

    args = resolved(["--split", value])
    assert ours(args.split) == pytest.approx(parse_and_normalize_split(value))


@pytest.mark.parametrize("value", ["99;1;0", "a,b", "1,2,3,4"])
def test_split_that_megatron_would_misread_is_refused(value):
    with pytest.raises(ArgumentError, match="--split"):
        resolved(["--split", value])


def test_data_path_without_split_gets_megatrons_legacy_split():
    args = resolve_megatron_flags(parse_args(["--data-path", "x", "--train-iters", "2"]))
    assert args.split == "969,30,1"
    with pytest.raises(ArgumentError, match="exclusive"):
        resolve_megatron_flags(parse_args(["--data-path", "x", "--train-data-path", "y", "--train-iters", "2"]))


@pytest.mark.parametrize("backend,expected", [("auto", None), ("flash", None), ("fused", None),
                                              ("unfused", "eager"), ("local", "eager"), ("triton", "triton"),
                                              ("cpu", "cpu")])
def test_attention_backend_maps_megatrons_names(backend, expected):
    args = resolved(["--attention-backend", backend])
    assert compat.attention_backend_for(args.attention_backend) == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(MINIMAL + ["--attention-backend", "sdpa"])  # anything else: argparse refuses


def test_fp8_format_turns_on_fp8_training():
    args = resolved(["--fp8-format", "hybrid"])
    assert args.qat == "fp8" and args.fp8_format == "hybrid"
    assert resolved(["--qat", "fp8"]).fp8_format == "hybrid"
    assert resolved([]).qat == "none"
    with pytest.raises(ArgumentError, match="--fp8-format"):
        resolved(["--fp8-format", "e4m3", "--qat", "int8"])


def test_ckpt_formats():
    assert resolved(["--ckpt-format", "torch"]).ckpt_format == "torch"
    assert resolved(["--ckpt-format", "torch_dist"]).ckpt_format == "torch_dist"
    assert resolved(["--auto-detect-ckpt-format"]).auto_detect_ckpt_format
    with pytest.raises(ArgumentError, match="--ckpt-format torch_dcp: refused"):
        resolved(["--ckpt-format", "torch_dcp"])


def test_non_persistent_checkpoint_flags():
    """global is implemented; local and in_memory are refused by name; an interval needs a type."""
    a = resolved(["--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global",
                  "--save-retain-interval", "100", "--use-persistent-ckpt-worker"])
    assert (a.non_persistent_save_interval, a.non_persistent_ckpt_type, a.save_retain_interval) == (5, "global", 100)
    for kind in ("local", "in_memory"):
        with pytest.raises(ArgumentError, match=f"--non-persistent-ckpt-type {kind}: refused"):
            resolved(["--non-persistent-ckpt-type", kind])
    with pytest.raises(ArgumentError, match="--non-persistent-save-interval 5 needs --non-persistent-ckpt-type"):
        resolved(["--non-persistent-save-interval", "5"])


def test_aliases():
    a = resolved(["--use-rotary-position-embeddings"])
    assert a.position_embedding_type == "rope"
    assert resolved(["--no-position-embedding"]).position_embedding_type == "none"
    assert resolved(["--recompute-activations"]).recompute_granularity == "selective"
    assert resolved(["--squared-relu"]).activation == "relu2"
    assert resolved(["--openai-gelu"]).activation == "gelu_tanh"
    assert resolved([]).activation == "gelu_erf"  # Megatron-LM's MLP without a switch
    assert resolved(["--activation", "gelu"]).activation == "gelu_erf"
    assert resolved(["--activation", "relu2", "--squared-relu"]).activation == "relu2"  # the same choice twice
    with pytest.raises(ArgumentError, match="choose one"):
        resolved(["--swiglu", "--squared-relu"])
    with pytest.raises(ArgumentError, match="--overlap-param-gather needs"):
        resolved(["--overlap-param-gather"])


def test_wandb_without_the_package_is_a_clear_error():
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(ArgumentError, match="pip install wandb"):
        resolved(["--wandb-project", "p"])


def test_megatron_flags_reach_the_typed_config_and_the_flags_stay_as_given():
    argv = MINIMAL + ["--fp8-format", "e4m3", "--qk-layernorm", "--apply-layernorm-1p", "--rotary-percent", "0.5",
                      "--position-embedding-type", "rope", "--recompute-granularity", "full", "--recompute-method",
                      "block", "--recompute-num-layers", "2", "--attention-backend", "local", "--optimizer", "sgd",
                      "--calculate-per-token-loss", "--split", "'99,1,0'", "--log-throughput", "--use-mcore-models",
                      "--profile", "--manual-gc", "--empty-unused-memory-level", "1"]
    flags = parse_args(argv)
    before = dict(vars(flags))
    from megatron_cai.training.arguments import build_config

    c = build_config(flags, 1)
    assert vars(flags) == before and build_config(flags, 1) == c  # pure and repeatable
    assert (c.model.qat.fmt, c.model.qat.fp8_format) == ("fp8", "e4m3")
    assert c.model.qk_layernorm and c.model.apply_layernorm_1p and c.model.rotary_percent == 0.5
    assert (c.model.recompute_granularity, c.model.recompute_method, c.model.recompute_num_layers) == \
        ("full", "block", 2)
    assert c.model.attention_backend == "eager" and c.optimizer.optimizer == "sgd"
    assert c.training.calculate_per_token_loss and c.training.manual_gc and c.training.empty_unused_memory_level == 1
    assert c.data.split == "99,1,0" and c.flags["split"] == "'99,1,0'"
    assert c.logging.log_throughput and c.logging.profile and c.logging.megatron_no_op_flags == ["--use-mcore-models"]


def test_context_parallel_size_is_ours_in_help_and_config(capsys):
    """``pretrain_gpt.py --help`` documents --context-parallel-size (not a refused or no-op Megatron flag), and
    CP = 2 on 8 ranks with TP 2 leaves DP = 2 (world = TP x CP x DP x PP, Megatron's order)."""
    import pretrain_gpt

    with pytest.raises(SystemExit) as done:
        pretrain_gpt.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--context-parallel-size CONTEXT_PARALLEL_SIZE split each sequence over this many ranks" in text
    assert "docs/context-parallel.md" in text
    assert "--context-parallel-size" not in {f.flag for f in compat.REFUSED_FLAGS}
    assert resolved(["--context-parallel-size", "2"]).megatron_no_op_flags == []
    config = parse_config(MINIMAL + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--seq-length", "64", "--max-position-embeddings", "64",
                                     "--attention-dropout", "0"], world_size=8)
    assert (config.parallel.context_parallel_size, config.parallel.data_parallel_size) == (2, 2)

"""Megatron-LM's own flag sets (tests/fixtures/megatron_scripts: launch scripts, per-model flag files, release
configurations, Mixtral's MoE script and Qwen3-MoE's flags) parse here with no refusal, build a configuration for
their own layout,
and give every flag the value megatron-core 0.19.2's parser gives it; every flag problem of a command line is
reported together, in one screen, with "did you mean" and without argparse's usage dump."""
from __future__ import annotations

import argparse
import contextlib
import io
import typing

import pytest

from megatron_cai.training.arguments import build_config, build_parser, parse_args, resolve_megatron_flags
from megatron_cai.training.flags.report import MAX_LINES, FlagProblems, FlagProblemsError, parse_collecting

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
margs = pytest.importorskip("megatron.training.arguments")

import testlib.megatron_scripts as ms  # noqa: E402
from testlib.megatron_scripts import without_flags  # noqa: E402

RELEASE_ENV = {"DATA_PATH": "/data", "DATA_BLEND": "/data/blend_text_document", "DATA_CACHE_PATH": "/cache",
               "CHECKPOINT_SAVE_PATH": "/ckpt", "CHECKPOINT_LOAD_PATH": "/ckpt", "TENSORBOARD_PATH": "/tb",
               "WANDB_EXPERIMENT": "run", "WANDB_SAVE_PATH": "/wandb"}
SCRIPTS = {ms.GPT3: ["ckpt", "tb", "vocab.json", "merges.txt", "data/corpus_text_document"],
           ms.GPT3_STEP: ["ckpt", "tb", "vocab.json", "merges.txt", "data/corpus_text_document"],
           ms.LLAMA: [], ms.LLAMA_FSDP: [], ms.MIXTRAL: ["ckpt", "tokenizer.model", "data/corpus_text_document"]}
# flags of the GPU environment, not of the model: W&B needs its package, which the CPU tests do not install
ENVIRONMENT = ("--wandb-project needs the wandb package",)
WANDB = ("--wandb-project", "--wandb-entity", "--wandb-exp-name", "--wandb-save-dir")


@pytest.fixture(scope="module")
def flag_sets(tmp_path_factory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("flag_sets")
    sets = {name: ms.script_argv(name, args, tmp) for name, args in SCRIPTS.items()}
    sets.update({name: ms.model_flags_argv(name) for name in ms.MODEL_FLAG_FILES})
    sets.update({name: ms.release_argv(name, RELEASE_ENV) for name in ms.RELEASE_CONFIGS})
    return sets


def _problems(argv: list[str]) -> FlagProblems:
    args, problems = parse_collecting(build_parser(), argv)
    resolve_megatron_flags(args, problems)
    return problems


def test_every_flag_set_parses_with_no_refusal(flag_sets):
    """Acceptance 1 (parsing), MoE included (issue 43): the only problems are W&B's, where the CPU tests lack the
    package."""
    assert len(flag_sets) >= 15
    for name, argv in flag_sets.items():
        found = [p for p in _problems(argv).problems if not p.text.startswith(ENVIRONMENT)]
        assert not found, f"{name}: {found}"


def _layout_world(argv: list[str]) -> int:
    """TP x PP (DP = 1): the smallest world that the set's own layout runs on."""
    args = parse_args(argv)
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size


def test_complete_flag_sets_build_a_config_for_their_own_layout(flag_sets):
    """The launch scripts and release configurations (the per-model files hold model flags only) build a whole
    TrainConfig at their TP x PP: every cross-flag rule and the layout checks pass."""
    for name, argv in flag_sets.items():
        if name in ms.MODEL_FLAG_FILES or name == ms.MIXTRAL:
            continue
        argv = without_flags(argv, WANDB)
        config = build_config(parse_args(argv), _layout_world(argv), vocab_size=50257)
        assert config.parallel.data_parallel_size == 1, name
    step = build_config(parse_args(flag_sets[ms.GPT3_STEP]), 128, vocab_size=50257)
    assert step.training.global_batch_size == 1536
    assert step.training.step_batch_size_schedule[:2] == ((0, 16), (2_400_000_000 // 2048, 320))
    fsdp = build_config(parse_args(flag_sets[ms.LLAMA_FSDP]), 1, vocab_size=128256)
    assert fsdp.ddp.use_torch_fsdp2 and not fsdp.ddp.use_distributed_optimizer
    assert fsdp.checkpoint.ckpt_format == "torch_dist"
    assert [n.split(":")[0] for n in fsdp.logging.megatron_notes] == [
        " > --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", " > --ckpt-format fsdp_dtensor"]



def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def _plain(value):
    return value.name if hasattr(value, "name") and not isinstance(value, str) else value


def test_every_flag_parses_to_megatrons_value(flag_sets):
    """Beside megatron-core 0.19.2's own parser: the same value for every flag of every set (the GPT-3 schedule,
    which the script's array expansion word-splits and Megatron-LM then rejects, is compared joined)."""
    theirs_parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ours_parser, theirs = build_parser(), _actions(theirs_parser)
    ours = _actions(ours_parser)
    for name, argv in flag_sets.items():
        if name == ms.GPT3_STEP:
            i = argv.index("--step-batch-size-schedule")
            argv = argv[:i + 1] + [" ".join(argv[i + 1:i + 7])] + argv[i + 7:]
        with contextlib.redirect_stderr(io.StringIO()):
            their_args = theirs_parser.parse_args(argv)
        our_args = parse_args(argv)
        for flag in ms.flags_of(argv):
            a, b = ours[flag], theirs[flag]
            mine, megatron = getattr(our_args, a.dest), getattr(their_args, b.dest)
            if a.nargs == 0:
                assert (mine != a.default) and (megatron != b.default), f"{name}: {flag}"
            elif flag == "--step-batch-size-schedule":
                assert " ".join(mine) == megatron
            else:
                assert _plain(mine) == _plain(megatron), f"{name}: {flag}: ours {mine!r}, megatron-core {megatron!r}"


def test_a_documented_flag_list_gets_every_problem_at_once():
    """docs/llama_mistral.md's Mistral-7B flags (verbatim): a typo, a switch given a value and a refused flag,
    all in one report; megatron-core's own parser stops at the first."""
    argv = ms.flags_file_argv(ms.MISTRAL_DOC, {"TP": "1", "TOKENIZER_MODEL": "tok.model", "CHECKPOINT_DIR": "ckpt"})
    with pytest.raises(FlagProblemsError) as err:
        parse_args(argv)
    problems = {(p.category, p.text) for p in err.value.problems}
    assert problems == {("unknown", "--disable-bia-linear (did you mean --disable-bias-linear?)"),
                        ("invalid", "--group-query-attention 8: --group-query-attention takes no value"),
                        ("refused", "--use-checkpoint-args: pass the model flags explicitly; they are checked "
                                    "against the checkpoint")}
    theirs = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with contextlib.redirect_stderr(io.StringIO()) as stderr, pytest.raises(SystemExit):
        theirs.parse_args(argv)
    assert "usage:" in stderr.getvalue()  # what Megatron-LM prints instead


SEVERAL = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "16",
           "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8",
           "--num-exprts", "8",                                     # unknown, close to --num-experts
           "--totally-unknown-flag", "x",                           # unknown, no close flag
           "--hidden-dropout", "high",                              # not a float
           "--ckpt-format", "torch_dcp",                            # a refused value
           "--moe-enable-deepep", "--moe-use-upcycling",            # refused (MoE options not here)
           "--swiglu", "--squared-relu",                            # conflicting activations
           "--overlap-param-gather",                                # needs --use-distributed-optimizer
           "--micro_batch_size", "2"]                               # underscore spelling: accepted


def test_several_problems_are_reported_in_one_run_on_one_screen(capsys):
    """Acceptance 2, through pretrain_gpt.py's entry point: exit 2, one error line and one line per problem
    (each flag, its category, the reason), "did you mean", no usage dump, at most one screen."""
    import pretrain_gpt

    assert pretrain_gpt.main(SEVERAL) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "usage:" not in "\n".join(err)
    assert err[0].startswith("error: 8 flag problems")
    body = [line.split(None, 1) for line in err[1:]]
    assert [c for c, _ in body] == ["unknown", "unknown", "invalid", "refused", "refused", "refused", "conflict",
                                    "conflict"]
    text = "\n".join(err)
    for needle in ("--num-exprts 8 (did you mean --num-experts?)", "--totally-unknown-flag x",
                   "--hidden-dropout: invalid float value: 'high'", "--ckpt-format torch_dcp: the formats here",
                   "--moe-enable-deepep: this Mixture-of-Experts option is not implemented",
                   "--moe-use-upcycling: this Mixture-of-Experts option",
                   "--swiglu and --squared-relu: choose one", "--overlap-param-gather needs --use-distributed"):
        assert needle in text, needle
    assert len(err) <= MAX_LINES + 2
    assert parse_args(["--micro_batch_size", "3", "--use-checkpoint-opt_param-scheduler"]).micro_batch_size == 3


def test_one_problem_is_one_line():
    with pytest.raises(FlagProblemsError) as err:
        parse_args(["--mock-data", "--num-layerz", "2"])
    assert str(err.value) == "unknown flag --num-layerz 2 (did you mean --num-layers?)"


def test_a_long_report_stays_on_one_screen():
    argv = [f"--unknown-flag-{i}" for i in range(3 * MAX_LINES)]
    with pytest.raises(FlagProblemsError) as err:
        parse_args(argv)
    lines = str(err.value).splitlines()
    assert len(lines) == MAX_LINES + 2 and lines[-1] == f"  ... and {2 * MAX_LINES} more"


@pytest.mark.parametrize("hyphen, underscore", [("--override-opt-param-scheduler", "--override-opt_param-scheduler"),
                                                ("--use-checkpoint-opt-param-scheduler",
                                                 "--use-checkpoint-opt_param-scheduler")])
def test_scheduler_flags_take_both_spellings(hyphen, underscore):
    dest = hyphen[2:].replace("-", "_")
    assert vars(parse_args([hyphen]))[dest] and vars(parse_args([underscore]))[dest]
    assert vars(parse_args(["--" + hyphen[2:].replace("-", "_")]))[dest]  # all underscores, too

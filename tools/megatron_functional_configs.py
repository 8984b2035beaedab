"""Parse Megatron-LM's GPT functional-test configurations here and count those that parse.

Reads ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a Megatron-LM checkout, expands each
``MODEL_ARGS`` as Megatron-LM's launcher does (``true``: the switch; ``false``: left out; a list or a string in
``[ ]``: its words; ``${VAR}``: the launcher's paths, here under a scratch directory), keeps the pretraining runs
of ``pretrain_gpt.py`` (not ``MODE: inference`` / ``rl``, not the ModelOpt distillation exports), and parses each
with this repository's flags, then builds its configuration on one node of 8 ranks, as Megatron-LM's CI runs it, with
``--distributed-backend gloo``. A configuration *parses* when the only problems are refusals of the features
that are separate work here: Mixture-of-Experts, multi-latent attention and hybrid / linear-attention layers.
A configuration that does not parse is also given to megatron-core's own parser (when it is installed), and the
output says when that parser rejects the same command line too (e.g. a value the launcher keeps as one word).

    python tools/megatron_functional_configs.py --test-cases Megatron-LM/tests/functional_tests/test_cases/gpt
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

NODE = 8  # Megatron-LM's CI runs these configurations on one node of 8 GPUs
# the topics whose refusals are separate features (not counted against a configuration)
SEPARATE_TOPICS = ("moe", "mla", "hybrid")
_SEPARATE_PREFIXES = (
    "--moe-",
    "--mamba-",
    "--hybrid-",
    "--num-experts",
    "--expert-",
    "--linear-attention",
    "--multi-latent-attention",
)


def launcher_argv(model_args: dict, env: dict[str, str]) -> list[str]:
    """``MODEL_ARGS`` as the launcher hands them to ``pretrain_gpt.py``."""
    out: list[str] = []
    for flag, value in model_args.items():
        if value is False:
            continue
        out.append(flag)
        if value is True:
            continue
        text = str(value)
        for key, val in env.items():
            text = text.replace("${" + key + "}", val).replace("$" + key, val)
        # the launcher's rules (tests/functional_tests/shell_test_utils/_run_training.sh): a list, or a string in
        # [ ], gives its words; any other value is one word (a value with spaces is passed quoted: "2 2")
        if isinstance(value, list):
            out += [str(word) for word in value]
        elif re.fullmatch(r"\[[^]]+\]", text):
            out += text[1:-1].split()
        else:
            out.append(text)
    return out


def is_pretraining(name: str, config: dict) -> bool:
    """A pretraining run of ``pretrain_gpt.py`` (not inference, RL or a ModelOpt export)."""
    return config.get("MODE") in (None, "pretraining") and "modelopt" not in name and bool(config.get("MODEL_ARGS"))


def separate_feature(flag: str) -> bool:
    """A flag of Mixture-of-Experts, MLA or hybrid / linear-attention layers (refused until those land)."""
    from megatron_cai.training.flags.megatron_compat import TOPIC_TABLES

    topics = {f.flag: t.topic for t in TOPIC_TABLES for f in (*t.no_op, *t.mapped, *t.refused)}
    return topics.get(flag) in SEPARATE_TOPICS or flag.startswith(_SEPARATE_PREFIXES)


def _separate_problem(category: str, text: str) -> bool:
    """A problem of a separate feature's flag, or an optional package that is missing (wandb)."""
    if category == "missing" and "package, which is not installed" in text:
        return True
    return separate_feature(text.split(":")[0].split()[0])


def megatron_core_error(argv: list[str]) -> str | None:
    """What megatron-core's own parser says of this command line: its argparse error, or None when it parses (or
    when megatron-core is not installed). Only the parser: megatron-core's ``validate_args`` needs a GPU world."""
    try:
        from megatron_flag_table import megatron_parser

        parser = megatron_parser(exit_on_error=False)
    except ImportError:
        return None
    try:
        parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        return str(e)
    return None


def problems_of(argv: list[str]) -> list[str]:
    """The problems (other than the separate features') of one command line at 8 ranks (one node), or at
    TP x PP x CP ranks where its batch sizes do not fit 8; [] when it parses."""
    from megatron_cai.training.arguments import parse_args

    try:
        args = parse_args(argv)
    except Exception as e:  # FlagProblemsError / ArgumentError
        return _kept(e)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    worlds = [NODE, model_parallel] if NODE % model_parallel == 0 and NODE != model_parallel else [model_parallel]
    for world in worlds:
        problems = _build(args, world)
        if not any("impossible parallel layout" in p for p in problems):
            break
    return problems


def _build(args, world: int) -> list[str]:
    from megatron_cai.training.arguments import build_config

    try:
        build_config(args, world, vocab_size=args.vocab_size or 50257)
    except Exception as e:  # FlagProblemsError / ArgumentError
        return _kept(e)
    return []


def _kept(error: Exception) -> list[str]:
    from megatron_cai.training.config import ArgumentError
    from megatron_cai.training.flags.report import FlagProblemsError

    if isinstance(error, FlagProblemsError):
        return [f"{p.category} {p.text}" for p in error.problems if not _separate_problem(p.category, p.text)]
    if isinstance(error, ArgumentError):
        return [] if _separate_problem("conflict", str(error)) else [str(error)]
    raise error


def main() -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--test-cases", type=Path, required=True, help="Megatron-LM's tests/functional_tests/test_cases/gpt directory"
    )
    parser.add_argument("--verbose", action="store_true", help="print every configuration's verdict")
    opts = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mlm_functional_"))
    env = {
        "DATA_PATH": str(scratch),
        "CHECKPOINT_SAVE_PATH": str(scratch / "ckpt"),
        "CHECKPOINT_LOAD_PATH": str(scratch / "ckpt"),
        "TENSORBOARD_PATH": str(scratch / "tb"),
        "DATA_CACHE_PATH": str(scratch / "cache"),
        "OUTPUT_PATH": str(scratch / "out"),
        "REPEAT": "1",
    }
    verdicts: dict[str, list[str]] = {}
    megatron_rejects: dict[str, str] = {}
    for path in sorted(opts.test_cases.glob("*/model_config.yaml")):
        config = yaml.safe_load(path.read_text())
        if is_pretraining(path.parent.name, config):
            argv = [a if a != "nccl" else "gloo" for a in launcher_argv(config["MODEL_ARGS"], env)]
            verdicts[path.parent.name] = problems_of(argv)
            if verdicts[path.parent.name] and (error := megatron_core_error(argv)):
                megatron_rejects[path.parent.name] = error
    failing = {n: p for n, p in verdicts.items() if p}
    for name, problems in verdicts.items():
        if problems or opts.verbose:
            theirs = (
                f" [megatron-core's own parser rejects it too: {megatron_rejects[name]}]"
                if name in megatron_rejects
                else ""
            )
            print(f"{name}: {'; '.join(problems) or 'parses'}{theirs}")
    reasons = Counter(re.sub(r"^(\w+ --[\w-]+).*", r"\1", p) for ps in failing.values() for p in ps)
    for reason, count in reasons.most_common():
        print(f"  {count:3d}  {reason}")
    also = f"; megatron-core's own parser rejects {len(megatron_rejects)} of the rest too" if megatron_rejects else ""
    print(f"{len(verdicts) - len(failing)} of {len(verdicts)} parse{also}")


if __name__ == "__main__":
    main()

"""Every option string of megatron-core 0.19.2's own parser has exactly one state here: implemented (our parser),
accepted without effect, mapped, or refused (the topic tables in megatron_cai/training/flags/table_*.py); --help
lists every one of them; docs/megatron-compat.md holds the table as the tables give it."""
from __future__ import annotations

import argparse
import typing
from pathlib import Path

import pytest

from megatron_cai.training.arguments import (
    ArgumentError,
    build_parser,
    parse_args,
    parse_config,
    resolve_megatron_flags,
)
from megatron_cai.training.flags import doc
from megatron_cai.training.flags import megatron_compat as compat

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
margs = pytest.importorskip("megatron.training.arguments")

ROOT = Path(__file__).resolve().parents[3]
MINIMAL = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]


@pytest.fixture(scope="module")
def megatron_options() -> list[str]:
    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _states() -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for table in compat.TOPIC_TABLES:
        for state, rows in (("no-op", table.no_op), ("mapped", table.mapped), ("refused", table.refused)):
            for f in rows:
                states.setdefault(f.flag, []).append(f"{state} ({table.topic})")
    return states


def test_every_megatron_core_flag_has_exactly_one_state(megatron_options):
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    states = _states()
    unknown = [f for f in megatron_options if f not in ours]
    assert not unknown, f"megatron-core flags with no state here (tools/megatron_flag_table.py --rows): {unknown}"
    twice = {f: s for f, s in states.items() if len(s) > 1}
    assert not twice, f"flags in more than one table: {twice}"
    assert len(megatron_options) == 846
    implemented = [f for f in megatron_options if f not in states]
    counts = {s: sum(1 for v in states.values() if v[0].startswith(s)) for s in ("no-op", "mapped", "refused")}
    assert len(implemented) + sum(counts.values()) == 846


def test_the_committed_flag_list_is_megatron_cores(megatron_options):
    assert doc.megatron_core_flags() == sorted(megatron_options), "run tools/megatron_flag_table.py --write-list"


def test_table_rows_are_megatron_core_flags(megatron_options):
    extra = set(_states()) - set(megatron_options)
    assert not extra, f"table rows that megatron-core 0.19.2 does not define: {extra}"


def test_help_lists_every_megatron_core_flag(megatron_options):
    text = build_parser().format_help()
    missing = [f for f in megatron_options if f not in text]
    assert not missing, missing


def test_doc_table_is_generated_from_the_tables():
    text = (ROOT / "docs" / "megatron-compat.md").read_text()
    assert doc.BEGIN in text and doc.END in text
    expected = doc.replace_generated(text, doc.flag_table_markdown(build_parser()))
    assert text == expected, "docs/megatron-compat.md is stale: python tools/megatron_flag_table.py --write-doc"


@pytest.mark.parametrize("topic", ["hybrid"])
def test_features_yet_to_land_refuse_in_their_own_topic_table(topic):
    table = next(t for t in compat.TOPIC_TABLES if t.topic == topic)
    assert table.refused and not table.no_op and not table.mapped


# Landed features (MoE: flags/moe.py; MLA, per-layer windows: flags/kaiju.py): our parser implements them.
@pytest.mark.parametrize("flag", ["--num-experts", "--moe-router-topk", "--expert-model-parallel-size",
                                  "--expert-tensor-parallel-size", "--multi-latent-attention", "--q-lora-rank",
                                  "--mscale", "--rope-type", "--window-attn-skip-freq"])
def test_landed_feature_flags_are_implemented(flag):
    assert flag not in _states()
    assert flag in {o for a in build_parser()._actions for o in a.option_strings}


@pytest.mark.parametrize("flag,topic", [("--moe-enable-deepep", "moe"), ("--moe-use-upcycling", "moe"),
                                        ("--cache-mla-latents", "mla"), ("--yarn-beta-fast", "mla"),
                                        ("--hybrid-layer-pattern", "hybrid")])
def test_feature_flags_are_refused_by_name(flag, topic):
    assert _states()[flag] == [f"refused ({topic})"]
    value = [] if next(f for f in compat.REFUSED_FLAGS if f.flag == flag).nargs == 0 else ["3"]
    with pytest.raises(ArgumentError) as err:
        parse_config(MINIMAL + [flag, *value], world_size=1)
    assert str(err.value).startswith(flag) and "refused" in str(err.value)


def test_no_op_and_mapped_flags_print_their_reasons_once():
    resolved = resolve_megatron_flags(parse_args(MINIMAL + ["--no-rope-fusion", "--cuda-graph-impl", "local",
                                                            "--enable-cuda-graph", "--verify-integrity"]))
    message = compat.no_op_message(resolved.megatron_no_op_flags)
    lines = message.splitlines()
    assert len(lines) == 2  # two reasons: a fusion switch, CUDA graphs
    graphs = next(line for line in lines if "--cuda-graph-impl" in line)
    assert "--enable-cuda-graph" in graphs and "CUDA graph capture" in graphs and "--no-rope-fusion" not in graphs
    mapped = [n for n in resolved.megatron_notes if "--verify-integrity" in n]
    assert len(mapped) == 1 and "verified when loaded" in mapped[0]

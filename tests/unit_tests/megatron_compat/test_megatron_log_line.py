"""Our log lines against the formats in megatron-core 0.19.2's own training.py (read from the installed
package's source): the training_log line field by field and in order, the validation block, the
parameter-count line, and Megatron's FLOPs formula behind --log-throughput."""
from __future__ import annotations

import argparse
import inspect
import math
import re
import typing
from datetime import datetime

import pytest

from megatron_cai.training.logging import (
    gpt_flops_per_iteration,
    parameter_count_line,
    training_log_line,
    validation_log_lines,
)

if not hasattr(typing, "override"):
    typing.override = lambda f: f
mtraining = pytest.importorskip("megatron.training.training")


def _literal_templates(source: str) -> list[str]:
    """The string literals appended to ``log_string`` in training_log, in source order."""
    return [m.group(2) for m in re.finditer(r"log_string \+= (f?)'([^']*)'", source)]


def _field(template: str) -> tuple[str, str] | None:
    """' consumed samples: {:12d} |' -> ('consumed samples', '12d'); ' {}: {:.6E} |' -> ('{}', '.6E')."""
    m = re.fullmatch(r" (.+?): \{[A-Za-z_.]*:?([^}]*)\} \|", template)
    return (m.group(1), m.group(2)) if m else None


@pytest.fixture(scope="module")
def megatron_fields() -> tuple[str, list[tuple[str, str]]]:
    source = inspect.getsource(mtraining.training_log)
    stamp = re.search(r"strftime\('([^']+)'\)", source).group(1)
    fields = []
    for t in _literal_templates(source):
        if t.startswith(" iteration "):
            fields.append(("iteration", t))
        elif (f := _field(t)) is not None:
            fields.append(f)
    return stamp, fields


def _split(line: str) -> tuple[str, list[str]]:
    m = re.match(r" \[([^\]]+)\]( .*)", line)
    assert m, f"no timestamp prefix: {line!r}"
    return m.group(1), [p + " |" for p in m.group(2).split(" |")[:-1]]


def _matches(piece: str, label: str, spec: str) -> bool:
    if label == "{}":
        label = piece[1:piece.index(":")]
    prefix = f" {label}: "
    if not piece.startswith(prefix):
        return False
    text = piece[len(prefix):-2]
    value = float(text) if any(c in spec for c in "eEf") else int(text)
    return format(value, spec) == text  # the same width, precision and notation


def _line(**kw) -> str:
    args = dict(iteration=20, train_iters=100, consumed=160, ms_per_iter=123.45, lr=2.5e-4, global_batch=8,
                losses={"lm loss": 5.4321}, grad_norm=1.2345, skipped=1, tokens_per_sec=9876.5,
                grad_comm_bytes=4096, loss_scale=65536.0, nan_iters=0)
    args.update(kw)
    return training_log_line(**args)


def test_training_log_line_follows_megatrons_fields_in_order(megatron_fields):
    stamp, fields = megatron_fields
    labels = [label for label, _ in fields]
    for required in ("consumed samples", "elapsed time per iteration (ms)", "learning rate", "global batch size",
                     "{}", "loss scale", "grad norm", "number of skipped iterations", "number of nan iterations"):
        assert required in labels, f"megatron-core's training_log no longer has {required!r}"
    line = _line(throughput_tflops=12.3)
    ts, pieces = _split(line)
    datetime.strptime(ts, stamp)  # Megatron's timestamp format
    assert pieces[0] == " iteration       20/     100 |"
    assert pieces[0] == f" iteration {20:8d}/{100:8d} |"
    position, last_megatron = 0, 0
    for i, piece in enumerate(pieces[1:], start=1):
        hit = next((k for k in range(position, len(fields)) if fields[k][0] != "iteration"
                    and _matches(piece, *fields[k])), None)
        if hit is None:  # one of our extra fields: only after Megatron's last one
            assert piece.startswith((" tokens per second:", " grad comm bytes:")), piece
            continue
        assert last_megatron == i - 1, f"{piece!r} comes after one of our extra fields"
        last_megatron = i
        position = hit if fields[hit][0] == "{}" else hit + 1
    ours = [p for p in pieces if p.startswith((" tokens per second:", " grad comm bytes:"))]
    assert ours == [" tokens per second: 9876.5 |", " grad comm bytes: 4096 |"]
    assert " learning rate: 2.500000E-04 |" in pieces and " loss scale: 65536.0 |" in pieces
    assert " number of skipped iterations:   1 |" in pieces and " number of nan iterations:   0 |" in pieces
    assert " throughput per GPU (TFLOP/s/GPU): 12.3 |" in pieces


def test_log_line_parses_as_megatron_log_parsers_read_it(megatron_fields):
    """A parser written against Megatron's format (by field name) reads our values back."""
    line = _line(losses={"lm loss": 3.25, "kd loss": 0.5})
    values = dict(re.findall(r" ([a-z][a-z ()/]+?): +([-0-9.E+]+) \|", line))
    assert float(values["lm loss"]) == 3.25 and float(values["kd loss"]) == 0.5
    assert float(values["learning rate"]) == 2.5e-4 and int(values["global batch size"]) == 8
    assert float(values["loss scale"]) == 65536.0 and int(values["number of skipped iterations"]) == 1


def test_validation_block_is_megatrons():
    source = inspect.getsource(mtraining.evaluate_and_print_results)
    assert "string = f' validation{suffix} loss at {prefix} | '" in source
    assert "'{} value: {:.6E} | '" in source and "'{} PPL: {:.6E} | '" in source
    assert "length = len(string) + 1" in source
    block = validation_log_lines(40, {"lm loss": 2.0})
    bar, string, bar2 = block.split("\n")
    expected = " validation loss at iteration 40 | " + "{} value: {:.6E} | ".format("lm loss", 2.0) + \
        "{} PPL: {:.6E} | ".format("lm loss", math.exp(2.0))
    assert string == expected and bar == bar2 == "-" * (len(expected) + 1)


def test_parameter_count_line_is_megatrons():
    source = inspect.getsource(mtraining)
    template = re.search(r"' > number of parameters on \(tensor, gtp_weight_remat, pipeline\) '\s*"
                         r"'model parallel rank \(\{\}, \{\}, \{\}\): \{\}'", source)
    assert template, "megatron-core's parameter-count line changed"
    expected = " > number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank ({}, {}, {}): {}"
    assert parameter_count_line(12345, 1, 2) == expected.format(1, 0, 2, 12345)


@pytest.mark.parametrize("flags", [
    [],
    ["--swiglu", "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96"],
    ["--kv-channels", "32"],
])
def test_throughput_flops_match_megatrons_formula(flags):
    import megatron.training.arguments as margs

    from megatron_cai.training.arguments import parse_config

    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", *flags]
    theirs = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    theirs.padded_vocab_size = 512
    theirs.kv_channels = theirs.kv_channels or theirs.hidden_size // theirs.num_attention_heads
    theirs.num_query_groups = theirs.num_query_groups if theirs.group_query_attention else theirs.num_attention_heads
    theirs.ffn_hidden_size = theirs.ffn_hidden_size or 4 * theirs.hidden_size
    ours = parse_config(argv + ["--mock-data", "--vocab-size", "500", "--train-iters", "1"], world_size=1)
    assert ours.model.padded_vocab_size == 512
    assert gpt_flops_per_iteration(ours.model, 8) == pytest.approx(mtraining.num_floating_point_operations(theirs, 8))

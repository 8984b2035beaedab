"""Megatron-LM flags that are accepted without effect, mapped onto what runs here, or refused with a reason.

The rows live in one module per topic (``table_<topic>.py``, see ``table.py`` for the states); this module joins
them (``NO_OP_FLAGS``, ``MAPPED_FLAGS``, ``REFUSED_FLAGS``), adds them to the parser and checks a command line
against them. Every refused flag of a command line is listed in one report (training/flags/report.py).
"""
from __future__ import annotations

import argparse

from . import (
    table_checkpoint,
    table_hybrid,
    table_mla,
    table_model,
    table_moe,
    table_parallel,
    table_runtime,
    table_training,
)
from .report import FlagProblems
from .table import CompatFlag, FlagTable

__all__ = ["CompatFlag", "FlagTable", "MAPPED_FLAGS", "NO_OP_FLAGS", "REFUSED_FLAGS", "TOPIC_TABLES",
           "add_compat_arguments", "attention_backend_for", "check_compat", "mapped_messages", "no_op_message"]

# One table per topic. A feature that lands removes its rows from its topic's module (as MoE did in table_moe,
# MLA in table_mla, per-layer windows in the former table_window; table_hybrid is still to land) and
# add_argument()s the flags where it implements them (flags/moe.py, flags/kaiju.py).
TOPIC_TABLES: tuple[FlagTable, ...] = (
    table_model.TABLE, table_parallel.TABLE, table_checkpoint.TABLE, table_training.TABLE, table_runtime.TABLE,
    table_moe.TABLE, table_mla.TABLE, table_hybrid.TABLE,
)
NO_OP_FLAGS: list[CompatFlag] = [f for t in TOPIC_TABLES for f in t.no_op]
MAPPED_FLAGS: list[CompatFlag] = [f for t in TOPIC_TABLES for f in t.mapped]
REFUSED_FLAGS: list[CompatFlag] = [f for t in TOPIC_TABLES for f in t.refused]


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the no-op, mapped and refused flags (one argument group each)."""
    for title, table in (("Megatron-LM flags accepted without effect (the help says why)", NO_OP_FLAGS),
                         ("Megatron-LM flags mapped onto what runs here", MAPPED_FLAGS),
                         ("Megatron-LM flags refused (the help says why; accepted at their default)", REFUSED_FLAGS)):
        group = parser.add_argument_group(title)
        for f in table:
            if f.nargs == 0:
                group.add_argument(f.flag, action="store_true", help=f.reason)
            else:
                group.add_argument(f.flag, nargs=f.nargs, type=f.type, default=f.default, choices=f.choices,
                                   help=f.reason)


def check_compat(args: argparse.Namespace, problems: FlagProblems) -> list[str]:
    """Record every refused flag given in ``problems``; return the no-op flags given (in table order)."""
    for f in REFUSED_FLAGS:
        if f.given(args) and vars(args)[f.dest] not in f.allowed:
            problems.add("refused", f"{f.shown(args)}: {f.reason}")
    return [f.flag for f in NO_OP_FLAGS if f.given(args)]


def mapped_messages(args: argparse.Namespace) -> list[str]:
    """One start-up line per mapped flag given: what runs here instead."""
    return [f" > {f.shown(args)}: {f.reason}" for f in MAPPED_FLAGS if f.given(args)]


# Megatron-LM's --attention-backend names onto ours. auto, flash and fused: the device's fused flash-style
# kernel (Triton on CUDA, the blocked kernel on CPU; what backend=None picks); unfused and local: the eager
# reference. All compute exact softmax attention; only the kernel differs.
_ATTENTION_BACKENDS = {"auto": None, "flash": None, "fused": None, "unfused": "eager", "local": "eager"}


def attention_backend_for(name: str | None) -> str | None:
    """Our core-attention backend for an --attention-backend value (ours pass through)."""
    return _ATTENTION_BACKENDS.get(name, name) if name is not None else None


def no_op_message(flags: list[str]) -> str | None:
    """The start-up lines naming the no-op flags given, one line per reason (None when there are none)."""
    if not flags:
        return None
    reasons: dict[str, list[str]] = {}
    for f in NO_OP_FLAGS:
        if f.flag in flags:
            reasons.setdefault(f.reason, []).append(f.flag)
    return "\n".join(f" > accepted for Megatron-LM compatibility, no effect here: {', '.join(names)} ({reason})"
                     for reason, names in reasons.items())

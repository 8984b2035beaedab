"""The flag table's row type and its per-topic tables.

Every option string of megatron-core 0.19.2's parser (``megatron.training.arguments.add_megatron_arguments``) has
one of four states here:

- **implemented**: an ``add_argument`` of this repository's parser (``training/arguments.py`` and the ``flags``
  modules); the ``--help`` text says what it does;
- **accepted without effect** (``FlagTable.no_op``): parsed; the start-up log names it once with its reason;
- **mapped** (``FlagTable.mapped``): parsed; what runs here instead is printed once at start-up;
- **refused** (``FlagTable.refused``): parsed, then refused by name with the reason (and the alternative, where
  there is one), unless its value is its default or one of ``allowed``.

The rows are split by topic, one module each (``table_<topic>.py``, each defining ``TABLE``), so that a feature
that lands replaces only its own topic's module: it deletes its rows there and ``add_argument``s the flags
where it implements them. ``tests/unit_tests/megatron_compat/test_megatron_flag_table.py`` checks that every
option string of megatron-core's parser has exactly one state; ``tools/megatron_flag_rows.py`` prints the rows of
any it lacks.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag: ``nargs=0`` is a switch, anything else takes a value."""

    flag: str
    reason: str
    nargs: int | str | None = 0
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple | None = None
    allowed: tuple = ()  # refused flags: values that mean what they mean here (accepted silently)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def given(self, args: argparse.Namespace) -> bool:
        value = vars(args)[self.dest]
        return value != (False if self.nargs == 0 else self.default)

    def shown(self, args: argparse.Namespace) -> str:
        """The flag as given: ``--flag`` or ``--flag VALUE``."""
        return self.flag if self.nargs == 0 else f"{self.flag} {vars(args)[self.dest]}"


@dataclass(frozen=True)
class FlagTable:
    """One topic's rows: accepted without effect, mapped onto what runs here, refused."""

    topic: str
    no_op: list[CompatFlag] = field(default_factory=list)
    mapped: list[CompatFlag] = field(default_factory=list)
    refused: list[CompatFlag] = field(default_factory=list)

"""Every problem of a command line in one report: unknown, invalid, refused, conflicting and missing flags.

``parse_collecting(parser, argv)`` parses what it can and returns the problems argparse would have
stopped at one by one (unknown flags, with "did you mean"; values a flag does not take), never printing
the usage dump. The flag-to-config builder records Megatron-LM's refused flags and the cross-flag rules
in a :class:`FlagProblems` collector; ``raise_if_any`` raises one :class:`FlagProblemsError` holding them
all, printed as one ``error:`` line followed by one line per problem (at most one screen).

Underscore spellings of known flags (``--micro_batch_size``) are read as the hyphen spelling.
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass

from ..config import ArgumentError

CATEGORIES = ("unknown", "invalid", "refused", "conflict", "missing")
MAX_LINES = 40  # one screen
# Megatron-LM flag families that belong to features this codebase does not have (refused, not "unknown")
_FAMILIES = {"--moe-": "this Mixture-of-Experts option is not implemented here (docs/moe.md lists those that are)",
             "--mamba-": "hybrid Mamba models are not implemented here (dense GPT only)",
             "--hybrid-": "hybrid Mamba models are not implemented here (dense GPT only)",
             "--grpo-": "reinforcement learning (GRPO) is not implemented here",
             "--rl-": "reinforcement learning is not implemented here"}


@dataclass(frozen=True)
class FlagProblem:
    category: str   # one of CATEGORIES
    text: str       # starts with the flag(s) it concerns: "--num-experts 8: no Mixture-of-Experts here"

    @property
    def message(self) -> str:
        """The problem as one line on its own (what a single problem's error says)."""
        if self.category == "unknown":
            return f"unknown flag {self.text}"
        if self.category == "refused":
            flag, _, reason = self.text.partition(": ")
            return f"{flag}: refused: {reason}"
        return self.text


class FlagProblemsError(ArgumentError):
    """One or more flag problems; ``str()`` is the whole report."""

    def __init__(self, problems: list[FlagProblem]) -> None:
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))


def format_problems(problems: list[FlagProblem]) -> str:
    """One line for one problem; else a header and one line per problem, grouped by category."""
    if len(problems) == 1:
        return problems[0].message
    ordered = sorted(problems, key=lambda p: CATEGORIES.index(p.category))
    lines = [f"{len(problems)} flag problems, all listed here (nothing ran; --help lists the flags):"]
    shown = ordered[:MAX_LINES]
    lines += [f"  {p.category:<9} {p.text}" for p in shown]
    if len(ordered) > len(shown):
        lines.append(f"  ... and {len(ordered) - len(shown)} more")
    return "\n".join(lines)


class FlagProblems:
    """Collects problems instead of stopping at the first."""

    def __init__(self, problems: list[FlagProblem] | None = None) -> None:
        self.problems: list[FlagProblem] = list(problems or [])

    def add(self, category: str, text: str) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown flag-problem category {category!r}")
        problem = FlagProblem(category, text)
        if problem not in self.problems:
            self.problems.append(problem)

    def conflict(self, text: str) -> None:
        self.add("conflict", text)

    def invalid(self, text: str) -> None:
        self.add("invalid", text)

    def missing(self, text: str) -> None:
        self.add("missing", text)

    def record(self, error: ArgumentError, category: str = "conflict") -> None:
        """An ArgumentError raised by a check (its problems, or its message under ``category``)."""
        if isinstance(error, FlagProblemsError):
            for p in error.problems:
                self.add(p.category, p.text)
        else:
            self.add(category, str(error))

    def __bool__(self) -> bool:
        return bool(self.problems)

    def raise_if_any(self) -> None:
        if self.problems:
            raise FlagProblemsError(self.problems)


def _option_strings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def _normalise_spellings(argv: list[str], known: dict[str, argparse.Action]) -> list[str]:
    """``--foo_bar`` (and ``--foo_bar=v``) as ``--foo-bar`` when only the latter is a flag."""
    out = []
    for token in argv:
        name, eq, value = token.partition("=")
        if name.startswith("--") and "_" in name and name not in known:
            hyphen = "--" + name[2:].replace("_", "-")
            if hyphen in known:
                token = hyphen + eq + value
        out.append(token)
    return out


def _is_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def _drop_flag(argv: list[str], options: list[str]) -> list[str]:
    """argv without every use of these option strings and the values after them."""
    out, skipping = [], False
    for token in argv:
        name = token.partition("=")[0]
        if _is_flag(token) or token in ("-h",):
            skipping = name in options
            if skipping:
                continue
        elif skipping:
            continue
        out.append(token)
    return out


def _suggest(flag: str, known: dict[str, argparse.Action]) -> str:
    for prefix, reason in _FAMILIES.items():
        if flag.startswith(prefix):
            return reason
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else ""


def _consumes(action: argparse.Action, token: str) -> int | None:
    """How many following tokens a known flag takes (None: all that are not flags)."""
    if "=" in token or action.nargs in (0, "?"):  # "?": argparse takes one only if it is not a flag
        return 1 if action.nargs == "?" and "=" not in token else 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    return None  # "*", "+"


def _leftover_problems(argv: list[str], known: dict[str, argparse.Action], problems: FlagProblems) -> None:
    """Unknown flags (with their values) and values that no flag takes, by walking ``argv`` as argparse does."""
    i = 0
    while i < len(argv):
        token = argv[i]
        j = i + 1
        while j < len(argv) and not _is_flag(argv[j]):
            j += 1
        values = argv[i + 1:j]
        name = token.partition("=")[0]
        if not _is_flag(token):  # values before the first flag
            problems.add("unknown", f"{' '.join(argv[i:j])} (a value that no flag takes)")
        elif name not in known:
            shown = " ".join([token, *values])
            hint = _suggest(name, known)
            if any(name.startswith(p) for p in _FAMILIES):
                problems.add("refused", f"{shown}: {hint}")
            else:
                problems.add("unknown", f"{shown} ({hint})" if hint else shown)
        else:
            taken = _consumes(known[name], token)
            extra = values[taken:] if taken is not None else []
            if extra:
                what = "takes no value" if taken == 0 else f"takes {taken} value{'s' * (taken > 1)}"
                problems.invalid(f"{' '.join([token, *values])}: {name} {what}")
        i = j


def parse_collecting(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, FlagProblems]:
    """Parse ``argv``; a flag argparse cannot take is recorded and left out (its default stays), and
    parsing goes on, so every such flag is found in one pass. Never prints the usage."""
    known = _option_strings(parser)
    argv = _normalise_spellings(list(argv), known)
    problems = FlagProblems()

    def fail(message: str):
        raise argparse.ArgumentError(None, message)

    parser.exit_on_error = False
    parser.error = fail  # argparse's own error() prints the usage and exits
    for _ in range(len(argv) + 1):
        try:
            namespace, extras = parser.parse_known_args(argv)
        except argparse.ArgumentError as e:
            options = (e.argument_name or "").split("/")
            if not any(o in known for o in options):  # not about one flag: report it as it is
                problems.invalid(e.message)
                return parser.parse_known_args([])[0], problems
            given = next(o for o in options if o in known)
            problems.invalid(f"{given}: {e.message}")
            shorter = _drop_flag(argv, [o for o in options if o in known])
            if shorter == argv:  # nothing left to drop: stop here with what was found
                return parser.parse_known_args([])[0], problems
            argv = shorter
            continue
        break
    if extras:
        _leftover_problems(argv, known, problems)
    return namespace, problems

"""The Megatron-LM flag table's upkeep.

``--rows``: build megatron-core's own parser (it must be installed) and print a ``CompatFlag`` row, with
megatron-core's type, default and choices, for every option string that this repository neither implements nor
lists in a ``flags/table_<topic>.py`` (paste each into its topic's table and write its reason).
``--write-list``: rewrite ``megatron_core_flags.txt`` (the parser's option strings) from the installed
megatron-core. ``--write-doc``: regenerate the flag table in ``docs/megatron-compat.md``.
"""
from __future__ import annotations

import argparse
import enum
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def megatron_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """megatron-core's own parser (``exit_on_error=False``: a bad value raises ``argparse.ArgumentError``)."""
    if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
        typing.override = lambda f: f
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=exit_on_error))


def compat_row(action: argparse.Action, flag: str) -> str:
    """A ``CompatFlag`` row for one of megatron-core's option strings (reason left to write)."""
    if action.nargs == 0:
        return f'CompatFlag("{flag}", "TODO: why"),'
    kind = action.type.__name__ if action.type in (int, float, str) else "str"
    default = action.default.name if isinstance(action.default, enum.Enum) else action.default
    choices = tuple(c.name if isinstance(c, enum.Enum) else c for c in action.choices) if action.choices else None
    return f'CompatFlag("{flag}", "TODO: why", {action.nargs!r}, {kind}, {default!r}' + \
        (f", {choices!r})," if choices else "),")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", action="store_true")
    p.add_argument("--write-list", action="store_true")
    p.add_argument("--write-doc", action="store_true")
    args = p.parse_args()
    from megatron_cai.training.arguments import build_parser
    from megatron_cai.training.flags import doc

    if args.rows or args.write_list:
        theirs = megatron_parser()
        options = {o: a for a in theirs._actions for o in a.option_strings if o.startswith("--")}
        if args.write_list:
            head = [line for line in doc.MEGATRON_FLAGS_FILE.read_text().splitlines() if line.startswith("#")]
            doc.MEGATRON_FLAGS_FILE.write_text("\n".join([*head, *sorted(options)]) + "\n")
        if args.rows:
            ours = {o for a in build_parser()._actions for o in a.option_strings}
            for flag, action in options.items():
                if flag not in ours:
                    print(compat_row(action, flag))
    if args.write_doc:
        path = ROOT / "docs" / "megatron-compat.md"
        path.write_text(doc.replace_generated(path.read_text(), doc.flag_table_markdown(build_parser())))


if __name__ == "__main__":
    main()

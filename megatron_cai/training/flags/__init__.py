"""Megatron-LM's command line beyond the parser in ``training/arguments.py``.

- ``report``: every problem of a command line (unknown, invalid, refused, conflicting, missing) in one report;
- ``rules``: Megatron's aliases, value rules and cross-flag checks;
- ``megatron_features``: Megatron-LM flag groups and features mapped onto this codebase's engines;
- ``megatron_compat``: Megatron-LM flags accepted as no-ops or refused with a reason.
"""

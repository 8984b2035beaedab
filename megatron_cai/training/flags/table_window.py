"""Megatron-LM's per-layer attention-window flags (refused until they land; that work replaces this file): the
flags of megatron-core 0.19.2's parser in this topic that are not implemented here, each accepted without
effect, mapped onto what runs here, or refused by name (the states: training/flags/table.py). Types, choices and
defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_WINDOW = "per-layer attention windows are not implemented here yet; --window-size applies to every layer"

TABLE = FlagTable(
    topic="window",
    no_op=[],
    mapped=[],
    refused=[
        CompatFlag("--window-attn-skip-freq", _WINDOW, None, str, None),
    ],
)

"""Megatron-LM's multi-latent attention and YaRN RoPE flags that MLA here (flags/kaiju.py) does not implement:
the flags of megatron-core 0.19.2's parser in this topic that are not implemented here, each accepted
without effect, mapped onto what runs here, or refused by name (the states: training/flags/table.py). Types,
choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_MLA = ("not implemented here: multi-latent attention runs with plain RoPE (--rope-type rope), an uncached "
        "latent and unfused projections")

TABLE = FlagTable(
    topic="mla",
    no_op=[],
    mapped=[],
    refused=[
        CompatFlag("--yarn-original-max-position-embeddings", _MLA, None, int, None),
        CompatFlag("--yarn-beta-fast", _MLA, None, float, None),
        CompatFlag("--yarn-beta-slow", _MLA, None, float, None),
        CompatFlag("--yarn-correction-range-round-to-int", _MLA),
        CompatFlag("--no-yarn-correction-range-round-to-int", _MLA),
        CompatFlag("--cache-mla-latents", _MLA),
        CompatFlag("--mla-down-proj-fusion", _MLA),
    ],
)

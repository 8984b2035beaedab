"""Megatron-LM's multi-latent attention and YaRN RoPE flags (refused until MLA lands; the MLA work replaces this
file): the flags of megatron-core 0.19.2's parser in this topic that are not implemented here, each accepted
without effect, mapped onto what runs here, or refused by name (the states: training/flags/table.py). Types,
choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_MLA = "multi-latent attention (and its YaRN RoPE) is not implemented here yet"

TABLE = FlagTable(
    topic="mla",
    no_op=[],
    mapped=[],
    refused=[
        CompatFlag("--multi-latent-attention", _MLA),
        CompatFlag("--yarn-original-max-position-embeddings", _MLA, None, int, None),
        CompatFlag("--yarn-beta-fast", _MLA, None, float, None),
        CompatFlag("--yarn-beta-slow", _MLA, None, float, None),
        CompatFlag("--yarn-correction-range-round-to-int", _MLA),
        CompatFlag("--no-yarn-correction-range-round-to-int", _MLA),
        CompatFlag("--rope-type", _MLA, None, str, None, ("rope", "yarn")),
        CompatFlag("--q-lora-rank", _MLA, None, int, None),
        CompatFlag("--kv-lora-rank", _MLA, None, int, 32),
        CompatFlag("--qk-head-dim", _MLA, None, int, 128),
        CompatFlag("--qk-pos-emb-head-dim", _MLA, None, int, 64),
        CompatFlag("--v-head-dim", _MLA, None, int, 128),
        CompatFlag("--rotary-scaling-factor", _MLA, None, float, 1.0),
        CompatFlag("--mscale", _MLA, None, float, 1.0),
        CompatFlag("--mscale-all-dim", _MLA, None, float, 0.0),
        CompatFlag("--cache-mla-latents", _MLA),
        CompatFlag("--mla-down-proj-fusion", _MLA),
    ],
)

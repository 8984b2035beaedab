"""Megatron-LM's hybrid Mamba, linear-attention and sparse-attention (DSA) flags: the flags of megatron-core
0.19.2's parser in this topic that are not implemented here, each accepted without effect, mapped onto what runs
here, or refused by name (the states: training/flags/table.py). Types, choices and defaults follow megatron-
core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_MTP = "multi-token prediction is not implemented here"
_HYBRID = "hybrid Mamba / linear-attention / sparse-attention layers are not implemented here (dense GPT only)"

TABLE = FlagTable(
    topic="hybrid",
    no_op=[],
    mapped=[],
    refused=[
        CompatFlag("--mtp-hybrid-override-pattern", _MTP, None, str, None),
        CompatFlag("--experimental-attention-variant", _HYBRID, None, str, None, ("gated_delta_net", "dsa")),
        CompatFlag("--dsa-indexer-n-heads", _HYBRID, None, int, None),
        CompatFlag("--dsa-indexer-head-dim", _HYBRID, None, int, None),
        CompatFlag("--dsa-indexer-topk", _HYBRID, None, int, None),
        CompatFlag("--dsa-indexer-topk-freq", _HYBRID, None, int, 1),
        CompatFlag("--dsa-indexer-skip-topk-offset", _HYBRID, None, int, 0),
        CompatFlag("--dsa-indexer-loss-coeff", _HYBRID, None, float, None),
        CompatFlag("--dsa-indexer-use-sparse-loss", _HYBRID),
        CompatFlag("--dsa-kernel-backend", _HYBRID, None, str, "none", ("none", "tilelang", "cudnn")),
        CompatFlag("--dsa-indexer-rope-interleaved", _HYBRID),
        CompatFlag("--no-dsa-indexer-rotate-activation", _HYBRID),
        CompatFlag("--disable-dsa-indexer-rotate-activation", _HYBRID),
        CompatFlag("--no-dsa-indexer-scoring-relu", _HYBRID),
        CompatFlag("--disable-dsa-indexer-scoring-relu", _HYBRID),
        CompatFlag("--dsa-indexer-k-norm-epsilon", _HYBRID, None, float, None),
        CompatFlag("--dsa-indexer-k-norm-fp32", _HYBRID),
        CompatFlag("--linear-conv-kernel-dim", _HYBRID, None, int, 4),
        CompatFlag("--linear-key-head-dim", _HYBRID, None, int, 128),
        CompatFlag("--linear-value-head-dim", _HYBRID, None, int, 128),
        CompatFlag("--linear-num-key-heads", _HYBRID, None, int, 16),
        CompatFlag("--linear-num-value-heads", _HYBRID, None, int, 32),
        CompatFlag("--is-hybrid-model", _HYBRID),
        CompatFlag("--mamba-state-dim", _HYBRID, None, int, 128),
        CompatFlag("--mamba-head-dim", _HYBRID, None, int, 64),
        CompatFlag("--mamba-num-groups", _HYBRID, None, int, 8),
        CompatFlag("--mamba-num-heads", _HYBRID, None, int, None),
        CompatFlag("--disable-mamba-mem-eff-path", _HYBRID),
        CompatFlag("--mamba-training-ssm-states-dtype", _HYBRID, None, str, None, ("fp32", "bf16")),
        CompatFlag("--linear-attention-freq", _HYBRID, None, str, None),
        CompatFlag("--inference-dynamic-batching-mamba-memory-ratio", _HYBRID, None, float, None),
        CompatFlag("--inference-dynamic-batching-prefix-caching-mamba-gb", _HYBRID, None, float, None),
        CompatFlag("--mamba-inference-conv-states-dtype", _HYBRID, None, str, "bf16", ("bf16", "fp16", "fp32")),
        CompatFlag("--mamba-inference-ssm-states-dtype", _HYBRID, None, str, "bf16", ("bf16", "fp16", "fp32")),
        CompatFlag("--hybrid-layer-pattern", _HYBRID, None, str, None),
        CompatFlag("--hybrid-override-pattern", _HYBRID, None, str, None),
    ],
)

"""Megatron-LM's Mixture-of-Experts flags that MoE here (flags/moe.py) does not implement: the flags of
megatron-core 0.19.2's parser in this topic that are not implemented here, each accepted without effect, mapped
onto what runs here, or refused by name (the states: training/flags/table.py). Types, choices and defaults
follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_MOE = "this Mixture-of-Experts option is not implemented here (docs/moe.md lists those that are)"
_RL = "reinforcement learning (GRPO) is not implemented here"

TABLE = FlagTable(
    topic="moe",
    no_op=[],
    mapped=[],
    refused=[
        CompatFlag("--expert-tensor-parallel-num-weight-shards", _MOE, None, int, None),
        CompatFlag("--overlap-moe-expert-parallel-comm", _MOE),
        CompatFlag("--overlap-dispatch-backward-with-experts-wgrad", _MOE),
        CompatFlag("--ep-overlap-early-attn-memory-release", _MOE),
        CompatFlag("--use-grouped-gemm-for-shared-expert", _MOE),
        CompatFlag("--moe-shared-expert-glu-interleave-size", _MOE, None, int, None),
        CompatFlag("--moe-enable-routing-replay", _MOE),
        CompatFlag("--moe-router-padding-for-quantization", _MOE),
        CompatFlag("--moe-router-padding-for-fp8", _MOE),
        CompatFlag("--moe-router-quantile-balancing-ema", _MOE, None, float, 0.0),
        CompatFlag("--moe-router-force-load-balancing", _MOE),
        CompatFlag("--moe-router-force-biased", _MOE, None, float, None),
        CompatFlag("--moe-single-grouped-weight", _MOE),
        CompatFlag("--moe-single-grouped-bias", _MOE),
        CompatFlag("--moe-enable-deepep", _MOE),
        CompatFlag("--moe-flex-dispatcher-backend", _MOE, None, str, "deepep", ("deepep", "hybridep", "ncclep")),
        CompatFlag("--moe-permute-fusion-into-hybridep", _MOE),
        CompatFlag("--moe-hybridep-pad-uneven-dispatch-inputs", _MOE),
        CompatFlag("--moe-pad-experts-for-cuda-graph-inference", _MOE),
        CompatFlag("--moe-layer-recompute", _MOE),
        CompatFlag("--moe-apply-probs-on-input", _MOE),
        CompatFlag("--moe-latent-size", _MOE, None, int, None),
        CompatFlag("--moe-flex-dispatcher-num-sms", _MOE, None, int, None),
        CompatFlag("--moe-deepep-num-sms", _MOE, None, int, None),
        CompatFlag("--moe-hybridep-num-sms", _MOE, None, int, None),
        CompatFlag("--moe-hybridep-num-blocks-permute", _MOE, None, int, None),
        CompatFlag("--moe-hybridep-num-blocks-unpermute", _MOE, None, int, None),
        CompatFlag("--moe-hybridep-num-sms-preprocessing", _MOE, None, int, 108),
        CompatFlag("--moe-ncclep-static-shape", _MOE),
        CompatFlag("--moe-ncclep-zero-copy", _MOE),
        CompatFlag("--moe-mlp-glu-interleave-size", _MOE, None, int, None),
        CompatFlag("--moe-expert-rank-capacity-factor", _MOE, None, float, None),
        CompatFlag(
            "--inference-moe-disable-fused-quant-kernels", "the fast paths of Megatron's inference are not used here"
        ),
        CompatFlag("--inference-moe-token-dispatcher-type", _MOE, None, str, "nvls", ("nccl", "nvls")),
        CompatFlag("--moe-paged-stash", _MOE),
        CompatFlag("--moe-paged-stash-page-size", _MOE, None, int, 64),
        CompatFlag("--moe-paged-stash-buffer-size-factor-cuda", _MOE, None, float, 1.1),
        CompatFlag("--moe-paged-stash-buffer-size-factor-cpu", _MOE, None, float, 0.0),
        CompatFlag("--rl-inference-expert-model-parallel-size", _RL, None, int, None),
        CompatFlag("--rl-inference-expert-tensor-model-parallel-size", _RL, None, int, None),
        CompatFlag("--save-tokens-per-expert-interval", _MOE, None, int, None),
        CompatFlag("--moe-use-upcycling", _MOE),
        CompatFlag("--moe-upcycling-granularity", _MOE, None, int, 1),
        CompatFlag("--moe-routing-trace-path", _MOE, None, str, None),
        CompatFlag("--moe-routing-trace-max-training-iters", _MOE, None, int, None),
        CompatFlag("--moe-routing-trace-capture-logits", _MOE),
        CompatFlag("--moe-routing-trace-capture-hidden-states", _MOE),
        CompatFlag("--moe-routing-trace-dump-weights", _MOE),
    ],
)

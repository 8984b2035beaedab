"""Megatron-LM's model, precision and kernel flags (megatron-core's transformer configuration, network size,
regularization, mixed precision and Transformer-Engine groups): the flags of megatron-core 0.19.2's parser in
this topic that are not implemented here, each accepted without effect, mapped onto what runs here, or refused
by name (the states: training/flags/table.py). Types, choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_FUSION = "a kernel-fusion / launch switch of Megatron's CUDA kernels; the same math runs here either way"
_TE_COMM = "a Transformer Engine userbuffer overlap knob for TP communication; the same math runs here"
_SCHED = "a communication / scheduling overlap knob; the same computation runs here in the same order"
_NOT_YET = "not implemented here"
_MTP = "multi-token prediction is not implemented here"
_OFFLOAD = "an activation / optimizer memory-offloading knob; tensors stay on the device here, with the same math"
_FSDP = (
    "a Megatron-FSDP tuning knob (buffers, NCCL registration, meta-device init); --use-megatron-fsdp runs "
    "on PyTorch FSDP2 here, which manages its own buffers"
)
_TE_FP8 = "a Transformer Engine FP8 knob; --fp8-format runs our FP8 QAT (dynamic clamps) here"
_FP4 = "FP4 training is not implemented here; --fp8-format runs FP8 QAT"
_CUDA_GRAPH = "CUDA graph capture is a launch optimisation; kernels run eagerly here, with the same math"
_INFERENCE = "a setting of Megatron's inference engine; pretraining runs no inference engine here"
_T5 = "encoder-decoder (T5 / BERT) models are not implemented here (GPT only)"
_BIENCODER = "BERT / ICT / REALM retrieval models are not implemented here (GPT only)"
_MUON = "the optimizers here are adam and sgd (--optimizer)"

_CP_COMM = (
    "context-parallel attention here exchanges only the key/value chunks that some query sees (one scheme for "
    "every value; the result is the exact attention each of Megatron's schemes computes)"
)

TABLE = FlagTable(
    topic="model",
    no_op=[
        CompatFlag("--mup-width-mult", "recomputed as --hidden-size / --mup-base-hidden-size under --use-mup, as "
                   "megatron-core's TransformerConfig overwrites it (no effect there either)", None, float, 1.0),
        CompatFlag(
            "--pipeline-model-parallel-comm-backend",
            ("point-to-point pipeline transfers use the run's process-group backend (--distributed- backend)"),
            None,
            str,
            None,
            ("nccl", "ucc"),
        ),
        CompatFlag(
            "--no-initialization",
            ("weights are initialised from the seeded full tensors here (cheap next to a --load, which replaces them)"),
        ),
        CompatFlag("--use-cpu-initialization", "weights are initialised from the same seeded full tensors either way"),
        CompatFlag("--tp-comm-overlap", _FUSION),
        CompatFlag("--no-tp-comm-bulk-wgrad", _TE_COMM),
        CompatFlag("--disable-tp-comm-bulk-wgrad", _TE_COMM),
        CompatFlag("--no-tp-comm-bulk-dgrad", _TE_COMM),
        CompatFlag("--disable-tp-comm-bulk-dgrad", _TE_COMM),
        CompatFlag("--no-tp-comm-overlap-ag", _TE_COMM),
        CompatFlag("--disable-tp-comm-overlap-ag", _TE_COMM),
        CompatFlag("--no-tp-comm-overlap-rs", _TE_COMM),
        CompatFlag("--disable-tp-comm-overlap-rs", _TE_COMM),
        CompatFlag("--tp-comm-overlap-rs-dgrad", _TE_COMM),
        CompatFlag("--no-tp-comm-split-ag", _TE_COMM),
        CompatFlag("--disable-tp-comm-split-ag", _TE_COMM),
        CompatFlag("--no-tp-comm-split-rs", _TE_COMM),
        CompatFlag("--disable-tp-comm-split-rs", _TE_COMM),
        CompatFlag("--cross-entropy-loss-fusion", _FUSION),
        CompatFlag("--cross-entropy-fusion-impl", _FUSION, None, str, "native", ("native", "te")),
        CompatFlag("--tp-comm-bootstrap-backend", _TE_COMM, None, str, "nccl", ("nccl", "mpi", "gloo")),
        CompatFlag("--delay-wgrad-compute", _SCHED),
        CompatFlag("--use-ring-exchange-p2p", _SCHED),
        CompatFlag("--defer-embedding-wgrad-compute", _FUSION),
        CompatFlag("--wgrad-deferral-limit", _SCHED, None, int, 0),
        CompatFlag("--overlap-p2p-communication-warmup-flush", _SCHED),
        CompatFlag("--cpu-offloading-num-layers", _OFFLOAD, None, int, 0),
        CompatFlag("--cpu-offloading-retain-pinned-cpu-buffers", _OFFLOAD),
        CompatFlag("--flash-attention-version", _FUSION, None, int, None, (2, 3, 4)),
        CompatFlag("--init-model-with-meta-device", _FSDP),
        CompatFlag("--apply-query-key-layer-scaling", "with an fp32 softmax the result is mathematically the same"),
        CompatFlag("--use-fused-weighted-squared-relu", _FUSION),
        CompatFlag("--fused-residual-rmsnorm", _FUSION),
        CompatFlag("--use-transformer-engine-op-fuser", _FUSION),
        CompatFlag(
            "--fp8-margin",
            (
                "a Transformer Engine delayed-scaling knob; --fp8-format runs our FP8 QAT (dynamic clamps), "
                "which has no amax history"
            ),
            None,
            int,
            0,
        ),
        CompatFlag(
            "--fp8-interval",
            (
                "a Transformer Engine delayed-scaling knob; --fp8-format runs our FP8 QAT (dynamic clamps), "
                "which has no amax history"
            ),
            None,
            int,
            1,
        ),
        CompatFlag(
            "--fp8-amax-history-len",
            (
                "a Transformer Engine delayed-scaling knob; --fp8-format runs our FP8 QAT (dynamic clamps), "
                "which has no amax history"
            ),
            None,
            int,
            1,
        ),
        CompatFlag(
            "--fp8-amax-compute-algo",
            (
                "a Transformer Engine delayed-scaling knob; --fp8-format runs our FP8 QAT (dynamic clamps), "
                "which has no amax history"
            ),
            None,
            str,
            "most_recent",
            ("most_recent", "max"),
        ),
        CompatFlag("--no-fp8-wgrad", _TE_FP8),
        CompatFlag("--disable-fp8-wgrad", _TE_FP8),
        CompatFlag("--use-kitchen-attention", _FUSION),
        CompatFlag("--kitchen-attention-backend", _FUSION, None, str, "sdpa", ("sdpa", "fa")),
        CompatFlag("--high-priority-a2a-comm-stream", _SCHED),
        CompatFlag("--use-grouped-gemm-for-dense-mlp", _FUSION),
        CompatFlag("--enable-cuda-graph", _CUDA_GRAPH),
        CompatFlag("--cuda-graph-warmup-steps", _CUDA_GRAPH, None, int, 3),
        CompatFlag("--external-cuda-graph", _CUDA_GRAPH),
        CompatFlag(
            "--cuda-graph-impl",
            _CUDA_GRAPH,
            None,
            str,
            "none",
            ("none", "local", "transformer_engine", "full_iteration"),
        ),
        CompatFlag("--inference-cuda-graph-scope", _INFERENCE, None, str, None, ("none", "layer", "block")),
        CompatFlag("--no-clone-scatter-output-in-embedding", _FUSION),
        CompatFlag("--disable-clone-scatter-output-in-embedding", _FUSION),
        CompatFlag(
            "--config-logger-dir",
            "no config dumps here; the start-up log prints the resolved configuration",
            None,
            str,
            "",
        ),
        CompatFlag("--flash-decode", _INFERENCE),
        CompatFlag("--use-te-activation-func", _FUSION),
        CompatFlag("--symmetric-ar-type", _INFERENCE, None, str, None, ("two_shot", "one_shot", "multimem_all_reduce")),
        CompatFlag("--nccl-all-reduce-for-prefill", _INFERENCE),
        CompatFlag("--inference-fuse-tp-communication", _INFERENCE),
        CompatFlag("--inference-disable-triton-nvls-kernels", _INFERENCE),
        CompatFlag("--inference-grouped-gemm-backend", _INFERENCE, None, str, "vllm", ("flashinfer", "torch", "vllm")),
        CompatFlag(
            "--mlp-chunks-for-prefill",
            "the sequence-chunked MLP computes the same result; the MLP runs unchunked here",
            None,
            int,
            1,
        ),
        CompatFlag(
            "--mlp-chunks-for-training",
            "the sequence-chunked MLP computes the same result; the MLP runs unchunked here",
            None,
            int,
            1,
        ),
        CompatFlag("--fine-grained-activation-offloading", _OFFLOAD),
        CompatFlag("--offload-modules", _OFFLOAD, "+", str, []),
        CompatFlag("--min-offloaded-tensor-size", _OFFLOAD, None, int, 1048576),
        CompatFlag("--delay-offload-until-cuda-graph", _OFFLOAD),
        CompatFlag("--delta-offload-bytes-across-pp-ranks", _OFFLOAD, None, int, 0),
        CompatFlag("--activation-offload-fraction", _OFFLOAD, None, float, 1.0),
        CompatFlag("--fine-grained-offloading-max-inflight-offloads", _OFFLOAD, None, int, None),
        CompatFlag("--onnx-safe", "no ONNX export here", None, bool, None),
        CompatFlag("--te-rng-tracker", _FUSION),
        CompatFlag("--inference-rng-tracker", _INFERENCE),
        CompatFlag("--attention-softmax-in-fp32", "the softmax always runs in fp32"),
        CompatFlag(
            "--accumulate-allreduce-grads-in-fp32",
            "gradients always accumulate and reduce in fp32 (unless --grad-reduce-in-bf16)",
        ),
        CompatFlag("--reuse-grad-buf-for-mxfp8-param-ag", _FUSION),
        CompatFlag("--fp8-param-gather", "parameters are gathered in their training dtype"),
    ],
    mapped=[
        CompatFlag(
            "--fp8-recipe",
            "delayed: FP8 QAT with its clamp rules (--qat-clamp); tensorwise: per-tensor current scaling, FP8 QAT "
            "with --qat-clamp absmax --qat-granularity tensor and per-tensor weight scales; mxfp8, blockwise and "
            "custom are refused",
            None,
            str,
            "delayed",
            ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
        ),
        CompatFlag("--hierarchical-context-parallel-sizes", _CP_COMM, "+", int, None),
        CompatFlag(
            "--no-weight-decay-cond-type",
            "same as --apply-wd-to-qk-layernorm",
            None,
            str,
            None,
            ("apply_wd_to_qk_layernorm",),
        ),
    ],
    refused=[
        CompatFlag(
            "--tensor-parallel-num-weight-shards",
            "uneven tensor-parallel weight sharding is not implemented here",
            None,
            int,
            None,
        ),
        CompatFlag(
            "--max-seqlen-per-dp-cp-rank",
            "per-rank sequence budgets for variable-length CP are not implemented here",
            None,
            int,
            None,
        ),
        CompatFlag(
            "--hybrid-context-parallel",
            "hybrid (dynamic) context parallelism is not implemented here; --context-parallel-size is",
        ),
        CompatFlag("--mtp-standalone", _MTP),
        CompatFlag("--mtp-num-layers", _MTP, None, int, None),
        CompatFlag("--mtp-loss-scaling-factor", _MTP, None, float, 0.1),
        CompatFlag("--mtp-use-repeated-layer", _MTP),
        CompatFlag("--mtp-detach-heads", _MTP),
        CompatFlag(
            "--softmax-type",
            "only the standard softmax is implemented here",
            None,
            str,
            "vanilla",
            ("vanilla", "off-by-one", "learnable"),
            allowed=("vanilla",),
        ),
        CompatFlag(
            "--fp32-residual-connection",
            "residuals stay in the activation dtype here (fp32 master weights, autocast activations)",
        ),
        CompatFlag(
            "--apply-residual-connection-post-layernorm", "the pre-norm residual ordering (GPT) is the only one here"
        ),
        CompatFlag("--glu-linear-offset", "the GLU runs without an offset here", None, float, 0.0, allowed=(0.0,)),
        CompatFlag("--activation-func-clamp-value", "activation clamping is not implemented here", None, float, None),
        CompatFlag("--qk-l2-norm", "not implemented here; --qk-layernorm is"),
        CompatFlag("--qk-clip", "QK-clip (for Muon) is not implemented here"),
        CompatFlag("--qk-clip-alpha", "QK-clip (for Muon) is not implemented here", None, float, 0.5),
        CompatFlag("--qk-clip-threshold", "QK-clip (for Muon) is not implemented here", None, float, 100),
        CompatFlag(
            "--embedding-init-method-std",
            ("a separate embedding init std is not implemented here (--init-method-std applies to every weight)"),
            None,
            float,
            None,
        ),
        CompatFlag(
            "--disable-bf16-reduced-precision-matmul",
            "bf16 GEMMs use PyTorch's default reduced-precision reduction here",
        ),
        CompatFlag(
            "--distribute-saved-activations", "distributing recomputed-layer inputs over TP is not implemented here"
        ),
        CompatFlag(
            "--recompute-modules",
            "selective recompute covers core attention only",
            "+",
            str,
            None,
            allowed=(["core_attn"],),
        ),
        CompatFlag("--fp8-quantizer-factory", "no code is imported from a flag here", None, str, None),
        CompatFlag("--fp8-output-proj", "the output projection runs in the training dtype here"),
        CompatFlag(
            "--first-last-layers-bf16", "every layer runs FP8 QAT with --fp8-format here; no bf16 first/last layers"
        ),
        CompatFlag(
            "--num-layers-at-start-in-bf16",
            "every layer runs FP8 QAT with --fp8-format here; no bf16 first/last layers",
            None,
            int,
            1,
        ),
        CompatFlag(
            "--num-layers-at-end-in-bf16",
            "every layer runs FP8 QAT with --fp8-format here; no bf16 first/last layers",
            None,
            int,
            1,
        ),
        CompatFlag("--fp4-format", _FP4, None, str, None, ("e2m1",), allowed=("nvfp4",)),
        CompatFlag("--fp4-recipe", _FP4, None, str, "nvfp4", ("nvfp4", "custom"), allowed=("nvfp4",)),
        CompatFlag("--fp4-quantizer-factory", "no code is imported from a flag here", None, str, None),
        CompatFlag(
            "--batch-invariant-mode",
            (
                "batch-invariant kernels are not implemented here; --deterministic-mode gives run-to-run "
                "identical results"
            ),
        ),
        CompatFlag("--mrope-section", "multimodal RoPE is not implemented here", "+", int, None),
        CompatFlag("--encoder-num-layers", _T5, None, int, None),
        CompatFlag("--decoder-num-layers", _T5, None, int, None),
        CompatFlag("--relative-attention-num-buckets", _T5, None, int, 32),
        CompatFlag("--relative-attention-max-distance", _T5, None, int, 128),
        CompatFlag(
            "--rotary-seq-len-interpolation-factor",
            "RoPE position interpolation is not implemented here",
            None,
            int,
            None,
            allowed=(1,),
        ),
        CompatFlag("--no-rope-freq", "RoPE is applied on every layer here", None, str, None),
        CompatFlag("--quick-geglu", "quick GeGLU is not implemented here; --activation chooses the MLP activation"),
        CompatFlag("--bert-no-binary-head", _BIENCODER),
        CompatFlag("--muon-momentum", _MUON, None, float, 0.9),
        CompatFlag("--muon-no-split-qkv", _MUON),
        CompatFlag("--muon-nesterov", _MUON),
        CompatFlag("--muon-scale-mode", _MUON, None, str, "spectral", ("spectral", "unit_rms_norm", "shape_scaling")),
        CompatFlag("--muon-fp32-matmul-prec", _MUON, None, str, "medium", ("low", "medium", "high")),
        CompatFlag("--muon-coefficient-type", _MUON, None, str, "quintic"),
        CompatFlag("--muon-num-ns-steps", _MUON, None, int, 5),
        CompatFlag("--muon-tp-mode", _MUON, None, str, "blockwise", ("blockwise", "duplicated", "distributed")),
        CompatFlag("--muon-extra-scale-factor", _MUON, None, float, 1.0),
        CompatFlag("--muon-scalar-optimizer", _MUON, None, str, "adam", ("adam", "lion")),
        CompatFlag("--lion-beta1", _MUON, None, float, 0.95),
        CompatFlag("--lion-beta2", _MUON, None, float, 0.98),
        CompatFlag("--data-parallel-random-init", "all data-parallel ranks start from the same weights here"),
        CompatFlag("--init-method-xavier-uniform", _NOT_YET),
        CompatFlag("--fp16-lm-cross-entropy", "the cross entropy runs in fp32 here"),
        CompatFlag("--fp4-param-gather", _FP4, allowed=("nvfp4",)),
        CompatFlag(
            "--te-precision-config-file",
            "--te-precision-config-file: per-module precision overrides are not implemented here",
            None,
            str,
            None,
        ),
    ],
)

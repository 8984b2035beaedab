"""Megatron-LM's distributed-initialisation and data-parallel flags: the flags of megatron-core 0.19.2's parser in
this topic that are not implemented here, each accepted without effect, mapped onto what runs here, or refused
by name (the states: training/flags/table.py). Types, choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_FUSION = "a kernel-fusion / launch switch of Megatron's CUDA kernels; the same math runs here either way"
_NCCL_TUNE = "an NCCL / network tuning knob; the collectives compute the same result here"
_SCHED = "a communication / scheduling overlap knob; the same computation runs here in the same order"
_FLIGHT = (
    "the NCCL flight recorder is configured by PyTorch's TORCH_FR_* / TORCH_NCCL_* environment variables "
    "here; set them in the launcher"
)
_DEPRECATED = "deprecated in Megatron-LM, which rejects it too"
_FSDP = (
    "a Megatron-FSDP tuning knob (buffers, NCCL registration, meta-device init); --use-megatron-fsdp runs "
    "on PyTorch FSDP2 here, which manages its own buffers"
)

_CP_COMM = (
    "context-parallel attention here exchanges only the key/value chunks that some query sees (one scheme for "
    "every value; the result is the exact attention each of Megatron's schemes computes)"
)

TABLE = FlagTable(
    topic="parallel",
    no_op=[
        CompatFlag("--no-align-grad-reduce", _FUSION),
        CompatFlag("--disable-align-grad-reduce", "same as --no-align-grad-reduce"),
        CompatFlag("--local-rank", "ranks come from torchrun's / Slurm's environment variables", None, int, 0),
        CompatFlag("--nccl-communicator-config-path", "NCCL communicator tuning is not applied", None, str, None),
        CompatFlag("--use-sharp", _NCCL_TUNE),
        CompatFlag("--sharp-enabled-group", _NCCL_TUNE, None, str, None, ("dp", "dp_replica")),
        CompatFlag("--high-priority-stream-groups", _SCHED, "+", str, []),
        CompatFlag(
            "--distributed-timeout-seconds-after-init",
            "the collective timeout stays --distributed-timeout-minutes for the whole run",
            None,
            int,
            None,
        ),
        CompatFlag("--flight-recorder-dump-path", _FLIGHT, None, str, None),
        CompatFlag("--flight-recorder-trace-buffer-size", _FLIGHT, None, int, 2000),
        CompatFlag("--no-flight-recorder-dump-on-timeout", _FLIGHT),
        CompatFlag("--disable-flight-recorder-dump-on-timeout", _FLIGHT),
        CompatFlag("--flight-recorder-include-stack-trace", _FLIGHT),
        CompatFlag("--no-flight-recorder-include-only-active", _FLIGHT),
        CompatFlag("--disable-flight-recorder-include-only-active", _FLIGHT),
        CompatFlag("--no-flight-recorder-extra-dump-on-exec", _FLIGHT),
        CompatFlag("--disable-flight-recorder-extra-dump-on-exec", _FLIGHT),
        CompatFlag("--disable-jit-fuser", _FUSION),
        CompatFlag("--no-overlap-p2p-communication", _SCHED),
        CompatFlag(
            "--ddp-num-buckets",
            "gradient buckets are sized by --ddp-bucket-size here; bucketing does not change the result",
            None,
            int,
            None,
        ),
        CompatFlag("--ddp-pad-buckets-for-high-nccl-busbw", _NCCL_TUNE),
        CompatFlag(
            "--ddp-param-name-patterns-for-fp32-local-accumulation",
            "every parameter's gradient accumulates in fp32 here",
            "+",
            str,
            [],
        ),
        CompatFlag("--ddp-average-in-collective", "gradients are averaged over data-parallel ranks either way"),
        CompatFlag("--no-align-param-gather", _SCHED),
        CompatFlag("--no-use-layer-wise-param-layout", _NCCL_TUNE),
        CompatFlag("--use-nccl-ub", _FSDP),
        CompatFlag("--disable-symmetric-registration", _NCCL_TUNE),
        CompatFlag("--fsdp-manual-registration", _FSDP),
        CompatFlag("--create-all-gather-group", _SCHED),
        CompatFlag("--no-gradient-reduce-div-fusion", _FUSION),
        CompatFlag("--fsdp-double-buffer", _FSDP),
        CompatFlag("--suggested-communication-unit-size", _FSDP, None, int, None),
        CompatFlag("--keep-fp8-transpose-cache", _FSDP),
        CompatFlag("--torch-fsdp2-no-reshard-after-forward", _FSDP),
    ],
    mapped=[
        CompatFlag(
            "--overlap-param-gather-with-optimizer-step",
            "the distributed optimizer's all-gather starts at --overlap-param-gather's points and each forward "
            "waits for its bucket: the same parameters, gathered at another time",
        ),
        CompatFlag(
            "--num-distributed-optimizer-instances",
            "one distributed-optimizer instance sharded over all DP x CP ranks: the update of N instances, with "
            "less optimizer memory per rank",
            None,
            int,
            1,
        ),
        CompatFlag("--cp-comm-type", _CP_COMM, "+", str, ["p2p"]),
        CompatFlag(
            "--disable-gloo-process-groups",
            ("the only Gloo group here is the --async-save writer's; none is created without --async- save"),
        ),
        CompatFlag(
            "--ddp-reduce-scatter-with-fp32-accumulation",
            "gradients are reduced in fp32 here (unless --grad-reduce-in-bf16)",
        ),
    ],
    refused=[
        CompatFlag("--lazy-mpu-init", "process groups are created at start-up here"),
        CompatFlag(
            "--pipeline-model-parallel-layout",
            (
                "custom pipeline layouts are not implemented here; --decoder-first/last-pipeline-num-layers "
                "and --account-for-embedding/loss-in-pipeline-split are"
            ),
            None,
            str,
            None,
        ),
        CompatFlag("--model-parallel-size", _DEPRECATED, None, int, None),
        CompatFlag(
            "--outer-dp-sharding-strategy",
            "hybrid-sharded data parallelism is not implemented here",
            None,
            str,
            "no_shard",
            ("no_shard", "optim"),
            allowed=("no_shard",),
        ),
        CompatFlag(
            "--enable-full-sharding-in-hsdp",
            "hybrid-sharded data parallelism is not implemented here",
            allowed=("no_shard",),
        ),
        CompatFlag("--fake-process-group", "fake process groups are not supported here"),
    ],
)

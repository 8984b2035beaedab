"""Megatron-LM's checkpointing flags: the flags of megatron-core 0.19.2's parser in this topic that are not
implemented here, each accepted without effect, mapped onto what runs here, or refused by name (the states:
training/flags/table.py). Types, choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_DEBUG_DUMP = "debug dumps of parameters / activations / gradients are not implemented here"
_DIST_CKPT = "a Megatron-LM dist_checkpointing knob; --ckpt-format torch_dist here is torch.distributed.checkpoint"
_LOCAL_CKPT = "local (node-replicated) checkpoints are not implemented here; use --non-persistent-ckpt-type global"
_DEPRECATED = "deprecated in Megatron-LM, which rejects it too"

TABLE = FlagTable(
    topic="checkpoint",
    no_op=[
        CompatFlag(
            "--load-main-params-from-ckpt",
            "main parameters (fp32) always load from the checkpoint's optimizer state here",
        ),
        CompatFlag(
            "--no-use-tokenizer-model-from-checkpoint-args",
            "the tokenizer always comes from the flags here, never from a checkpoint's args",
        ),
        CompatFlag(
            "--disable-use-tokenizer-model-from-checkpoint-args",
            "the tokenizer always comes from the flags here, never from a checkpoint's args",
        ),
        CompatFlag("--ckpt-convert-update-legacy-dist-opt-format", _DIST_CKPT),
        CompatFlag("--no-ckpt-fully-parallel-save", _DIST_CKPT),
        CompatFlag(
            "--use-persistent-ckpt-worker",
            "--async-save writes from a background thread here; there is no worker process to keep",
        ),
        CompatFlag("--async-ckpt-cpu-priority", _DIST_CKPT, None, int, 10),
        CompatFlag("--async-ckpt-io-priority", _DIST_CKPT, None, int, 3),
        CompatFlag("--async-ckpt-use-cpu-shm", _DIST_CKPT),
        CompatFlag("--ckpt-fully-parallel-load", _DIST_CKPT),
        CompatFlag(
            "--ckpt-fully-parallel-load-exchange-algo",
            _DIST_CKPT,
            None,
            str,
            "broadcast",
            ("broadcast", "gather_rounds", "gather_object"),
        ),
        CompatFlag("--ckpt-fully-parallel-save-process-group", _DIST_CKPT, None, str, "dp", ("dp", "ep_dp")),
        CompatFlag("--ckpt-fully-parallel-load-process-group", _DIST_CKPT, None, str, "dp", ("dp", "ep_dp")),
        CompatFlag("--ckpt-assume-constant-structure", _DIST_CKPT),
        CompatFlag("--no-ckpt-load-validate-sharding-integrity", _DIST_CKPT),
        CompatFlag("--disable-ckpt-load-validate-sharding-integrity", _DIST_CKPT),
        CompatFlag(
            "--dist-ckpt-strictness",
            _DIST_CKPT,
            None,
            str,
            "assume_ok_unexpected",
            (
                "assume_ok_unexpected",
                "log_unexpected",
                "log_all",
                "raise_unexpected",
                "raise_all",
                "return_unexpected",
                "return_all",
                "ignore_all",
            ),
        ),
        CompatFlag("--dist-ckpt-save-pre-mcore-014", _DIST_CKPT),
        CompatFlag("--distrib-optim-fully-reshardable-mem-efficient", _DIST_CKPT),
        CompatFlag("--no-stream-ckpt-dequant", _DIST_CKPT),
        CompatFlag("--disable-stream-ckpt-dequant", _DIST_CKPT),
        CompatFlag("--use-dist-ckpt", "deprecated in Megatron-LM too; see --ckpt-format"),
        CompatFlag("--dist-ckpt-workers", _DIST_CKPT, None, int, 1),
        CompatFlag("--ckpt-fully-parallel-save", _DIST_CKPT),
    ],
    mapped=[
        CompatFlag(
            "--async-strategy",
            ("checkpoint writes of --async-save run in a background thread here (no NVRx / mcore worker process)"),
            None,
            str,
            "nvrx",
            ("nvrx", "mcore"),
        ),
        CompatFlag(
            "--dist-ckpt-optim-fully-reshardable",
            ("torch_dist optimizer state is saved per parameter here and reshards across TP / PP / DP on load"),
        ),
        CompatFlag(
            "--verify-integrity",
            "every checkpoint file is hashed when saved and verified when loaded here (checksums.json)",
        ),
    ],
    refused=[
        CompatFlag("--save-params-interval", _DEBUG_DUMP, None, int, None),
        CompatFlag("--save-activations-interval", _DEBUG_DUMP, None, int, None),
        CompatFlag("--save-wgrads-interval", _DEBUG_DUMP, None, int, None),
        CompatFlag("--save-dgrads-interval", _DEBUG_DUMP, None, int, None),
        CompatFlag("--pretrained-checkpoint", "use --load with --finetune", None, str, None),
        CompatFlag("--use-checkpoint-args", "pass the model flags explicitly; they are checked against the checkpoint"),
        CompatFlag(
            "--use-mp-args-from-checkpoint-args",
            "pass the parallel sizes explicitly; torch_dist checkpoints load into any layout",
        ),
        CompatFlag(
            "--ckpt-convert-format", "use tools/convert_checkpoint.py", None, str, None, ("torch", "torch_dist")
        ),
        CompatFlag("--ckpt-convert-save", "use tools/convert_checkpoint.py", None, str, None),
        CompatFlag("--no-strict-fsdp-dtensor-load", "FSDP DTensor checkpoints always load strictly here"),
        CompatFlag("--disable-strict-fsdp-dtensor-load", "FSDP DTensor checkpoints always load strictly here"),
        CompatFlag("--replication", _LOCAL_CKPT, allowed=(2,)),
        CompatFlag("--replication-jump", _LOCAL_CKPT, None, int, None, allowed=(2,)),
        CompatFlag("--replication-factor", _LOCAL_CKPT, None, int, 2, allowed=(2,)),
        CompatFlag("--no-save-rng", "the RNG state is always saved (resume is bit-exact)"),
        CompatFlag(
            "--override-ckpt-iteration",
            "the iteration comes from the checkpoint here; use --finetune to start at 0",
            None,
            int,
            None,
        ),
        CompatFlag("--dist-ckpt-format", _DEPRECATED, None, str, None),
    ],
)

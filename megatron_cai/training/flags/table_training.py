"""Megatron-LM's training, learning-rate, validation, data and tokenizer flags: the flags of megatron-core 0.19.2's
parser in this topic that are not implemented here, each accepted without effect, mapped onto what runs here, or
refused by name (the states: training/flags/table.py). Types, choices and defaults follow megatron-core's."""

from __future__ import annotations

from .table import CompatFlag, FlagTable

_DEPRECATED = "deprecated in Megatron-LM, which rejects it too"
_TE_COMM = "a Transformer Engine userbuffer overlap knob for TP communication; the same math runs here"
_FUSION = "a kernel-fusion / launch switch of Megatron's CUDA kernels; the same math runs here either way"
_OFFLOAD = "an activation / optimizer memory-offloading knob; tensors stay on the device here, with the same math"
_CUDA_GRAPH = "CUDA graph capture is a launch optimisation; kernels run eagerly here, with the same math"
_DATA_CACHE = "a dataset-index build / caching knob; the same samples are built here"
_T5 = "encoder-decoder (T5 / BERT) models are not implemented here (GPT only)"
_BERT_DATA = "BERT / T5 masking data is not implemented here (GPT only)"
_MSC = "the Multi-Storage Client (object storage) is not supported here; use local or mounted paths"
_TOKENIZER = "not supported by the tokenizers here"

TABLE = FlagTable(
    topic="training",
    no_op=[
        CompatFlag("--gpu-sniff-test-interval", "no GPU sniff tests are run here", None, int, None),
        CompatFlag(
            "--train-sync-interval", "the host synchronises once per step here (the loss read-back)", None, int, None
        ),
        CompatFlag(
            "--exit-signal-handler-for-dataloader", "data-loader workers are stopped with the training process here"
        ),
        CompatFlag(
            "--no-manual-gc-eval", "with --manual-gc, collections run between steps only, never inside evaluation"
        ),
        CompatFlag(
            "--disable-manual-gc-eval", "with --manual-gc, collections run between steps only, never inside evaluation"
        ),
        CompatFlag("--tp-comm-overlap-cfg", _TE_COMM, None, str, None),
        CompatFlag("--no-masked-softmax-fusion", _FUSION),
        CompatFlag("--no-bias-gelu-fusion", _FUSION),
        CompatFlag("--no-bias-swiglu-fusion", _FUSION),
        CompatFlag("--no-bias-dropout-fusion", _FUSION),
        CompatFlag("--no-rope-fusion", _FUSION),
        CompatFlag("--use-flash-attn", "the attention kernel is chosen by --attention-backend"),
        CompatFlag("--optimizer-cpu-offload", _OFFLOAD),
        CompatFlag("--optimizer-cuda-graph", _CUDA_GRAPH),
        CompatFlag("--optimizer-offload-fraction", _OFFLOAD, None, float, 1.0),
        CompatFlag("--use-torch-optimizer-for-cpu-offload", _OFFLOAD),
        CompatFlag("--overlap-cpu-optimizer-d2h-h2d", _OFFLOAD),
        CompatFlag("--no-pin-cpu-grads", _OFFLOAD),
        CompatFlag("--no-pin-cpu-params", _OFFLOAD),
        CompatFlag("--no-persist-layer-norm", _FUSION),
        CompatFlag("--no-gradient-accumulation-fusion", _FUSION),
        CompatFlag("--use-mcore-models", "Megatron's default model class; it is the only model here"),
        CompatFlag(
            "--test-mode", "Megatron's real-time attention self-checks; this repository's tests check the attention"
        ),
        CompatFlag("--per-dataset-sequences-path", _DATA_CACHE, None, str, None),
        CompatFlag("--dataloader-fast-cache-load", _DATA_CACHE),
        CompatFlag("--dataloader-defer-npy-index-mmap", _DATA_CACHE),
        CompatFlag("--no-mmap-bin-files", "the .bin files are always memory-mapped; results are the same"),
        CompatFlag(
            "--no-create-attention-mask-in-dataloader",
            ("no dense attention mask is ever built; causal / packed-document visibility is computed in- kernel"),
        ),
        CompatFlag("--num-dataset-builder-threads", _DATA_CACHE, None, int, 1),
        CompatFlag("--allow-ambiguous-pad-tokens", "pad tokens are never added to the data here"),
        CompatFlag(
            "--trust-remote-code",
            "tokenizers load from their files (tokenizer.json, .model) here; no remote code is ever run",
        ),
    ],
    mapped=[
        CompatFlag(
            "--exit-signal-handler-for-training", "the signal handler is on by default here (--exit-signal-handler)"
        ),
        CompatFlag(
            "--dataloader-inter-document-masking",
            "same as --reset-attention-mask here (documents in a packed sample cannot see each other)",
        ),
    ],
    refused=[
        CompatFlag(
            "--exit-signal",
            "the signal handler here catches SIGTERM and SIGUSR1 (--exit-signal-handler)",
            None,
            str,
            "SIGTERM",
            (
                "SIGHUP",
                "SIGINT",
                "SIGQUIT",
                "SIGILL",
                "SIGTRAP",
                "SIGABRT",
                "SIGBUS",
                "SIGFPE",
                "SIGKILL",
                "SIGUSR1",
                "SIGSEGV",
                "SIGUSR2",
                "SIGPIPE",
                "SIGALRM",
                "SIGTERM",
                "SIGSTKFLT",
                "SIGCHLD",
                "SIGCONT",
                "SIGSTOP",
                "SIGTSTP",
                "SIGTTIN",
                "SIGTTOU",
                "SIGURG",
                "SIGXCPU",
                "SIGXFSZ",
                "SIGVTALRM",
                "SIGPROF",
                "SIGWINCH",
                "SIGIO",
                "SIGPWR",
                "SIGSYS",
                "SIGRTMIN",
                "SIGRTMAX",
            ),
            allowed=("SIGTERM",),
        ),
        CompatFlag("--iterations-to-skip", "skipping iterations is not implemented here", "+", int, []),
        CompatFlag("--batch-size", _DEPRECATED, None, int, None),
        CompatFlag("--checkpoint-activations", _DEPRECATED),
        CompatFlag("--dump-param-to-param-group-map", "a parameter-group map file is not read here", None, str, None),
        CompatFlag(
            "--dataloader-type",
            "only Megatron's 'single' sampler is implemented",
            None,
            str,
            None,
            ("single", "cyclic", "external"),
            allowed=("single",),
        ),
        CompatFlag("--start-weight-decay", "weight decay is constant (--weight-decay)", None, float, None),
        CompatFlag("--end-weight-decay", "weight decay is constant (--weight-decay)", None, float, None),
        CompatFlag(
            "--weight-decay-incr-style",
            "weight decay is constant here",
            None,
            str,
            "constant",
            ("constant", "linear", "cosine"),
            allowed=("constant",),
        ),
        CompatFlag("--warmup", _DEPRECATED, None, int, None),
        CompatFlag("--freeze-all-layers", "freezing layers is not implemented here"),
        CompatFlag("--start-eval-at-iter", "evaluation starts at the first --eval-interval here", None, int, None),
        CompatFlag("--full-validation", "evaluation runs --eval-iters batches here"),
        CompatFlag("--multiple-validation-sets", "one validation set is evaluated here"),
        CompatFlag("--validation-set-names", "one validation set is evaluated here", "+", str, None),
        CompatFlag("--phase-transition-iterations", "data phase transitions are not implemented here", None, str, None),
        CompatFlag(
            "--data-args-path",
            "use --data-path or --train-data-path/--valid-data-path/--test-data-path",
            None,
            str,
            None,
        ),
        CompatFlag(
            "--per-split-data-args-path", "use --train-data-path/--valid-data-path/--test-data-path", None, str, None
        ),
        CompatFlag("--encoder-seq-length", _T5, None, int, None),
        CompatFlag("--decoder-seq-length", _T5, None, int, None),
        CompatFlag("--sample-rate", "data subsampling is not implemented here", None, float, 1.0, allowed=(1.0,)),
        CompatFlag("--mask-prob", _BERT_DATA, None, float, 0.15, allowed=(0.15, 0.1)),
        CompatFlag("--short-seq-prob", _BERT_DATA, None, float, 0.1, allowed=(0.15, 0.1)),
        CompatFlag("--object-storage-cache-path", _MSC, None, str, None),
        CompatFlag(
            "--mid-level-dataset-surplus",
            "mid-level blended-dataset surpluses other than Megatron's default are not implemented here",
            None,
            float,
            0.005,
            allowed=(0.005,),
        ),
        CompatFlag("--no-pad-vocab-size", "use --padded-vocab-size or --make-vocab-size-divisible-by 1"),
        CompatFlag("--disable-pad-vocab-size", "use --padded-vocab-size or --make-vocab-size-divisible-by 1"),
        CompatFlag("--vocab-extra-ids", _TOKENIZER, None, int, 0, allowed=(0, -1)),
        CompatFlag("--tokenizer-metadata", _TOKENIZER, None, str, None, allowed=(0, -1)),
        CompatFlag("--tokenizer-special-tokens", _TOKENIZER, "+", str, None, allowed=(0, -1)),
        CompatFlag("--tokenizer-sentencepiece-legacy", _TOKENIZER, allowed=(0, -1)),
        CompatFlag("--no-tokenizer-sentencepiece-ignore-extra-whitespaces", _TOKENIZER, allowed=(0, -1)),
        CompatFlag("--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", _TOKENIZER, allowed=(0, -1)),
        CompatFlag("--tokenizer-hf-no-use-fast", _TOKENIZER, allowed=(0, -1)),
        CompatFlag("--tokenizer-hf-no-include-special-tokens", _TOKENIZER, allowed=(0, -1)),
        CompatFlag("--null-tokenizer-eod-id", _TOKENIZER, None, int, None, allowed=(0, -1)),
        CompatFlag("--null-tokenizer-pad-id", _TOKENIZER, None, int, -1, allowed=(0, -1)),
        CompatFlag("--chat-template", _TOKENIZER, None, str, None, allowed=(0, -1)),
    ],
)

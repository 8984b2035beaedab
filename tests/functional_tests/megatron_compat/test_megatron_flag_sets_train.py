"""Acceptance 1 (training): representative Megatron-LM flag sets train 2 iterations on CPU with only their sizes
and paths changed: the current GPT-3 example (step batch-size schedule, run unchanged under bash), the
Megatron-FSDP Llama 3 example (FSDP2 underneath, fsdp_dtensor read as torch_dist, FP8), the Qwen2.5 per-model
flag file (query/key/value-only biases, an explicit padded vocabulary) and the 15B release configuration (step
schedule by samples, Megatron's logging flags, asynchronous saves)."""
from __future__ import annotations

import contextlib
import io
import os

import pytest
from testlib.megatron_scripts import (
    GPT3_STEP,
    LLAMA_FSDP,
    demo_corpus,
    model_flags_argv,
    preprocess,
    release_argv,
    resize,
    run_script,
    tool,
    without_flags,
)
from testlib.train import train

SIZES = {"--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"],
         "--num-attention-heads": ["4"], "--num-query-groups": ["2"], "--kv-channels": ["16"],
         "--seq-length": ["64"], "--max-position-embeddings": ["64"], "--tensor-model-parallel-size": ["1"],
         "--pipeline-model-parallel-size": ["1"], "--num-workers": ["0"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("tokenizers")
    return demo_corpus(tmp_path_factory.mktemp("corpus"))


def _trained(proc, tracker, iterations: int = 2) -> str:
    """The scripts end with `set +x`, so their exit status is 0 whatever happened: read the outputs."""
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert tracker.read_text().strip() == str(iterations)
    return proc.stdout


def _scalars(tb_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_gpt3_step_schedule_script(corpus, tmp_path):
    vocab, merges = corpus["dir"] / "vocab.json", corpus["dir"] / "merges.txt"
    data = preprocess(corpus, "gpt2bpe", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                      "--merge-file", merges)
    # the schedule's six words (the script's array expansion splits it): batch 2, then 4 from 64 tokens (1 sample)
    sizes = {**SIZES, "--micro-batch-size": ["1"], "--global-batch-size": ["4"], "--train-iters": ["2"],
             "--lr-decay-iters": ["2"], "--step-batch-size-schedule": ["0:2", "64:4", "1K:4", "2K:4", "3K:4", "4K:4"]}
    proc = run_script(GPT3_STEP, ["ckpt", "tb", str(vocab), str(merges), data], tmp_path, sizes)
    _trained(proc, tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert [v for _, v in _scalars(tmp_path / "tb")["batch-size"]] == [2.0, 4.0]


def test_llama3_megatron_fsdp_script(tmp_path):
    sizes = {**SIZES, "--micro-batch-size": ["1"], "--global-batch-size": ["2"], "--train-samples": ["4"],
             "--lr-decay-samples": ["4"], "--lr-warmup-samples": ["1"], "--vocab-size": ["128"]}
    proc = run_script(LLAMA_FSDP, [], tmp_path, sizes)  # mock data, its own paths
    out = _trained(proc, tmp_path / "checkpoints" / "llama3_8b_fsdp_fp8" / "latest_checkpointed_iteration.txt")
    assert os.path.isfile(tmp_path / "checkpoints" / "llama3_8b_fsdp_fp8" / "iter_0000002" / ".metadata")
    assert "--data-parallel-sharding-strategy optim_grads_params: runs as PyTorch FSDP2" in out
    assert " > --ckpt-format fsdp_dtensor: read as torch_dist" in out
    assert "--init-model-with-meta-device" in out and "--fsdp-double-buffer" in out  # the listed no-ops


def test_qwen25_model_flags(tmp_path):
    sizes = {**SIZES, "--padded-vocab-size": ["128"], "--kv-channels": ["16"], "--num-query-groups": ["2"]}
    argv = resize(model_flags_argv("Qwen2.5-0.5B-Instruct.sh"), sizes)
    run = ["--mock-data", "--vocab-size", "100", "--train-iters", "2", "--global-batch-size", "2",
           "--eval-iters", "0", "--num-workers", "0", "--save", str(tmp_path / "ckpt")]
    seen = {}

    def hook(trainer):
        seen["params"] = {n: tuple(p.shape) for n, p in trainer.model[0].module.named_parameters()}
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(argv + run, trainer_hook=hook)
    assert result["iteration"] == 2
    params = seen["params"]
    assert "decoder.layers.0.self_attention.linear_q.bias" in params
    assert "decoder.layers.0.self_attention.linear_kv.bias" in params
    assert not any(n.endswith("linear_proj.bias") or n.endswith("linear_fc1.bias") for n in params)
    assert params["embedding.word_embeddings.weight"][0] == 128  # --padded-vocab-size


def test_release_configuration(corpus, tmp_path):
    (tmp_path / "utils").mkdir()
    tool("train_tokenizer.py", "--input", corpus["jsonl"], "--vocab-size", "500", "--model-prefix",
         tmp_path / "utils" / "nemotron_2_256k")
    spm = tmp_path / "utils" / "nemotron_2_256k.model"
    data = preprocess(corpus, "spm", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", spm)
    env = {"DATA_PATH": str(tmp_path), "DATA_BLEND": data, "DATA_CACHE_PATH": str(tmp_path / "cache"),
           "CHECKPOINT_SAVE_PATH": str(tmp_path / "ckpt"), "CHECKPOINT_LOAD_PATH": str(tmp_path / "ckpt"),
           "TENSORBOARD_PATH": str(tmp_path / "tb"), "WANDB_EXPERIMENT": "run", "WANDB_SAVE_PATH": str(tmp_path)}
    sizes = {**SIZES, "--micro-batch-size": ["1"], "--step-batch-size-schedule": ["0:2 0.1K:4"],
             "--train-samples": ["6"], "--lr-decay-samples": ["6"], "--lr-warmup-samples": ["2"],
             "--eval-iters": ["1"]}
    argv = resize(release_argv("gpt3_15b_8t_release.yaml", env), sizes)
    # the GPU environment's W&B (its package is not installed here)
    argv = without_flags(argv, ("--wandb-project", "--wandb-entity", "--wandb-exp-name", "--wandb-save-dir"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(argv)
    assert result["iteration"] == 2  # 2 samples, then 4
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    tags = _scalars(tmp_path / "tb")
    for tag in ("lm loss", "lm loss vs samples", "params-norm", "num-zeros", "mem-allocated-bytes", "throughput",
                "learning-rate"):
        assert tag in tags, tag
    assert [v for _, v in tags["batch-size"]] == [2.0, 4.0]
    text = out.getvalue()
    assert " > --transformer-impl transformer_engine: the local implementation runs (bf16" in text
    assert "params norm:" in text and "num zeros:" in text

"""Megatron-LM's own example launch scripts train here for 2 iterations on the demo corpus, on CPU.

The scripts (tests/fixtures/megatron_scripts) run unchanged under bash. A stand-in ``torchrun`` replaces
only the sizes (layers, hidden, heads, sequence, batch, iterations, parallel sizes); the data and
tokenizer paths are the scripts' own positional arguments, pointed at the demo corpus.

The GPT-3 script needs --fp16, --rampup-batch-size and GPT2BPETokenizer's --vocab-file / --merge-file,
which land with the numerics/tokenizer half of issue 17 (branch mnum).
"""
from __future__ import annotations

import os

import pytest
from testlib.megatron_scripts import GPT3, LLAMA, demo_corpus, preprocess, run_script

SIZES = {"--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"],
         "--num-attention-heads": ["4"], "--num-query-groups": ["2"], "--kv-channels": ["16"],
         "--seq-length": ["64"], "--max-position-embeddings": ["64"], "--tensor-model-parallel-size": ["1"],
         "--pipeline-model-parallel-size": ["1"]}
GPT3_SIZES = {**SIZES, "--micro-batch-size": ["2"], "--global-batch-size": ["4"],
              "--rampup-batch-size": ["2", "2", "4"], "--train-iters": ["2"], "--lr-decay-iters": ["2"]}
LLAMA_SIZES = {**SIZES, "--micro-batch-size": ["1"], "--global-batch-size": ["2"], "--train-samples": ["4"],
               "--lr-decay-samples": ["4"], "--lr-warmup-samples": ["1"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The demo corpus, a byte-level BPE trained on it (GPT-2 vocab.json/merges.txt and tokenizer.json)."""
    pytest.importorskip("tokenizers")
    return demo_corpus(tmp_path_factory.mktemp("corpus"))


def _preprocess(corpus, name: str, *tokenizer_flags) -> str:
    return preprocess(corpus, name, *tokenizer_flags)


def _trained(proc, tracker, iterations: int = 2) -> None:
    # The scripts end with `set +x`, so their exit status is 0 whatever happened: read the outputs.
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert tracker.read_text().strip() == str(iterations)


def test_gpt3_175b_script_trains_two_iterations(corpus, tmp_path):
    vocab, merges = corpus["dir"] / "vocab.json", corpus["dir"] / "merges.txt"
    data = _preprocess(corpus, "gpt2bpe", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                       "--merge-file", merges)
    proc = run_script(GPT3, ["ckpt", "tb", str(vocab), str(merges), data], tmp_path, GPT3_SIZES)
    _trained(proc, tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert "number of parameters on (tensor, gtp_weight_remat, pipeline)" in proc.stdout


def test_llama3_8b_fp8_script_trains_with_its_torch_dist_checkpoints(corpus, tmp_path):
    tokenizer = corpus["dir"] / "tokenizer.json"
    data = _preprocess(corpus, "hf", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer)
    args = ["ckpt", "tb", str(tokenizer), data]
    proc = run_script(LLAMA, args, tmp_path, LLAMA_SIZES)  # the script's own --ckpt-format torch_dist
    _trained(proc, tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000002" / ".metadata")
    out = proc.stdout
    assert "accepted for Megatron-LM compatibility, no effect here: --use-mcore-models" in out
    assert "--no-create-attention-mask-in-dataloader" in out and "--fp8-param-gather" in out
    lines = [line for line in out.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 2  # --log-interval 1
    assert all("throughput per GPU (TFLOP/s/GPU)" in line for line in lines)  # --log-throughput


def test_llama3_8b_fp8_script_with_mock_data(tmp_path):
    proc = run_script(LLAMA, [], tmp_path, {**LLAMA_SIZES, "--ckpt-format": ["torch"]})
    _trained(proc, tmp_path / "checkpoints" / "llama3_8b_fp8" / "latest_checkpointed_iteration.txt")


def test_llama3_8b_fp8_script_with_context_parallel_size_2(tmp_path):
    """The script's own --context-parallel-size (CP_SIZE), set to 2 on two gloo ranks: trains and saves."""
    overrides = {**LLAMA_SIZES, "--context-parallel-size": ["2"], "--ckpt-format": ["torch"]}
    proc = run_script(LLAMA, [], tmp_path, overrides, nproc=2)
    _trained(proc, tmp_path / "checkpoints" / "llama3_8b_fp8" / "latest_checkpointed_iteration.txt")
    assert "CP=2" in proc.stdout

"""Acceptance 2 (training): Megatron-LM's GPT functional-test configurations train 2 iterations on CPU with only
their sizes, paths, world size and --distributed-backend changed (gloo: there is no NCCL on CPU). The layouts
shrink to what 1, 2 or 4 CPU ranks hold: TP 1; PP 2 where the configuration interleaves (VPP) or splits unevenly,
but PP 4 with its 5 micro-batches for the tunable-overlap one (--microbatch-group-size-per-virtual-pipeline-stage 5);
CP 2 for the CP configuration; PP 1 otherwise. Three run in CI; the rest with -m slow."""
from __future__ import annotations

import contextlib
import io
import math
import shutil
from pathlib import Path

import pytest
from testlib.distributed import run_distributed
from testlib.megatron_scripts import (
    FUNCTIONAL_CONFIGS,
    FUNCTIONAL_DATA,
    demo_corpus,
    functional_argv,
    functional_env,
    preprocess,
    resize,
)
from testlib.train import train

CI = ("gpt3_mcore_te_tp2_pp2", "gpt3_mcore_tp1_pp2_fp16", "gpt3_mcore_te_tp1_pp4_vp1")
SIZES = {"--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"], "--num-attention-heads": ["4"],
         "--num-query-groups": ["2"], "--kv-channels": ["16"],
         "--seq-length": ["64"], "--max-position-embeddings": ["64"], "--micro-batch-size": ["1"],
         "--global-batch-size": ["2"], "--train-iters": ["2"], "--eval-iters": ["1"], "--vocab-size": ["1024"],
         "--tensor-model-parallel-size": ["1"], "--pipeline-model-parallel-size": ["1"],
         "--context-parallel-size": ["1"], "--num-workers": ["0"], "--distributed-backend": ["gloo"]}
LAYOUTS = {"tunable_overlap": {"--pipeline-model-parallel-size": ["4"], "--num-layers": ["8"],  # PP 4 x VP 2
                               "--global-batch-size": ["5"]},  # 5 micro-batches in one group of 5, as at 8 GPUs
           "vp1": {"--pipeline-model-parallel-size": ["2"], "--num-layers": ["4"]},
           "vp2": {"--pipeline-model-parallel-size": ["2"], "--num-layers": ["2"]},  # +embedding +loss: 4 slots
           "cp2": {"--context-parallel-size": ["2"]}}


@pytest.fixture(autouse=True)
def _restore_determinism(monkeypatch):
    """--deterministic-mode (most of these configurations) sets process-wide state in an in-process run."""
    import os

    import torch

    before = torch.are_deterministic_algorithms_enabled()
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.setenv(name, os.environ[name]) if name in os.environ else monkeypatch.delenv(name, raising=False)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """The demo corpus where the configurations' ${DATA_PATH} paths look: GPT-2 BPE files and the dataset."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("megatron_data")
    where = root / FUNCTIONAL_DATA
    where.mkdir(parents=True)
    corpus = demo_corpus(where)
    (where / "bpe").mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(where / name, where / "bpe" / name)
    preprocess(corpus, "my-gpt3_00", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", where / "vocab.json",
               "--merge-file", where / "merges.txt")
    return root


def _worker(rank: int, world_size: int, argv: list[str]) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(argv, world_size=world_size)


def _argv(name: str, data_root: Path, run_dir: Path) -> tuple[list[str], int]:
    env = {**functional_env(data_root), **{k: v for k, v in functional_env(run_dir).items() if k != "DATA_PATH"}}
    layout = next((v for k, v in LAYOUTS.items() if name.endswith(k) or f"_{k}_" in name), {})
    sizes = {**SIZES, **layout}
    world = int(sizes["--pipeline-model-parallel-size"][0]) * int(sizes["--context-parallel-size"][0])
    return resize(functional_argv(name, env), sizes), world


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in CI else pytest.mark.slow)
                                  for n in FUNCTIONAL_CONFIGS])
def test_functional_config_trains_two_iterations(name, data_root, tmp_path):
    argv, world = _argv(name, data_root, tmp_path)
    results = run_distributed(_worker, world, (argv,)) if world > 1 else [_worker(0, 1, argv)]
    last = [r for r in results if r["last_stage"]][-1]
    assert last["iteration"] == 2 and len(last["history"]) == 2
    assert all(math.isfinite(h["lm loss"]) for h in last["history"])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def _rerun_worker(rank: int, world_size: int, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(argv, world_size=world_size)
    return {**result, "out": out.getvalue()}


@pytest.mark.slow
def test_rerun_persistent_config_injects_and_exits_16(data_root, tmp_path):
    """gpt3_mcore_reruns_persistent_1 trained until its injection (--train-iters 40, a size): the lines its
    AFTER_SCRIPT checks, the checkpoint of the failed iteration's start and exit code 16. With 4 validation calls
    per iteration here at rate 100, the first injection falls on iteration 32 (a draw on the seed, 1234)."""
    argv, world = _argv("gpt3_mcore_reruns_persistent_1", data_root, tmp_path)
    argv = resize(argv, {"--train-iters": ["40"]})
    (result,) = run_distributed(_rerun_worker, world, (argv,))
    assert result["exit_code"] == 16 and result["iteration"] == 31
    for line in ("Result validation enabled", "Injecting error type Persistent error",
                 "First rerun: unexpected result is reproducible within the tolerance",
                 "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
                 "iteration and establish a diagnostic"):
        assert line in result["out"], line
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "31"

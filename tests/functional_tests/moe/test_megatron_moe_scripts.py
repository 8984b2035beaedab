"""Acceptance 5: Megatron-LM's MoE flag sets train here for 2 iterations on CPU with only sizes and paths changed:
Mixtral 8x7B's launch script (run unchanged under bash: alltoall dispatcher, grouped GEMM, the distributed
optimizer), Qwen3-30B-A3B's per-model flags (128 experts -> 8, top-8, fp32 router) and the MoE flags of the
DeepSeek-style proxy among Megatron-LM's functional tests (sigmoid router with expert bias, group-limited top-4,
seq_aux_loss, a shared expert, a dense/MoE layer pattern) at EP 2 over two gloo ranks."""
from __future__ import annotations

import contextlib
import io

import pytest
import yaml
from testlib.distributed import run_distributed
from testlib.megatron_scripts import (
    FIXTURES,
    MIXTRAL,
    demo_corpus,
    model_flags_argv,
    preprocess,
    resize,
    run_script,
    tool,
)
from testlib.train import train

SIZES = {"--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"],
         "--num-attention-heads": ["4"], "--num-query-groups": ["2"], "--kv-channels": ["16"],
         "--seq-length": ["64"], "--max-position-embeddings": ["64"], "--tensor-model-parallel-size": ["1"],
         "--pipeline-model-parallel-size": ["1"], "--num-workers": ["0"]}
RUN = ["--mock-data", "--vocab-size", "100", "--train-iters", "2", "--global-batch-size", "2", "--eval-iters", "0",
       "--num-workers", "0", "--log-interval", "1"]


def _moe_flags_of(yaml_name: str) -> list[str]:
    """The MoE flags (--num-experts, --moe-*, --expert-*) of a Megatron-LM functional-test configuration."""
    out = []
    for flag, value in yaml.safe_load((FIXTURES / "moe" / yaml_name).read_text())["MODEL_ARGS"].items():
        if flag == "--num-experts" or flag.startswith(("--moe-", "--expert-")):
            out += [flag] if value is True else [flag, str(value)]
    return out


def test_mixtral_script_trains_two_iterations(tmp_path):
    pytest.importorskip("sentencepiece")
    corpus = demo_corpus(tmp_path / "corpus", max_mb=0.05)
    tool("train_tokenizer.py", "--input", corpus["jsonl"], "--vocab-size", "500", "--model-prefix", tmp_path / "sp")
    model = tmp_path / "sp.model"
    data = preprocess(corpus, "llama2", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model)
    sizes = {**SIZES, "--num-experts": ["4"], "--expert-model-parallel-size": ["1"], "--micro-batch-size": ["1"],
             "--global-batch-size": ["2"], "--train-iters": ["2"], "--lr-decay-iters": ["2"],
             "--lr-warmup-iters": ["1"], "--eval-iters": ["1"]}
    proc = run_script(MIXTRAL, ["ckpt", str(tmp_path / "sp.model"), data], tmp_path, sizes)
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 2 and all("load_balancing_loss:" in line for line in lines)


def test_qwen3_moe_model_flags_train(tmp_path):
    argv = resize(model_flags_argv("Qwen3-30B-A3B.sh"), {**SIZES, "--num-experts": ["8"],
                                                          "--moe-ffn-hidden-size": ["32"]})
    seen = {}

    def hook(trainer):
        seen["moe"] = trainer.config.model.moe
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(argv + RUN + ["--save", str(tmp_path / "ckpt")], trainer_hook=hook)
    assert result["iteration"] == 2 and all("load_balancing_loss" in h for h in result["history"])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    moe = seen["moe"]
    assert (moe.num_experts, moe.router_topk, moe.router_dtype, moe.token_dispatcher_type) == (8, 8, "fp32",
                                                                                             "alltoall")


def _deepseek_worker(rank, world, argv):
    seen = {}
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(argv, world_size=world, trainer_hook=lambda t: seen.setdefault("t", t))
    trainer = seen["t"]
    routers = [m.router for m in trainer.moe.layers]
    result["moe_layers"] = sorted(m.layer_number for m in trainer.moe.layers)
    result["bias_moved"] = max(float(r.expert_bias.abs().max()) for r in routers)
    result["config"] = trainer.config.model.moe
    return result


def test_deepseek_style_moe_flags_train_at_ep2():
    moe = _moe_flags_of("deepseek_proxy_fsdp_ep2_fsdp2.yaml")
    base = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--position-embedding-type", "rope", "--micro-batch-size", "1", "--lr", "1e-3"]
    argv = base + resize(moe, {"--moe-ffn-hidden-size": ["32"], "--moe-shared-expert-intermediate-size": ["32"]}) + RUN
    results = run_distributed(_deepseek_worker, 2, args=(argv,))
    r = results[0]
    cfg = r["config"]
    assert cfg.expert_model_parallel_size == 2 and cfg.router_load_balancing_type == "seq_aux_loss"
    assert (cfg.router_num_groups, cfg.router_group_topk, cfg.router_score_function) == (4, 2, "sigmoid")
    assert r["moe_layers"] == [3, 4, 5, 6, 7]  # ([0]*3+[1]*5)
    assert r["bias_moved"] > 0  # the aux-loss-free bias took its two steps
    assert r["iteration"] == 2 and all("seq_load_balancing_loss" in h for h in r["history"])

"""Acceptance 6: ``tools/checkpoint/convert.py --model-type GPT --loader core --saver core`` (Megatron-LM's command
line) reshards a checkpoint that megatron-core 0.19.2 wrote at TP = 2, PP = 2 (4 gloo ranks on CPU, legacy
``mp_rank_TT_PPP`` files) to TP = 1, PP = 1, and megatron-core loads the result: Megatron-LM's
``load_args_from_checkpoint`` and strict ``load_checkpoint``, with the flags the tool printed, give the logits
that the four-rank model computed (pipeline hand-over by send/recv, vocabulary shards gathered over TP).
Refused loaders and savers name themselves."""
from __future__ import annotations

import contextlib
import io
import os
import re
import typing
import zlib

import pytest
import torch
from testlib.distributed import run_distributed

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
pytest.importorskip("megatron.training.arguments")

VOCAB, SEQ, ITERATION = 60, 16, 5
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
         "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
RUN = ["--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8", "--tokenizer-type", "NullTokenizer",
       "--micro-batch-size", "1", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--transformer-impl", "local", "--use-cpu-initialization", "--no-rope-fusion",
       "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--mock-data"]


def _convert(argv: list[str]) -> tuple[int, str]:
    import convert  # tools/checkpoint/convert.py

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = convert.main(argv)
    return rc, out.getvalue()


def _worker(rank: int, world: int, tmp: str) -> dict:
    import sys

    from testlib import ROOT, mcore_cpu

    mcore_cpu.shim_cpu()
    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    tp, pp = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
    args = mcore_cpu.megatron_args(MODEL + RUN + ["--tensor-model-parallel-size", "2",
                                                 "--pipeline-model-parallel-size", "2"], 4, padded_vocab=(VOCAB, 8, 2))
    model = mcore_cpu.megatron_model(args, pre_process=pp == 0, post_process=pp == 1).eval()
    with torch.no_grad():  # distinct weights per stage and TP shard; TP-replicated ones equal over TP
        for name, p in model.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{pp}/{tp if split else 0}".encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))
    meg, out = os.path.join(tmp, "megatron_tp2pp2"), os.path.join(tmp, "converted_tp1pp1")
    rdir = os.path.join(meg, f"iter_{ITERATION:07d}", f"mp_rank_{tp:02d}_{pp:03d}")
    os.makedirs(rdir, exist_ok=True)
    args.iteration, args.consumed_train_samples = ITERATION, 4 * ITERATION
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,  # Megatron-LM's legacy save
                "model": model.state_dict_for_save_checkpoint()}, os.path.join(rdir, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(meg, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    g = torch.Generator().manual_seed(7)
    tokens, pos = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ)
    result: dict = {}
    with torch.no_grad():  # the TP = 2, PP = 2 forward
        if pp == 0:
            dist.send(mcore_cpu.megatron_logits(model, tokens, pos).contiguous(),
                      mps.get_pipeline_model_parallel_next_rank())
        else:
            hidden = torch.empty(SEQ, 2, 32)
            dist.recv(hidden, mps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            shard = mcore_cpu.megatron_logits(model, tokens, pos).contiguous()
            shards = [torch.empty_like(shard) for _ in range(2)]
            dist.all_gather(shards, shard, group=mps.get_tensor_model_parallel_group())
            result["reference"] = torch.cat(shards, -1)[..., :VOCAB]
    dist.barrier()
    if rank == 0:
        result["rc"], result["log"] = _convert(
            ["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", meg, "--save-dir", out,
             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
             "--saver-transformer-impl", "local", "--megatron-path", "/opt/Megatron-LM"])
        result["files"] = sorted(os.listdir(os.path.join(out, f"iter_{ITERATION:07d}")))
    dist.barrier()
    mps.destroy_model_parallel()
    mps.initialize_model_parallel()  # TP = PP = 1 (collective)
    flags_holder = [None]
    if rank == 0:
        flags_holder[0] = re.search(r"pretrain_gpt\.py --load \S+ (.*?) \.\.\.", result["log"].replace("\n", " "))
        flags_holder[0] = flags_holder[0].group(1).split() if flags_holder[0] else []
    dist.broadcast_object_list(flags_holder, src=0)
    fresh, _, loaded = mcore_cpu.megatron_lm_load(["--load", out, *flags_holder[0], *RUN], 4)  # collective
    if rank == 3:
        with torch.no_grad():
            got = mcore_cpu.megatron_logits(fresh, tokens, pos)[..., :VOCAB]
        result.update(diff=(got - result["reference"]).abs().max().item(),
                      scale=result["reference"].abs().max().item(), loaded=loaded, flags=flags_holder[0])
    return {k: v for k, v in result.items() if k != "reference"}


def test_loader_core_saver_core_reshards_tp2pp2_to_tp1pp1(tmp_path):
    results = run_distributed(_worker, 4, (str(tmp_path),))
    assert results[0]["rc"] == 0, results[0]["log"]
    assert results[0]["files"] == ["mp_rank_00"]
    assert "--megatron-path: no effect here" in results[0]["log"]
    last = results[3]
    assert last["scale"] > 1.0
    assert last["diff"] < 1e-5 * last["scale"], last
    assert last["loaded"] == (ITERATION, 4 * ITERATION)
    assert "--use-checkpoint-args" in last["flags"] and "--transformer-impl" in last["flags"]


@pytest.mark.parametrize("argv, message", [
    (["--loader", "legacy", "--saver", "core"], "--loader legacy: refused: pre-megatron-core"),
    (["--loader", "core", "--saver", "legacy"], "--saver legacy: refused"),
    (["--loader", "mixtral_hf", "--saver", "core"], "--loader mixtral_hf: refused: Mixtral"),
    (["--loader", "core"], "--saver megatron: refused"),
    (["--loader", "nope", "--saver", "core"], "--loader nope: unknown"),
    (["--loader", "core", "--saver", "core", "--target-expert-parallel-size", "2"], "expert parallel size 1"),
])
def test_refused_plugins_name_themselves(argv, message, tmp_path):
    import sys

    from testlib import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    rc, log = _convert(["--model-type", "GPT", "--load-dir", str(tmp_path / "in"), "--save-dir",
                        str(tmp_path / "out"), *argv])
    assert rc == 2 and message in log, log
    assert len([line for line in log.splitlines() if line.startswith("error:")]) == 1

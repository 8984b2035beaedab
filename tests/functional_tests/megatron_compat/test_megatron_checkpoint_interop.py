"""Megatron-LM checkpoints both ways, against the real megatron-core 0.19.2 on CPU (gloo, TP = 1 and 2).

Megatron-LM's own argument parser (``parse_args`` + ``validate_args``) turns Megatron-LM flags into its
``args``; ``core_transformer_config_from_args`` and megatron-core's ``GPTModel`` with the local layer spec
build the model from them, as Megatron-LM's GPT builder does. Its checkpoint (the legacy ``torch`` format,
``model_optim_rng.pt`` per TP rank) goes through ``tools/convert_checkpoint.py --from-megatron`` into
ours, and ours goes back through ``--to-megatron`` into a fresh megatron-core model, loaded by
Megatron-LM's own ``load_args_from_checkpoint`` and ``load_checkpoint`` (strict). The same for the
``torch_dist`` format (``dist_checkpointing.save`` on CPU), PP = 2 stages, and 5 training iterations
continued on both sides (megatron-core's DDP, optimizer, scheduler and schedule).

CPU shims (test only): ``torch.cuda.current_device`` and megatron-core's CUDA RNG state get/set
functions; ``model_parallel_cuda_manual_seed`` is called; the causal mask is passed explicitly (its
default one is allocated on CUDA); Megatron-LM's tracker reader (it all-reduces the iteration in a CUDA
tensor) is replaced by a plain read of the file; further shims for the train step and torch_dist
are named where they are made.
"""
from __future__ import annotations

import contextlib
import io
import os
import typing
from types import SimpleNamespace

import pytest
import torch

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
pytest.importorskip("megatron.core")
pytest.importorskip("megatron.training.arguments")

from testlib import mcore_cpu  # noqa: E402
from testlib.distributed import run_distributed  # noqa: E402

VOCAB, DIVISIBLE, SEQ, ITERATION = 60, 8, 16, 7
COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
          str(DIVISIBLE), "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "2",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.2", "--transformer-impl",
          "local", "--use-cpu-initialization", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
          "--no-persist-layer-norm", "--no-masked-softmax-fusion"]
LAYOUTS = {
    # RMSNorm, SwiGLU, GQA (4 heads, 2 query groups), RoPE, untied, no biases
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48", "--group-query-attention",
              "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-base", "500",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
    # LayerNorm, GeLU (tanh: megatron-core's bias-GeLU fusion), learned positions, tied, biases
    "gpt": ["--normalization", "LayerNorm", "--ffn-hidden-size", "64", "--position-embedding-type",
            "learned_absolute"],
}


# ------------------------------------------------------------------------------ megatron-core side
def _shim_cpu() -> None:
    mcore_cpu.shim_cpu()


def _megatron_args(flags: list[str], tp: int, extra: list[str] = (), world: int | None = None):
    """Megatron-LM's args for these flags, through its own parser and validate_args."""
    return mcore_cpu.megatron_args([*COMMON, *flags, "--tensor-model-parallel-size", str(tp), *extra], world or tp,
                                   padded_vocab=(VOCAB, DIVISIBLE, tp))


def _megatron_model(args, pre_process: bool = True, post_process: bool = True):
    return mcore_cpu.megatron_model(args, pre_process, post_process)


def _perturb(model, rank: int) -> None:
    """Random norms and biases too (megatron-core initialises them to 1 and 0): a mapping that swaps or
    misplaces them changes the logits. TP-split tensors differ per rank, replicated ones do not."""
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            split = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(1000 * i + (rank if split else 0))
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if "norm" in name else 0))


def _tokens(seed: int = 0, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, SEQ), generator=g), torch.arange(SEQ).expand(b, SEQ)


def _megatron_logits(model, tokens, pos, labels=None):
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    return model(tokens, pos, mask, labels=labels)


def _save_megatron(root: str, args, model, rank: int) -> None:
    """What Megatron-LM's legacy save writes per TP rank (model only: --no-save-optim --no-save-rng)."""
    rdir = os.path.join(root, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(rdir, exist_ok=True)
    args.iteration, args.consumed_train_samples = ITERATION, 2 * ITERATION
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint(), "num_floating_point_operations_so_far": 0},
               os.path.join(rdir, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def _megatron_lm_load(root: str, layout: str, world: int, fmt: str):
    """A fresh megatron-core model loaded by Megatron-LM's own ``load_checkpoint`` (after its
    ``load_args_from_checkpoint`` read the checkpoint's args), as ``pretrain_gpt.py --load root
    --use-checkpoint-args --no-load-optim --no-load-rng --ckpt-format fmt`` would.
    Returns (model, (iteration, consumed_train_samples))."""
    import megatron.training.checkpointing as mckpt
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.safe_globals import register_safe_globals
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import set_args

    mckpt.read_metadata = _read_tracker  # its own all-reduces the iteration in a CUDA tensor
    register_safe_globals()  # as Megatron-LM's initialisation does: args is an argparse.Namespace
    torch.cuda.synchronize = lambda *a, **k: None
    model_parallel_cuda_manual_seed(99)  # another initialisation: everything must come from the file
    args = _megatron_args(LAYOUTS[layout], world, ["--load", root, "--use-checkpoint-args", "--no-load-optim",
                                                   "--no-load-rng", "--ckpt-format", fmt])
    with contextlib.redirect_stdout(io.StringIO()):
        args, _ = mckpt.load_args_from_checkpoint(args)
        set_args(args)
        init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
        fresh = _megatron_model(args).eval()
        iteration, _ = mckpt.load_checkpoint([fresh], None, None, strict=True)
    return fresh, (iteration, args.consumed_train_samples)


def _read_tracker(path: str) -> tuple[int, bool]:
    text = open(path).read().strip()
    return (0, True) if text == "release" else (int(text), False)


# ----------------------------------------------------------------------------------------- our side
def _convert(argv: list[str]) -> None:
    import convert_checkpoint

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = convert_checkpoint.main(argv)
    assert rc == 0, out.getvalue()


def _our_model(root: str, tp: int):
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.training.checkpoint import load_torch_checkpoint, read_metadata

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = GPTConfig.from_dict(read_metadata(root, ITERATION)["model_config"])
    model = GPTModel(config)
    chunk = SimpleNamespace(module=model)  # the loader reads ModelChunk.module only
    counters = load_torch_checkpoint(root, [chunk], None, None, config, load_optim=False, load_rng=False)
    return model.eval(), counters


def _setup(rank: int, world: int, tmp: str, layout: str):
    _shim_cpu()
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    args = _megatron_args(LAYOUTS[layout], world)
    model = _megatron_model(args)
    _perturb(model, rank)
    meg = os.path.join(tmp, "megatron")
    _save_megatron(meg, args, model, rank)
    torch.distributed.barrier()
    return args, model.eval(), meg


def _parity_worker(rank: int, world: int, tmp: str, layout: str) -> dict:
    args, theirs, meg = _setup(rank, world, tmp, layout)
    ours_dir, back = os.path.join(tmp, "ours"), os.path.join(tmp, "megatron_back")
    if rank == 0:
        _convert(["--from-megatron", "--load", meg, "--save", ours_dir])
    torch.distributed.barrier()
    ours, counters = _our_model(ours_dir, world)
    tokens, pos = _tokens()
    with torch.no_grad():
        ref = _megatron_logits(theirs, tokens, pos)
        got = ours(tokens, pos)
    out = {"import": (got - ref).abs().max().item(), "ref_scale": ref.abs().max().item(), "counters": counters,
           "shape": tuple(got.shape)}

    if rank == 0:  # ours -> Megatron-LM, loaded by a fresh megatron-core model
        _convert(["--to-megatron", "--load", ours_dir, "--save", back])
    torch.distributed.barrier()
    fresh, loaded = _megatron_lm_load(back, layout, world, "torch")
    payload = torch.load(os.path.join(back, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}", "model_optim_rng.pt"),
                         weights_only=False)
    out["megatron_lm_load"] = loaded
    with torch.no_grad():
        again = _megatron_logits(fresh, tokens, pos)
    out["export"] = (again - got).abs().max().item()
    out["export_identical"] = all(torch.equal(a, b) for (_, a), (_, b) in
                                  zip(sorted(theirs.state_dict().items()), sorted(fresh.state_dict().items()))
                                  if torch.is_tensor(a))
    out["args"] = {k: getattr(payload["args"], k) for k in ("padded_vocab_size", "iteration", "swiglu",
                                                            "untie_embeddings_and_output_weights")}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_logit_parity_both_ways(layout, tp, tmp_path):
    results = run_distributed(_parity_worker, tp, (str(tmp_path), layout))
    for rank, r in enumerate(results):
        assert r["ref_scale"] > 1.0  # logits of substance, not near-zero noise
        assert r["import"] < 1e-5, f"rank {rank}: Megatron -> ours logits differ by {r['import']}"
        assert r["export"] < 1e-5, f"rank {rank}: ours -> Megatron logits differ by {r['export']}"
        assert r["export_identical"]  # the round trip gives megatron-core its own weights back, bit for bit
        assert r["megatron_lm_load"] == (ITERATION, 2 * ITERATION)
        assert r["shape"] == (2, SEQ, 64 // tp)  # Megatron's padded vocabulary (60 -> 64), split over TP
        assert r["counters"]["iteration"] == ITERATION and r["counters"]["consumed_train_samples"] == 2 * ITERATION
        assert r["args"] == {"padded_vocab_size": 64, "iteration": ITERATION, "swiglu": layout == "llama",
                             "untie_embeddings_and_output_weights": layout == "llama"}
    _assert_load_refuses_megatron_dir(os.path.join(tmp_path, "megatron"))


# --------------------------------------------------------------------------- training continues alike
STEPS = 5


def _megatron_train(model, args, batches: list[dict]) -> list[tuple[float, float]]:
    """Megatron-LM's train step on megatron-core: its DistributedDataParallel (fp32 grad buffer), its
    optimizer (get_megatron_optimizer: AdamW, grad clipping with its TP-aware norm), its LR/weight-decay
    scheduler (weight decay off for biases and norms) and its no-pipelining forward/backward schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    mcore_cpu.shim_cpu_optimizer()

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr,
                                                 weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.999,
                                                 adam_eps=1e-8, clip_grad=args.clip_grad, params_dtype=torch.float32),
                                 [ddp])
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # Megatron-LM's scheduler sets each group's lr and weight decay (x wd_mult: 0 for biases and norms)
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=args.lr, min_lr=args.lr, lr_warmup_steps=0,
                                        lr_decay_steps=100, lr_decay_style="constant", start_wd=args.weight_decay,
                                        end_wd=args.weight_decay, wd_incr_steps=100, wd_incr_style="constant")

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        out = _megatron_logits(m, b["tokens"], b["position_ids"], labels=b["labels"])

        def loss_func(output):
            mask = b["loss_mask"].float()
            loss = (output.float() * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    history = []
    for b in batches:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = schedules.forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter([b]),
                                                          model=[ddp], num_microbatches=1, seq_length=SEQ,
                                                          micro_batch_size=2)
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok
        scheduler.step(increment=2)  # one global batch of 2 samples
        history.append((losses[0]["lm loss"].item(), float(grad_norm)))
    return history


def _training_worker(rank: int, world: int, tmp: str, layout: str) -> dict:
    args, theirs, meg = _setup(rank, world, tmp, layout)
    ours_dir = os.path.join(tmp, "ours")
    if rank == 0:
        _convert(["--from-megatron", "--load", meg, "--save", ours_dir])
    torch.distributed.barrier()
    from testlib.train import train

    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.interop.hf import pretrain_flags
    from megatron_cai.training.checkpoint import read_metadata

    config = GPTConfig.from_dict(read_metadata(ours_dir, ITERATION)["model_config"])
    argv = pretrain_flags(config) + [
        "--vocab-size", str(config.vocab_size), "--make-vocab-size-divisible-by", str(DIVISIBLE), "--seq-length",
        str(SEQ), "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
        str(ITERATION + STEPS), "--lr", "3e-3", "--lr-decay-style", "constant", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--load",
        ours_dir, "--no-load-optim", "--no-load-rng", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tensor-model-parallel-size", str(world), "--num-workers", "0"]
    batches: list[dict] = []

    def record(trainer):
        inner = trainer.forward_step_func

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            batches.append({k: b[k].clone() for k in ("tokens", "labels", "loss_mask", "position_ids")})
            return inner(iter([b]), model)

        trainer.forward_step_func = forward_step

    with contextlib.redirect_stdout(io.StringIO()):
        ours = train(argv, world, trainer_hook=record)
    args.lr, args.weight_decay, args.clip_grad = 3e-3, 0.01, 1.0
    theirs.train()
    return {"ours": [(h["lm loss"], h["grad norm"]) for h in ours["history"]], "iteration": ours["iteration"],
            "theirs": _megatron_train(theirs, args, batches)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_training_continues_as_in_megatron_core(layout, tp, tmp_path):
    results = run_distributed(_training_worker, tp, (str(tmp_path), layout))
    for r in results:
        assert r["iteration"] == ITERATION + STEPS and len(r["ours"]) == len(r["theirs"]) == STEPS
        for i, ((loss, norm), (mloss, mnorm)) in enumerate(zip(r["ours"], r["theirs"])):
            assert abs(loss - mloss) < 1e-4, f"iteration {ITERATION + i + 1}: lm loss {loss} vs megatron-core {mloss}"
            assert norm == pytest.approx(mnorm, rel=1e-4), f"iteration {ITERATION + i + 1}: grad norm {norm} vs {mnorm}"
        assert min(n for _, n in r["ours"]) > 1.0  # every step clipped: megatron-core's clipping is compared too


# ------------------------------------------------------------------------------------ torch_dist format
def _torch_dist_worker(rank: int, world: int, tmp: str, layout: str) -> dict:
    args, theirs, _ = _setup(rank, world, tmp, layout)
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    from megatron.core import dist_checkpointing

    torch.cuda.synchronize = lambda *a, **k: None
    fs_async._process_memory = lambda: 0  # memory logging only (psutil is not installed)
    meg, ours_dir, back = (os.path.join(tmp, n) for n in ("megatron_td", "ours_td", "megatron_td_back"))
    it_dir = os.path.join(meg, f"iter_{ITERATION:07d}")
    os.makedirs(it_dir, exist_ok=True)
    # what Megatron-LM's save_checkpoint hands dist_checkpointing with --ckpt-format torch_dist (model only)
    dist_checkpointing.save({"model": theirs.sharded_state_dict(), "args": args, "iteration": ITERATION,
                             "checkpoint_version": 3.0}, it_dir)
    if rank == 0:
        with open(os.path.join(meg, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
        _convert(["--from-megatron", "--load", meg, "--save", ours_dir, "--target-tensor-parallel-size", str(world)])
    torch.distributed.barrier()
    ours, counters = _our_model(ours_dir, world)
    tokens, pos = _tokens(1)
    with torch.no_grad():
        ref = _megatron_logits(theirs, tokens, pos)
        got = ours(tokens, pos)
    out = {"import": (got - ref).abs().max().item(), "iteration": counters["iteration"]}
    if rank == 0:
        _convert(["--to-megatron", "--megatron-ckpt-format", "torch_dist", "--load", ours_dir, "--save", back,
                  "--target-tensor-parallel-size", str(world)])
    torch.distributed.barrier()
    fresh, out["megatron_lm_load"] = _megatron_lm_load(back, layout, world, "torch_dist")
    loaded = dist_checkpointing.load_common_state_dict(os.path.join(back, f"iter_{ITERATION:07d}"))
    with torch.no_grad():
        again = _megatron_logits(fresh, tokens, pos)
    out["export"] = (again - got).abs().max().item()
    out["common"] = (loaded["iteration"], loaded["args"].padded_vocab_size, loaded["args"].ckpt_format)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_torch_dist_both_ways(layout, tp, tmp_path):
    for rank, r in enumerate(run_distributed(_torch_dist_worker, tp, (str(tmp_path), layout))):
        assert r["import"] < 1e-5, f"rank {rank}: Megatron torch_dist -> ours logits differ by {r['import']}"
        assert r["export"] < 1e-5, f"rank {rank}: ours -> Megatron torch_dist logits differ by {r['export']}"
        assert r["iteration"] == ITERATION and r["common"] == (ITERATION, 64, "torch_dist")
        assert r["megatron_lm_load"] == (ITERATION, 2 * ITERATION)
    _assert_load_refuses_megatron_dir(os.path.join(tmp_path, "megatron_td"))


def _assert_load_refuses_megatron_dir(root: str) -> None:
    """``--load`` on a Megatron-LM directory (either format) names the converter instead of failing later."""
    from megatron_cai.training.checkpoint import CheckpointError, refuse_megatron_lm_checkpoint

    with pytest.raises(CheckpointError, match="is a Megatron-LM checkpoint.*--from-megatron"):
        refuse_megatron_lm_checkpoint(root, ITERATION)
    refuse_megatron_lm_checkpoint(os.path.join(os.path.dirname(root), "ours"), ITERATION)  # ours: no error


# ----------------------------------------------------------------------------------- pipeline stages
def _pp_worker(rank: int, world: int, tmp: str) -> dict:
    """Megatron-LM PP = 2 (mp_rank_00_00P files, stage-local layer numbers, the last stage's copy of the
    tied embeddings): imported into ours at PP = 1, and written back at PP = 2."""
    import zlib

    _shim_cpu()
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied copies' initial all-reduce moves them to 'cuda'
    model_parallel_cuda_manual_seed(1234)
    args = _megatron_args(LAYOUTS["gpt"], 1, ["--pipeline-model-parallel-size", "2"], world=2)
    theirs = _megatron_model(args, pre_process=rank == 0, post_process=rank == 1).eval()
    with torch.no_grad():  # the same weights as a PP = 1 model: seeded by global name
        for name, p in theirs.named_parameters():
            m = name.split(".")
            if name.startswith("decoder.layers."):
                m[2] = str(int(m[2]) + rank)  # one layer per stage
            key = "embedding.word_embeddings.weight" if name == "output_layer.weight" else ".".join(m)
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in key else 0.0))
    meg, ours_dir, back = (os.path.join(tmp, n) for n in ("megatron_pp", "ours_pp", "megatron_pp_back"))
    rdir = os.path.join(meg, f"iter_{ITERATION:07d}", f"mp_rank_00_{rank:03d}")
    os.makedirs(rdir, exist_ok=True)
    args.iteration = ITERATION
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": theirs.state_dict_for_save_checkpoint()}, os.path.join(rdir, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(meg, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
        _convert(["--from-megatron", "--load", meg, "--save", ours_dir, "--target-pipeline-model-parallel-size", "1"])
        _convert(["--to-megatron", "--load", ours_dir, "--save", back, "--target-pipeline-model-parallel-size", "2"])
    torch.distributed.barrier()
    from megatron_cai.core import parallel_state as ps

    ps.initialize_model_parallel()  # collective: on both ranks
    tokens, pos = _tokens(2)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    out = {}
    with torch.no_grad():  # megatron-core's two stages, the activation handed over by send/recv
        if rank == 0:
            torch.distributed.send(theirs(tokens, pos, mask).contiguous(), 1)
        else:
            hidden = torch.empty(SEQ, 2, 32)
            torch.distributed.recv(hidden, 0)
            theirs.set_input_tensor(hidden)
            ref = theirs(tokens, pos, mask)
            ours, _ = _our_model(ours_dir, 1)
            out["import"] = (ours(tokens, pos) - ref).abs().max().item()
    payload = torch.load(os.path.join(back, f"iter_{ITERATION:07d}", f"mp_rank_00_{rank:03d}", "model_optim_rng.pt"),
                         weights_only=False)
    fresh = _megatron_model(args, pre_process=rank == 0, post_process=rank == 1)
    fresh.load_state_dict(payload["model"], strict=True)
    out["identical"] = all(torch.equal(a, b) for (_, a), (_, b) in
                           zip(sorted(theirs.state_dict().items()), sorted(fresh.state_dict().items()))
                           if torch.is_tensor(a))
    return out


def test_pipeline_stages_both_ways(tmp_path):
    results = run_distributed(_pp_worker, 2, (str(tmp_path),))
    assert results[1]["import"] < 1e-5, results[1]["import"]
    assert results[0]["identical"] and results[1]["identical"]


# ------------------------------------------------------------------------- names, refusals (one process)
def _canonical(tmp: str, **kw) -> str:
    """A checkpoint of ours with random weights (TP = 2), written by save_resharded."""
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.interop.hf import param_layout
    from megatron_cai.training.checkpoint import CanonicalCheckpoint, Layout, save_resharded

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                       ffn_hidden_size=48, seq_length=SEQ, normalization="RMSNorm", activation="swiglu",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True, **kw)
    layout = param_layout(config)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPTModel(config).named_parameters()}
    g = torch.Generator().manual_seed(5)
    model = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    ck = CanonicalCheckpoint(config=config, iteration=3, model=model, layout_meta=layout,
                             counters={"iteration": 3, "consumed_train_samples": 6}, source=Layout(2, 1))
    with contextlib.redirect_stdout(io.StringIO()):
        save_resharded(ck, tmp, Layout(2, 1), make_vocab_size_divisible_by=DIVISIBLE, with_optimizer=False)
    return tmp


def test_transformer_engine_names_round_trip(tmp_path):
    """The TE spec's fused-norm names (linear_qkv.layer_norm_weight, linear_fc1.layer_norm_weight) and its
    core_attention extra state are written and read; the weights come back unchanged. (Transformer Engine
    is not installed: the names are those megatron-core's sharded_state_dict also uses for the local spec,
    which the torch_dist test reads from megatron-core itself.)"""
    from megatron_cai.training.checkpoint import load_canonical

    _shim_cpu()
    ours = _canonical(str(tmp_path / "ours"))
    te, back = str(tmp_path / "te"), str(tmp_path / "back")
    _convert(["--to-megatron", "--megatron-spec", "transformer_engine", "--load", ours, "--save", te])
    sd = torch.load(os.path.join(te, "iter_0000003", "mp_rank_01", "model_optim_rng.pt"), weights_only=False)["model"]
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in sd
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in sd
    assert "decoder.layers.1.self_attention.core_attention._extra_state" in sd
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in sd)
    assert sd["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (64 // 2, 32)  # (4 + 2 * 2) * 8 / TP
    _convert(["--from-megatron", "--load", te, "--save", back])
    a, b = load_canonical(ours, load_optimizer=False), load_canonical(back, load_optimizer=False)
    assert a.model.keys() == b.model.keys()
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
    assert b.counters["consumed_train_samples"] == 6 and b.iteration == 3


@pytest.mark.parametrize("change, message", [
    ({"num_experts": 8, "moe_grouped_gemm": True}, "--moe-grouped-gemm"),  # plain MoE converts (interop/megatron_moe)
    ({"rotary_interleaved": True}, "--rotary-interleaved"),
    ({"multi_latent_attention": True}, "--multi-latent-attention"),
])
def test_unrepresentable_megatron_options_are_refused(change, message):
    import argparse

    from megatron_cai.interop.megatron import config_from_megatron_args
    from megatron_cai.training.checkpoint import ConversionError

    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, swiglu=True,
                              add_bias_linear=False, padded_vocab_size=64, max_position_embeddings=16, seq_length=16,
                              normalization="RMSNorm", position_embedding_type="rope")
    config_from_megatron_args(args)  # the base is fine
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(ConversionError, match=message):
        config_from_megatron_args(args)


def test_not_a_megatron_checkpoint(tmp_path):
    _shim_cpu()
    import convert_checkpoint

    ours = _canonical(str(tmp_path / "ours"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        assert convert_checkpoint.main(["--from-megatron", "--load", ours, "--save", str(tmp_path / "x")]) != 0
    assert "not a Megatron-LM model checkpoint" in err.getvalue()

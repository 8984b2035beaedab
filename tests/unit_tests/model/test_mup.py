"""--use-mup against the real megatron-core 0.19.2 (CPU, one gloo process): the same Megatron-LM flags through
Megatron-LM's parser (megatron-core's GPTModel, local spec) and through ours give

- the same initialisation std per tensor (MuP's 1/sqrt(m) on hidden matrices, depth and width on the output
  projections, base std on embeddings and the output layer), compared on the freshly initialised weights;
- the same logits from the same weights (attention scale, embedding and logit multipliers);
- the same peak / minimum learning rate, Adam epsilon and weight decay for every parameter as megatron-core's
  get_megatron_optimizer param groups (get_standard_config_overrides + get_mup_config_overrides), mapped onto our
  parameters by the checkpoint converter's name mapping."""
from __future__ import annotations

import typing

import pytest
import torch

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
pytest.importorskip("megatron.training.arguments")

from testlib import mcore_cpu  # noqa: E402
from testlib.distributed import run_distributed  # noqa: E402

VOCAB, SEQ = 120, 16
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8",
          "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10", "--hidden-dropout", "0",
          "--attention-dropout", "0",
          "--lr", "3e-3", "--min-lr", "1e-4", "--adam-eps", "1e-6", "--weight-decay", "0.1",
          "--transformer-impl", "local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
          "--no-persist-layer-norm", "--no-masked-softmax-fusion"]
VARIANTS = {
    # the functional test's flags (m = 64 / 16 = 4, MuP's 1/d attention, logits x 1/m), Llama-like layout
    "llama": ["--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "1.7", "--normalization",
              "RMSNorm", "--swiglu", "--ffn-hidden-size", "96", "--group-query-attention", "--num-query-groups", "2",
              "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
    # GPT layout (learned positions, tied, biases) with every other MuP flag set
    "gpt": ["--use-mup", "--mup-base-hidden-size", "32", "--mup-base-head-dim", "8", "--mup-attn-scale-power", "0.5",
            "--mup-output-mult", "0.3", "--ffn-hidden-size", "128", "--position-embedding-type", "learned_absolute",
            "--no-bias-gelu-fusion"],  # megatron-core then runs the erf GeLU, as ours
}


def _megatron_groups(args, model) -> dict[str, tuple]:
    """megatron-core's (max_lr, min_lr, eps, wd_mult) per parameter name, as Megatron-LM's setup_model_and_optimizer
    builds its param groups under --use-mup."""
    from megatron.core.optimizer import _get_param_groups, get_mup_config_overrides
    from megatron.training.training import get_megatron_optimizer_config

    config, overrides = get_megatron_optimizer_config(args)
    overrides = {**(overrides or {}), **get_mup_config_overrides(config, model.config.mup_width_mult, config.optimizer)}
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in _get_param_groups([model], config, overrides):
        for p in g["params"]:
            out[names[id(p)]] = (g["max_lr"], g["min_lr"], g.get("eps", config.adam_eps), g["wd_mult"])
    return out


def _our_groups(cfg, model) -> dict[str, tuple]:
    from megatron_cai.core.optimizer.config import applies_weight_decay

    opt, sched = cfg.optimizer, cfg.scheduler
    out = {}
    for n, p in model.named_parameters():
        kind = opt.lr_kind(n, p.dim())
        mult = sched.mup_lr_mult if kind == "mup" else 1.0
        out[n] = (sched.lr * mult, sched.min_lr * mult, opt.eps_of(kind), float(applies_weight_decay(n, p.dim() > 1)))
    return out


def _as_ours(config, values: dict[str, tuple]) -> dict:
    """``{megatron-core name: (value, shape)}`` moved onto our names by the checkpoint converter (each value
    coded as a constant tensor, so fused / split tensors carry it along)."""
    from megatron_cai.interop.megatron import from_megatron_state_dict

    codes = sorted({v for v, _ in values.values()})
    shards = {n: [torch.full(shape, float(codes.index(v)))] for n, (v, shape) in values.items()}
    out = {}
    for n, t in from_megatron_state_dict(config, shards).items():
        assert t.min() == t.max(), n  # one megatron-core tensor's value per tensor of ours
        out[n] = codes[int(t.flatten()[0])]
    return out


def _worker(rank, world):
    return {variant: _compare(variant) for variant in VARIANTS}  # one process for both: megatron-core imports once


def _compare(variant: str) -> dict:
    mcore_cpu.shim_cpu()
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.interop.megatron import config_from_megatron_args, from_megatron_state_dict
    from megatron_cai.training.arguments import parse_config

    if not mps.model_parallel_is_initialized():
        mps.initialize_model_parallel(1)
        ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    flags = COMMON + VARIANTS[variant]
    args = mcore_cpu.megatron_args(flags + ["--tokenizer-type", "NullTokenizer", "--use-cpu-initialization"], 1,
                                   padded_vocab=(VOCAB, 8, 1))
    theirs = mcore_cpu.megatron_model(args)
    ours_cfg = parse_config(flags + ["--mock-data"], world_size=1)
    cfg = ours_cfg.model
    assert cfg.mup == config_from_megatron_args(args).mup  # our flags and the converter read MuP alike
    ours = GPTModel(cfg)
    ours.initialize(7)

    # initialisation: the std of each freshly initialised matrix (>= 4096 elements: within ~2%)
    mine = dict(ours.named_parameters())
    their_std = _as_ours(cfg, {n: (p.std().item(), p.shape) for n, p in theirs.named_parameters() if p.dim() > 1})
    std_ratio = {n: mine[n].std().item() / std for n, std in their_std.items()}

    # logits from the same (perturbed) weights
    with torch.no_grad():
        for i, (n, p) in enumerate(sorted(theirs.named_parameters())):
            g = torch.Generator().manual_seed(i)
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.3) + (1.0 if "norm" in n else 0))
        ours.load_state_dict(from_megatron_state_dict(cfg, {n: [p] for n, p in theirs.state_dict().items()
                                                            if torch.is_tensor(p)}), strict=True)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(SEQ).expand(2, SEQ)
        ref = mcore_cpu.megatron_logits(theirs.eval(), tokens, pos)
        got = ours.eval()(tokens, pos)
    shapes = {n: p.shape for n, p in theirs.named_parameters()}
    groups_theirs = _as_ours(cfg, {n: (v, shapes[n]) for n, v in _megatron_groups(args, theirs).items()})
    return {"std_ratio": std_ratio, "logit_err": (got - ref).abs().max().item(), "logit_scale": ref.abs().max().item(),
            "groups_theirs": groups_theirs, "groups_ours": _our_groups(ours_cfg, ours),
            "width_mult": theirs.config.mup_width_mult, "softmax_scale": theirs.config.softmax_scale}


def test_mup_matches_megatron_core():
    (results,) = run_distributed(_worker, 1)
    for r in results.values():
        _check(r)


def _check(r: dict) -> None:
    assert r["width_mult"] in (2.0, 4.0) and r["softmax_scale"] != 0.5  # MuP is on in megatron-core
    bad = {n: x for n, x in r["std_ratio"].items() if abs(x - 1.0) > 0.06}
    assert not bad and len(r["std_ratio"]) >= 6, r["std_ratio"]
    assert r["logit_err"] < 1e-4 * r["logit_scale"], r
    assert r["groups_ours"] == r["groups_theirs"]
    assert len(set(r["groups_ours"].values())) >= 3  # hidden, vector-like without decay, embedding-class

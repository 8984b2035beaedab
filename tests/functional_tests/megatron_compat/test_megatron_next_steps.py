"""The commands that the Megatron-LM converters print are complete: followed as printed, for every model option we
export and import, they rebuild the same model.

For each option a checkpoint of ours (random weights, norms and biases included) is exported with
``tools/convert_checkpoint.py --to-megatron``; the printed "continue in Megatron-LM with" flags go, as printed, to
Megatron-LM's own ``parse_args``, ``load_args_from_checkpoint`` (``--use-checkpoint-args``), ``validate_args`` and
``load_checkpoint`` (strict) on the real megatron-core 0.19.2 (tests/mcore_cpu.py); its logits must be ours. The
export is then imported back with ``--from-megatron``; the printed ``pretrain_gpt.py`` flags go to our parser, and
the model they build, loaded from the import, must give the same logits again. A flag missing from either line
(``--qk-layernorm``, ``--norm-epsilon``, ``--no-bias-gelu-fusion``, ``--use-rope-scaling``, ``--rotary-percent``,
``--add-qkv-bias``, ...) changes the rebuilt model, and the logits with it.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import typing
from types import SimpleNamespace

import pytest
import torch
from testlib.distributed import run_distributed

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
pytest.importorskip("megatron.training.arguments")

VOCAB, DIVISIBLE, SEQ = 60, 8, 16
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=64, seq_length=SEQ,
            max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
LLAMA = dict(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=96, num_query_groups=2,
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False)
OPTIONS = {
    "gpt2_tanh_gelu": dict(position_embedding_type="learned_absolute", activation="gelu_tanh"),
    "erf_gelu_with_biases": dict(activation="gelu_erf"),
    "erf_gelu_without_biases": dict(activation="gelu_erf", add_bias_linear=False),
    "squared_relu_half_rotary": dict(activation="relu2", position_embedding_type="rope", rotary_percent=0.5),
    "layernorm_1p": dict(activation="relu2", apply_layernorm_1p=True, add_bias_linear=False),
    "no_positions": dict(activation="relu2", position_embedding_type="none"),
    "llama": LLAMA,
    "llama_qk_layernorm_eps": {**LLAMA, "qk_layernorm": True, "layernorm_epsilon": 1e-6, "rotary_base": 500.0},
    "llama31_rope_scaling": {**LLAMA, "rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000.0},
    "qwen2_qkv_bias": {**LLAMA, "add_qkv_bias": True, "rotary_base": 1000000.0},
}
MEGATRON_RUN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--use-cpu-initialization",
                "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                "--no-masked-softmax-fusion"]  # what "..." stands for: data, batch and CPU kernels, no model flags
OUR_RUN = ["--mock-data", "--train-iters", "1", "--seq-length", str(SEQ), "--micro-batch-size", "2"]
PRINTED = re.compile(r"pretrain_gpt\.py --load (\S+) (.*?) \.\.\.")


def _checkpoint(root: str, config) -> None:
    """Ours, TP = 1, random weights (norm weights around 1, biases around 0, all distinct)."""
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.interop.hf import param_layout
    from megatron_cai.training.checkpoint import CanonicalCheckpoint, Layout, save_resharded

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPTModel(config).named_parameters()}
    g = torch.Generator().manual_seed(5)
    model = {n: torch.randn(s, generator=g) * (0.1 if "norm" in n else 0.3) + (1.0 if "norm" in n and
                                                                               not config.apply_layernorm_1p else 0.0)
             for n, s in shapes.items()}
    ck = CanonicalCheckpoint(config=config, iteration=3, model=model, layout_meta=param_layout(config),
                             counters={"iteration": 3, "consumed_train_samples": 6}, source=Layout(1, 1))
    with contextlib.redirect_stdout(io.StringIO()):
        save_resharded(ck, root, Layout(1, 1), make_vocab_size_divisible_by=DIVISIBLE, with_optimizer=False)


def _our_logits(root: str, config, tokens, pos) -> torch.Tensor:
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.training.checkpoint import load_torch_checkpoint

    model = GPTModel(config)
    chunk = SimpleNamespace(module=model)  # the loader reads ModelChunk.module only
    load_torch_checkpoint(root, [chunk], None, None, config, load_optim=False, load_rng=False)
    with torch.no_grad():
        return model.eval()(tokens, pos)[..., :VOCAB]


def _convert(argv: list[str]) -> str:
    import convert_checkpoint

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert convert_checkpoint.main(argv) == 0, out.getvalue()
    return out.getvalue()


def _printed(log: str) -> tuple[str, list[str]]:
    m = PRINTED.search(log.replace("\n", " "))
    assert m, log
    return m.group(1), m.group(2).split()


def _worker(rank: int, world: int, tmp: str) -> dict:
    from testlib import mcore_cpu

    mcore_cpu.shim_cpu()
    from megatron.core import parallel_state as mps

    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.checkpoint import read_metadata

    mps.initialize_model_parallel(tensor_model_parallel_size=1)
    ps.initialize_model_parallel()
    g = torch.Generator().manual_seed(0)
    tokens, pos = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ)
    out = {}
    for name, option in OPTIONS.items():
        config = GPTConfig(**{**BASE, **option})
        ours, meg, back = (os.path.join(tmp, name, d) for d in ("ours", "megatron", "back"))
        _checkpoint(ours, config)
        ref = _our_logits(ours, config, tokens, pos)
        load, flags = _printed(_convert(["--to-megatron", "--load", ours, "--save", meg]))
        if config.apply_layernorm_1p:  # megatron-core's torch norms (no Apex / TE on CPU) lack zero-centred gamma
            args = mcore_cpu.megatron_args(["--load", load, *flags, *MEGATRON_RUN], 1,
                                           before_validation=mcore_cpu.args_from_checkpoint)
            theirs, loaded = ref if args.layernorm_zero_centered_gamma else -ref, (3, 6)
        else:
            model, args, loaded = mcore_cpu.megatron_lm_load(["--load", load, *flags, *MEGATRON_RUN], 1)
            with torch.no_grad():
                theirs = mcore_cpu.megatron_logits(model, tokens, pos)[..., :VOCAB]
        load, flags = _printed(_convert(["--from-megatron", "--load", meg, "--save", back]))
        rebuilt = parse_config(["--load", load, *flags, *OUR_RUN], world_size=1).model
        again = _our_logits(back, rebuilt, tokens, pos)
        out[name] = {"megatron": (theirs - ref).abs().max().item(), "ours": (again - ref).abs().max().item(),
                     "scale": ref.abs().max().item(), "loaded": loaded,
                     "diff": GPTConfig.from_dict(read_metadata(back, 3)["model_config"]).architecture_diff(rebuilt),
                     "eps": (rebuilt.layernorm_epsilon, config.layernorm_epsilon),
                     "rope": (rebuilt.rotary_base, config.rotary_base)}
    return out


def test_printed_commands_rebuild_every_option(tmp_path):
    results = run_distributed(_worker, 1, (str(tmp_path),))[0]
    assert set(results) == set(OPTIONS)
    for name, r in results.items():
        assert r["scale"] > 1.0, name  # logits of substance
        assert r["megatron"] < 1e-5 * r["scale"], f"{name}: Megatron-LM, following the printed flags: {r}"
        assert r["loaded"] == (3, 6), name
        assert r["diff"] == [], name  # what --load checks (the import keeps Megatron's 64 padded rows as vocabulary)
        assert r["eps"][0] == r["eps"][1] and r["rope"][0] == r["rope"][1], name
        assert r["ours"] < 1e-5 * r["scale"], f"{name}: pretrain_gpt.py, following the printed flags: {r}"

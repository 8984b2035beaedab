"""An MoE model of ours exported to megatron-core's layout gives megatron-core's GPTModel our logits.

Our MoE GPT (a dense first layer, then an MoE layer: 4 experts, top-2, sigmoid scores with the expert bias moved
by training, SwiGLU experts, a gated shared expert, RMSNorm, RoPE, untied) trains 2 iterations and saves; it is
exported with ``tools/convert_checkpoint.py --to-megatron``, and the printed "continue in Megatron-LM with" flags
go, as printed, to Megatron-LM's own ``parse_args``, ``load_args_from_checkpoint``, ``validate_args`` and
``load_checkpoint`` (strict) on the real megatron-core 0.19.2 (its decoder block spec, local layers, allgather
dispatcher, on CPU with an explicit causal mask). Its logits equal ours to 1e-5. Formats megatron-core would read
differently (torch_dist, the Transformer-Engine spec) and the import of a Megatron-LM MoE checkpoint are refused by
name. The export imported back (``--from-megatron``), into the model that the printed ``pretrain_gpt.py`` flags
build, gives our logits again."""
from __future__ import annotations

import contextlib
import io
import os
import typing

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import train

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
pytest.importorskip("megatron.training.arguments")

from functional_tests.megatron_compat.test_megatron_next_steps import (  # noqa: E402
    MEGATRON_RUN,
    OUR_RUN,
    SEQ,
    VOCAB,
    _convert,
    _our_logits,
    _printed,
)

OURS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8",
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--init-method-std", "0.2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
        "--moe-layer-freq", "([0]+[1])", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--moe-aux-loss-coeff", "0.01", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
        "--lr-decay-style", "constant", "--eval-iters", "0", "--num-workers", "0", "--ckpt-format", "torch"]


def _worker(rank: int, world: int, tmp: str) -> dict:
    from testlib import mcore_cpu

    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.checkpoint import read_metadata

    ours, meg = os.path.join(tmp, "ours"), os.path.join(tmp, "megatron")
    with contextlib.redirect_stdout(io.StringIO()):
        train(OURS + ["--save", ours], world)
    mcore_cpu.shim_cpu()
    from megatron.core import parallel_state as mps

    mps.initialize_model_parallel(tensor_model_parallel_size=1)
    config = GPTConfig.from_dict(read_metadata(ours, 2)["model_config"])
    g = torch.Generator().manual_seed(0)
    tokens, pos = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ)
    ref = _our_logits(ours, config, tokens, pos)
    load, flags = _printed(_convert(["--to-megatron", "--load", ours, "--save", meg]))
    model, args, loaded = mcore_cpu.megatron_lm_load(["--load", load, *flags, *MEGATRON_RUN], 1)
    with torch.no_grad():
        theirs = mcore_cpu.megatron_logits(model, tokens, pos)[..., :VOCAB]
    bias = model.decoder.layers[1].mlp.router.expert_bias
    written = torch.load(os.path.join(meg, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    names = ({n for n, v in written["model"].items() if torch.is_tensor(v)},
             {n for n, v in model.state_dict().items() if torch.is_tensor(v)})  # its load does not catch extra keys
    back = os.path.join(tmp, "back")  # and back: --from-megatron, our logits again
    ours_load, ours_flags = _printed(_convert(["--from-megatron", "--load", meg, "--save", back]))
    imported = parse_config(["--load", ours_load, *ours_flags, *OUR_RUN], world_size=1).model  # as printed
    again = _our_logits(back, imported, tokens, pos)
    refusals = {}
    for extra in (["--megatron-ckpt-format", "torch_dist"], ["--megatron-spec", "transformer_engine"]):
        with pytest.raises(AssertionError) as e:
            _convert(["--to-megatron", "--load", ours, "--save", os.path.join(tmp, "refused"), *extra])
        refusals[extra[-1]] = str(e.value)
    return {"diff": (theirs - ref).abs().max().item(), "round_trip": (again - ref).abs().max().item(),
            "architecture": imported.moe_architecture == config.moe_architecture, "scale": ref.abs().max().item(),
            "loaded": loaded,
            "experts": (args.num_experts, args.moe_router_topk, args.moe_shared_expert_gate),
            "bias_moved": bias.abs().max().item(), "flags": flags, "refusals": refusals, "names": names}


@pytest.mark.slow
def test_exported_moe_model_gives_megatron_core_our_logits(tmp_path):
    r = run_distributed(_worker, 1, (str(tmp_path),))[0]
    assert r["scale"] > 1.0 and r["bias_moved"] > 0.01  # logits of substance; the expert bias carried over
    assert r["diff"] < 1e-5, r["diff"]
    assert r["round_trip"] < 1e-5 and r["architecture"], r["round_trip"]  # (its vocabulary: Megatron's padded rows)
    assert r["names"][0] == r["names"][1]  # every weight under megatron-core's name, none left over
    assert r["experts"] == (4, 2, True) and "--moe-shared-expert-gate" in r["flags"]
    assert r["loaded"][0] == 2
    for fmt, text in r["refusals"].items():
        assert "MoE" in text and fmt in text, text

"""Model flags of Megatron-LM's Llama 3.1 / Qwen2.5 / GPT-3 scripts, each against an independent implementation:
--use-rope-scaling (transformers' Llama 3 RoPE and megatron-core's RotaryEmbedding), Megatron's default erf GeLU
(torch's exact GeLU, not the tanh approximation), --add-qkv-bias and --padded-vocab-size (the parameters built)."""
from __future__ import annotations

import contextlib
import io
import math
import typing

import pytest
import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.transformer.mlp import MLP
from megatron_cai.core.transformer.rope import rotary_inv_freq
from megatron_cai.training.arguments import parse_config


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


BASE = ["--mock-data", "--vocab-size", "100", "--train-iters", "1", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16"]


@pytest.mark.parametrize("head_dim, base, factor", [(128, 500000.0, 8.0), (64, 500000.0, 32.0), (16, 10000.0, 8.0)])
def test_rope_scaling_matches_transformers_llama3(head_dim, base, factor):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=131072,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": base, "factor": factor,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = rotary_inv_freq(head_dim, base, scaling_factor=factor)
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = rotary_inv_freq(head_dim, base)
    assert not torch.allclose(ours, plain)  # the scaling changes the low frequencies


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rope_scaling_matches_megatron_core(rotary_percent):
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    mrope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = mrope.RotaryEmbedding(kv_channels=128, rotary_percent=rotary_percent, rotary_base=500000,
                                       rope_scaling=True, rope_scaling_factor=8.0, use_cpu_initialization=True)
    cfg = parse_config(BASE + ["--position-embedding-type", "rope", "--kv-channels", "128", "--rotary-base", "500000",
                               "--rotary-percent", str(rotary_percent), "--use-rope-scaling"], world_size=1).model
    assert cfg.rope_scaling and cfg.rope_scaling_factor == 8.0
    from megatron_cai.core.models.gpt.model import rotary_dim

    torch.testing.assert_close(rotary_inv_freq(rotary_dim(cfg), cfg.rotary_base, cfg.rope_scaling_factor),
                               theirs.inv_freq.float(), rtol=1e-6, atol=0)


def test_rope_scaling_exports_to_transformers_llama(tmp_path):
    """A Llama 3.1-style model (--use-rope-scaling) exported to transformers gives the same logits."""
    transformers = pytest.importorskip("transformers")
    from megatron_cai.interop.hf import export_to_hf, param_layout
    from megatron_cai.training.checkpoint import CanonicalCheckpoint, Layout, save_resharded

    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=96,
                       ffn_hidden_size=96, seq_length=64, max_position_embeddings=32768, normalization="RMSNorm",
                       activation="swiglu", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                       position_embedding_type="rope", rotary_base=500000.0, rope_scaling=True,
                       rope_scaling_factor=8.0, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config)
    model.initialize(3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ck = CanonicalCheckpoint(config=config, iteration=1, model=weights, layout_meta=param_layout(config),
                             counters={"iteration": 1}, source=Layout(1, 1))
    with contextlib.redirect_stdout(io.StringIO()):
        save_resharded(ck, str(tmp_path / "ckpt"), Layout(1, 1), make_vocab_size_divisible_by=32,
                       with_optimizer=False)
        assert export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=lambda *a: None) == "llama"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))
    pos = 16000 + torch.arange(64).expand(2, 64)  # far into the context, where the scaled frequencies turn
    with torch.no_grad():
        ours = model.eval()(tokens, pos)[..., :96]
        theirs = hf(tokens, position_ids=pos).logits
    assert (ours - theirs).abs().max() < 1e-4 * ours.abs().max()
    unscaled = GPTModel(GPTConfig(**{**config.to_dict(), "rope_scaling": False}))
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():  # the scaling matters at this length: the comparison would catch a missing one
        assert (unscaled.eval()(tokens, pos)[..., :96] - theirs).abs().max() > 100 * (ours - theirs).abs().max()


def test_default_mlp_is_megatrons_erf_gelu():
    """No activation flag: Megatron-LM's GeLU (erf), not squared ReLU nor the tanh approximation."""
    assert parse_config(BASE, world_size=1).model.activation == "gelu_erf"
    assert parse_config(BASE + ["--squared-relu"], world_size=1).model.activation == "relu2"
    assert parse_config(BASE + ["--openai-gelu"], world_size=1).model.activation == "gelu_tanh"
    torch.manual_seed(0)
    mlp = MLP(16, 32, "gelu_erf", True, torch.nn.init.normal_, torch.nn.init.normal_, False)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    x = torch.randn(8, 16) * 3
    h = F.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    exact = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))  # Megatron's F.gelu, written out
    want = F.linear(exact, mlp.linear_fc2.weight, mlp.linear_fc2.bias)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    tanh = MLP(16, 32, "gelu_tanh", True, torch.nn.init.normal_, torch.nn.init.normal_, False)
    tanh.load_state_dict(mlp.state_dict())
    assert (tanh(x) - want).abs().max() > 1e-4  # the two GeLUs differ visibly at this scale


def test_legacy_gelu_checkpoints_read_as_tanh():
    """Configurations saved before erf GeLU existed called the tanh GeLU "gelu"."""
    saved = GPTConfig(activation="gelu_tanh").to_dict()
    saved["activation"] = "gelu"
    assert GPTConfig.from_dict(saved).activation == "gelu_tanh"
    with pytest.raises(ValueError, match="ambiguous"):
        GPTConfig(activation="gelu")


def test_qkv_bias_and_padded_vocab_build_those_parameters():
    cfg = parse_config(BASE + ["--disable-bias-linear", "--add-qkv-bias", "--padded-vocab-size", "160"],
                       world_size=1).model
    names = {n: tuple(p.shape) for n, p in GPTModel(cfg).named_parameters()}
    biases = sorted(n.split(".", 3)[-1] for n in names if n.endswith(".bias") and ".layers.0." in n)
    assert biases == ["input_layernorm.bias", "pre_mlp_layernorm.bias", "self_attention.linear_kv.bias",
                      "self_attention.linear_q.bias"]
    assert names["embedding.word_embeddings.weight"] == (160, 64) and cfg.vocab_size == 100
    plain = parse_config(BASE + ["--disable-bias-linear"], world_size=1).model
    assert not any(n.endswith("linear_q.bias") for n, _ in GPTModel(plain).named_parameters())
    from megatron_cai.training.arguments import ArgumentError

    with pytest.raises(ArgumentError, match="smaller than the vocabulary"):
        parse_config(BASE + ["--padded-vocab-size", "64"], world_size=1)

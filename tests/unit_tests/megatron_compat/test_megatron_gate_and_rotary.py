"""--rotary-interleaved against megatron-core's RotaryEmbedding and _apply_rotary_pos_emb_bshd, and
--attention-output-gate against megatron-core's SelfAttention.get_query_key_value_tensors (its fused linear_qkv
layout, the gate after each group's query heads) and _apply_output_gate."""
from __future__ import annotations

import types
import typing

import pytest
import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.transformer.rope import apply_rotary, rotary_cos_sin
from megatron_cai.core.transformer.self_attention import SelfAttention

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
mattention = pytest.importorskip("megatron.core.transformer.attention")


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_megatron_core(percent, interleaved, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its forward moves inv_freq to the device
    head_dim, seq = 16, 10
    theirs = rope.RotaryEmbedding(kv_channels=head_dim, rotary_percent=percent, rotary_base=500.0,
                                  rotary_interleaved=interleaved, use_cpu_initialization=True)
    emb = theirs.forward.__wrapped__(theirs, seq)  # [s, 1, 1, rot_dim] (lru_cache bypassed)
    x = torch.randn(seq, 2, 3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = rope_utils._apply_rotary_pos_emb_bshd(x, emb.double(), rotary_interleaved=interleaved)
    cos, sin = rotary_cos_sin(torch.arange(seq).expand(2, seq), int(head_dim * percent), 500.0, torch.float64,
                              interleaved=interleaved)
    got = apply_rotary(x.transpose(0, 1), cos, sin, interleaved).transpose(0, 1)  # ours is [b, s, heads, d]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # cos / sin: fp32 here, fp64 there
    if interleaved and percent == 1.0:  # not the halves convention
        assert not torch.allclose(got, rope_utils._apply_rotary_pos_emb_bshd(x, emb.double()))


class _Linear(torch.nn.Module):
    """megatron-core's linear interface: ``(output, bias)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight), None


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 3)])
def test_output_gate_matches_megatron_core(heads, groups):
    hd, h, s, b = 8, heads * 8, 5, 2
    config = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, num_query_groups=groups,
                       vocab_size=32, seq_length=s, hidden_dropout=0.0, attention_dropout=0.0,
                       position_embedding_type="none", add_bias_linear=False, attention_output_gate=True,
                       attention_backend="eager")
    torch.manual_seed(0)
    model = GPTModel(config)
    model.initialize(1)
    attn = next(m for m in model.modules() if isinstance(m, SelfAttention))
    with torch.no_grad():  # a gate far from 0 so that the gate matters
        attn.linear_gate.weight.normal_(0, 0.5)
    wq, wg = attn.linear_q.weight.detach(), attn.linear_gate.weight.detach()
    wk, wv = attn.linear_kv.weight.detach().chunk(2)
    per = heads // groups
    rows = []  # megatron-core's linear_qkv with the gate: per group [q heads | gate heads | k | v]
    for g in range(groups):
        rows += [wq[g * per * hd:(g + 1) * per * hd], wg[g * per * hd:(g + 1) * per * hd],
                 wk[g * hd:(g + 1) * hd], wv[g * hd:(g + 1) * hd]]
    fake = types.SimpleNamespace(linear_qkv=_Linear(torch.cat(rows)), num_attention_heads_per_partition=heads,
                                 num_query_groups_per_partition=groups, hidden_size_per_attention_head=hd,
                                 world_size=1, q_layernorm=None, k_layernorm=None,
                                 config=types.SimpleNamespace(num_query_groups=groups, test_mode=False))
    x = torch.randn(s, b, h)  # megatron-core's [s, b, h]
    q, k, v, gate = mattention.SelfAttention.get_query_key_value_tensors(fake, x, output_gate=True)
    k, v = (t.repeat_interleave(per, dim=2) for t in (k, v))
    core = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    core = core.permute(2, 0, 1, 3).reshape(s, b, h)
    gated = mattention.Attention._apply_output_gate.__wrapped__(None, core, gate) \
        if hasattr(mattention.Attention._apply_output_gate, "__wrapped__") else \
        mattention.Attention._apply_output_gate(None, core, gate)
    expected = F.linear(gated, attn.linear_proj.weight.detach())
    got = attn(x.transpose(0, 1), None).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    attn.linear_gate = None  # the same layer without its gate differs
    assert not torch.allclose(attn(x.transpose(0, 1), None).transpose(0, 1), expected, atol=1e-3)


def test_the_flags_reach_the_model_config():
    from megatron_cai.training.arguments import parse_config

    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--position-embedding-type", "rope"]
    model = parse_config(base + ["--rotary-interleaved", "--attention-output-gate"], world_size=1).model
    assert model.rotary_interleaved and model.attention_output_gate
    assert {"rotary_interleaved", "attention_output_gate"} <= set(GPTConfig.ARCHITECTURE_FIELDS)
    plain = parse_config(base, world_size=1).model
    assert not plain.rotary_interleaved and not plain.attention_output_gate


@pytest.mark.parametrize("field", ["rotary_interleaved", "attention_output_gate"])
def test_conversions_refuse_what_they_cannot_write(field):
    from megatron_cai.interop.hf import ARCHITECTURES, unsupported_reasons
    from megatron_cai.interop.megatron import ConversionError, megatron_args

    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, **{field: True})
    flag = "--" + field.replace("_", "-")
    assert all(any(flag in why for why in unsupported_reasons(config, arch)) for arch in ARCHITECTURES)
    with pytest.raises(ConversionError, match=flag):
        megatron_args(config, tp=1, pp=1, padded_vocab_size=64, divisible=1, iteration=0, counters={})

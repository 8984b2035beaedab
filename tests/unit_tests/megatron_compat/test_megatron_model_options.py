"""Megatron-LM model options: --rotary-percent (against megatron-core's own RoPE), --apply-layernorm-1p,
--qk-layernorm (against a hand-written attention), --position-embedding-type none, and recompute
(--recompute-granularity selective / full with --recompute-method uniform|block)."""
from __future__ import annotations

import typing

import pytest
import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.transformer.norms import LayerNorm, RMSNorm
from megatron_cai.core.transformer.rope import apply_rotary, rotary_cos_sin
from megatron_cai.core.transformer.self_attention import SelfAttention


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=12,
                hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope")
    base.update(kw)
    return GPTConfig(**base)


def _model(seed: int = 3, **kw) -> GPTModel:
    torch.manual_seed(seed)
    m = GPTModel(_config(**kw))
    m.initialize(seed)
    return m


def _batch(seed: int = 0, b: int = 2, s: int = 12):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (b, s), generator=g)
    labels = torch.randint(0, 64, (b, s), generator=g)
    return tokens, torch.arange(s).expand(b, s), labels


@pytest.mark.parametrize("percent", [1.0, 0.5, 0.25])
def test_rotary_percent_matches_megatron_core(percent):
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    head_dim, seq = 16, 10
    theirs = rope.RotaryEmbedding(kv_channels=head_dim, rotary_percent=percent, rotary_base=500.0,
                                  use_cpu_initialization=True)
    freqs = theirs.get_freqs_non_repeated(seq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # what get_emb builds (on CUDA)
    x = torch.randn(seq, 2, 3, head_dim, dtype=torch.float64)  # [s, b, heads, d]
    expected = utils._apply_rotary_pos_emb_bshd(x, emb.double())
    cfg = _config(kv_channels=head_dim, rotary_percent=percent, rotary_base=500.0)
    from megatron_cai.core.models.gpt.model import rotary_dim

    cos, sin = rotary_cos_sin(torch.arange(seq).expand(2, seq), rotary_dim(cfg), 500.0, torch.float64)
    got = apply_rotary(x.transpose(0, 1), cos, sin).transpose(0, 1)  # ours is [b, s, heads, d]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_layernorm_1p_scales_by_one_plus_weight(cls):
    norm = cls(8, 1e-5, zero_centered=True)
    assert torch.equal(norm.weight.detach(), torch.zeros(8))  # gamma starts at 1
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8)
    if cls is LayerNorm:
        expected = F.layer_norm(x, (8,), norm.weight + 1, norm.bias, 1e-5)
    else:
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (norm.weight + 1)
    torch.testing.assert_close(norm(x), expected)


def test_layernorm_1p_model_equals_plain_model_with_shifted_weights():
    one_p, plain = _model(apply_layernorm_1p=True), _model(apply_layernorm_1p=False)
    with torch.no_grad():
        for (name, p), (name2, q) in zip(one_p.named_parameters(), plain.named_parameters()):
            assert name == name2
            if "layernorm" in name and name.endswith("weight"):
                p.normal_(0, 0.1)
                q.copy_(p + 1)
            else:
                q.copy_(p)
    tokens, pos, labels = _batch()
    torch.testing.assert_close(one_p(tokens, pos, labels=labels), plain(tokens, pos, labels=labels))


def test_qk_layernorm_matches_a_hand_written_attention():
    cfg = _config(qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False)
    torch.manual_seed(0)
    attn = SelfAttention(cfg, 0, lambda w: torch.nn.init.normal_(w, 0, 0.2), lambda w: torch.nn.init.normal_(w, 0, 0.2))
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 12, 32)
    got = attn(x, None)
    b, s, h, d = 2, 12, 4, 8
    q = (x @ attn.linear_q.weight.T).view(b, s, h, d)
    k, v = (x @ attn.linear_kv.weight.T).chunk(2, dim=-1)
    k, v = k.reshape(b, s, h, d), v.reshape(b, s, h, d)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w

    q, k = rms(q, attn.q_layernorm.weight), rms(k, attn.k_layernorm.weight)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, h * d)
    torch.testing.assert_close(got, out @ attn.linear_proj.weight.T, atol=1e-5, rtol=1e-5)
    assert attn.q_layernorm.weight.allreduce_over_tp  # each TP rank sees other heads: gradients summed


def test_position_embedding_none_ignores_positions():
    for kind, ignores in (("none", True), ("rope", False), ("learned_absolute", False)):
        m = _model(position_embedding_type=kind)
        tokens, pos, labels = _batch()
        shifted = pos.flip(-1)
        same = torch.allclose(m(tokens, pos, labels=labels), m(tokens, shifted, labels=labels))
        assert same == ignores, kind
    assert _model(position_embedding_type="none").embedding.position_embeddings is None


def _forward_counts(model: GPTModel) -> tuple[dict[int, int], dict[int, int]]:
    layer_calls: dict[int, int] = {}
    attn_calls: dict[int, int] = {}
    for number, layer in model.decoder.layers.items():
        n = int(number)
        layer.register_forward_pre_hook(lambda *_a, n=n: layer_calls.__setitem__(n, layer_calls.get(n, 0) + 1))
        orig = layer.self_attention._core_attention

        def counted(*a, n=n, orig=orig):
            attn_calls[n] = attn_calls.get(n, 0) + 1
            return orig(*a)

        layer.self_attention._core_attention = counted
    return layer_calls, attn_calls


RECOMPUTE = {  # (granularity, method, layers) -> forward calls per layer in one forward+backward (4 layers)
    (None, None, None): ([1, 1, 1, 1], [1, 1, 1, 1]),
    ("full", "uniform", 1): ([2, 2, 2, 2], [2, 2, 2, 2]),
    ("full", "uniform", 2): ([2, 2, 2, 2], [2, 2, 2, 2]),
    ("full", "uniform", 3): ([2, 2, 2, 2], [2, 2, 2, 2]),
    ("full", "block", 1): ([2, 1, 1, 1], [2, 1, 1, 1]),
    ("full", "block", 3): ([2, 2, 2, 1], [2, 2, 2, 1]),
    ("full", "block", 0): ([1, 1, 1, 1], [1, 1, 1, 1]),
    ("selective", None, None): ([1, 1, 1, 1], [2, 2, 2, 2]),
}


@pytest.mark.parametrize("key", list(RECOMPUTE), ids=str)
def test_recompute_reruns_what_megatron_reruns_and_keeps_gradients(key):
    granularity, method, layers = key
    ref = _model()
    m = _model(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=layers)
    m.load_state_dict(ref.state_dict())
    layer_calls, attn_calls = _forward_counts(m)
    tokens, pos, labels = _batch()
    ref(tokens, pos, labels=labels).mean().backward()
    m.train()
    m(tokens, pos, labels=labels).mean().backward()
    expected_layers, expected_attn = RECOMPUTE[key]
    assert [layer_calls[i] for i in range(4)] == expected_layers
    assert [attn_calls[i] for i in range(4)] == expected_attn
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=0, atol=0)


def test_uniform_groups_are_megatrons_chunks():
    m = _model(num_layers=5, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert m.decoder.recompute_groups() == [([0, 1], True), ([2, 3], True), ([4], True)]
    m = _model(num_layers=5, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert m.decoder.recompute_groups() == [([0], True), ([1], True), ([2], False), ([3], False), ([4], False)]

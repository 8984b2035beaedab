"""Multi-latent attention (--multi-latent-attention): equal to megatron-core 0.19.2's MLASelfAttention (local spec,
rope_type "rope") given the same weights, forward and backward; trains over packed documents as each document
alone; greedy decoding with the latent cache equals decoding without a cache."""
from __future__ import annotations

import math

import pytest
import torch
from testlib.distributed import run_distributed

MLA = dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           position_embedding_type="rope")


class ReferenceCoreAttention(torch.nn.Module):
    """A causal softmax core attention for megatron-core's MLA (``[s, b, h, d]``, k and v head dims apart): the
    ``k_channels``-taking core attention its local spec lacks on CPU. Written out here, no library code."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.scale = softmax_scale  # megatron-core's base Attention first builds one without it, then MLA again

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None, **_):
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(query.shape[-1])
        s = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
        n = query.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", torch.softmax(s, -1), value)
        return out.reshape(n, query.shape[1], -1)


def _compare_with_megatron(rank, world, q_lora_rank, qk_layernorm, scaling, intervals):
    from testlib.mcore_cpu import shim_cpu

    shim_cpu()
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention as MegatronMLA
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.tensor_parallel.layers import normal_init
    from megatron_cai.core.transformer.mla import MLASelfAttention
    from megatron_cai.core.transformer.rope import rotary_cos_sin

    mps.initialize_model_parallel(1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(0)
    factor, mscale_all_dim = scaling
    mcfg = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope", rotary_scaling_factor=factor,
        mscale_all_dim=mscale_all_dim, normalization="RMSNorm", qk_layernorm=qk_layernorm, add_bias_linear=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False,
        params_dtype=torch.float64)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm, normalization="RMSNorm")
    sub = spec.submodules.self_attention.submodules
    sub.core_attention = ReferenceCoreAttention
    theirs = MegatronMLA(mcfg, sub, layer_number=1, attn_mask_type=AttnMaskType.causal)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))  # norm weights around 1
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, q_lora_rank=q_lora_rank,
                    normalization="RMSNorm", qk_layernorm=qk_layernorm, add_bias_linear=False,
                    rotary_scaling_factor=factor, mscale_all_dim=mscale_all_dim, attention_backend="cpu",
                    attention_dropout=0.0, hidden_dropout=0.0, **MLA)
    ours = MLASelfAttention(cfg, 0, normal_init(0.02), normal_init(0.02)).double()
    their_params = {n: p for n, p in theirs.named_parameters()}
    our_params = dict(ours.named_parameters())
    assert set(their_params) == set(our_params), (sorted(their_params), sorted(our_params))
    with torch.no_grad():
        for n, p in our_params.items():
            p.copy_(their_params[n])
    s, b = 12, 2
    x = torch.randn(s, b, 32, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(s, b, 32, dtype=torch.float64)
    out_theirs, _ = theirs(x, attention_mask=None)
    (out_theirs * dout).sum().backward()
    x_ours = x.detach().transpose(0, 1).clone().requires_grad_(True)
    pos = torch.arange(s).expand(b, s)
    # causal as visibility intervals: the blocked kernel instead of the SDPA fast path
    visibility = (pos.clone(), torch.full_like(pos, s)) if intervals else None
    out_ours = ours(x_ours, rotary_cos_sin(pos, 4, dtype=torch.float64), visibility, pos)
    (out_ours * dout.transpose(0, 1)).sum().backward()
    errors = {"out": float((out_ours.transpose(0, 1) - out_theirs).abs().max()),
              "dx": float((x_ours.grad.transpose(0, 1) - x.grad).abs().max())}
    errors.update({f"d{n}": float((our_params[n].grad - p.grad).abs().max()) for n, p in their_params.items()})
    return errors, sorted(their_params)


@pytest.mark.parametrize("q_lora_rank,qk_layernorm,scaling,intervals", [
    (16, True, (40.0, 0.707), True), (None, False, (1.0, 0.0), False)],
    ids=["q_lora_norms_mscale_intervals", "q_proj_plain_sdpa"])
def test_equals_megatron_core_mla(q_lora_rank, qk_layernorm, scaling, intervals):
    errors, names = run_distributed(_compare_with_megatron, 1, (q_lora_rank, qk_layernorm, scaling, intervals))[0]
    assert ("linear_q_down_proj.weight" in names) == (q_lora_rank is not None)
    assert ("kv_layernorm.weight" in names) == qk_layernorm
    assert max(errors.values()) < 1e-5, errors


def _mla_model(**kw):
    from testlib.tree import tiny_gpt

    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, qk_layernorm=True,
               normalization="RMSNorm", add_bias_linear=False, attention_backend="cpu", **MLA)
    cfg.update(kw)
    return tiny_gpt(**cfg).double()


def test_packed_documents_equal_each_document_alone():
    from megatron_cai.core.transformer import visibility as V

    model = _mla_model()
    lengths = [7, 11, 6]
    tokens = torch.randint(0, 50, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    start, limit = V.from_document_lengths(lengths)
    pos = V.document_position_ids(lengths)[None]
    packed = model(tokens, pos, visibility=(start[None], limit[None]))
    packed.sum().backward()  # gradients flow over the intervals
    at = 0
    for n in lengths:
        alone = model(tokens[:, at:at + n], torch.arange(n)[None])
        torch.testing.assert_close(packed[:, at:at + n], alone, atol=1e-9, rtol=0)
        at += n
    assert all(p.grad is not None for p in model.parameters())


def test_latent_cache_generation_equals_recompute():
    from megatron_cai.core.transformer.self_attention import KVCache
    from megatron_cai.inference.generation import generate, prefill

    model = _mla_model(num_layers=3, window_size=6, window_attn_skip_freq=3).eval()
    prompt = torch.tensor([[3, 17, 5, 42, 8], [9, 9, 1, 0, 33]])
    cached = generate(model, prompt, 20, temperature=0, return_logits=True)
    plain = generate(model, prompt, 20, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(cached.tokens, plain.tokens)
    assert max(float((a - b).abs().max()) for a, b in zip(cached.logits, plain.logits)) < 1e-9
    cache = KVCache()
    prefill(model, prompt, cache)
    latent, k_pe = cache.layers[0]
    assert latent.shape == (2, 1, 5, 8) and k_pe.shape == (2, 1, 5, 4)  # kv_lora_rank + rope dims per token


def test_megatron_flags_build_the_mla_config():
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.errors import UserError

    argv = ["--mock-data", "--vocab-size", "100", "--train-iters", "1", "--num-layers", "2",
            "--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank",
            "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor",
            "40", "--mscale-all-dim", "0.707"]
    model = parse_config(argv + ["--rope-type", "rope"], world_size=1).model
    got = {k: getattr(model, k) for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                          "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
                                          "mscale_all_dim")}
    assert got == {"multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8,
                   "qk_pos_emb_head_dim": 4, "v_head_dim": 6, "rotary_scaling_factor": 40.0, "mscale_all_dim": 0.707}
    with pytest.raises(UserError, match="YaRN RoPE is not implemented here; pass --rope-type rope"):
        parse_config(argv, world_size=1)

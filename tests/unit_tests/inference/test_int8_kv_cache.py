"""The int8 KV cache: codes and scales by the dynamic-clamping rule per (row, head, block), written once per block,
stored once per sharing group, bytes counted from its tensors; greedy decoding close to the full-precision cache."""
from __future__ import annotations

import pytest
import torch
from testlib.kaiju_model import kaiju_model

from megatron_cai.core.transformer.int8_kv_cache import Int8KVCache, cache_bytes, make_kv_cache
from megatron_cai.core.transformer.self_attention import KVCache
from megatron_cai.inference.generation import generate, prefill


def _reference_block(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """One (row, head) block [tokens, d] quantized by hand: c = alpha * RMS, step c / 127, round to nearest."""
    c = alpha * x.double().square().mean().sqrt()
    codes = torch.round(x.double().clamp(-c, c) / (c / 127))
    return codes * (c / 127)


def test_blocks_follow_the_dynamic_clamping_rule():
    torch.manual_seed(0)
    cache = Int8KVCache(block=4, alpha=3.0)
    k, v = torch.randn(2, 3, 10, 8) * 2, torch.randn(2, 3, 10, 8)
    k[0, 1, 2, 5] = 40.0  # an outlier beyond 3 RMS: clamped
    got_k, got_v = cache.update(0, k, v)
    for x, got in ((k, got_k), (v, got_v)):
        for b in range(2):
            for h in range(3):
                for blk in range(2):  # two full blocks; tokens 8-9 wait in the tail unquantized
                    rows = slice(4 * blk, 4 * blk + 4)
                    want = _reference_block(x[b, h, rows], 3.0)
                    torch.testing.assert_close(got[b, h, rows].double(), want, atol=1e-6, rtol=1e-6)
        assert torch.equal(got[:, :, 8:], x[:, :, 8:])
    assert float(got_k[0, 1, 2, 5]) < 40.0
    stored = cache.stored[0][0]
    assert stored.codes.dtype == torch.int8 and stored.codes.shape == (2, 3, 8, 8)
    assert cache_bytes(cache) == 2 * (2 * 3 * 8 * 8 * 1 + 2 * 3 * 2 * 4 + 2 * 3 * 2 * 8 * 4)


def test_a_written_block_never_changes():
    torch.manual_seed(1)
    cache = Int8KVCache(block=4)
    k = torch.randn(1, 1, 3, 8)
    cache.update(0, k, k)
    first, _ = cache.update(0, k[:, :, :2], k[:, :, :2])  # completes block 0 (tokens 0-3), tail 4
    later, _ = cache.update(0, 100 * torch.randn(1, 1, 6, 8), k[:, :, :1].expand(1, 1, 6, 8))
    assert torch.equal(first[:, :, :4], later[:, :, :4])


def test_stored_once_per_sharing_group_and_four_times_smaller():
    model = kaiju_model()
    prompt = torch.randint(0, 50, (1, 64), generator=torch.Generator().manual_seed(0))
    full, int8 = KVCache(), make_kv_cache("int8")
    prefill(model.float(), prompt, full)
    prefill(model.float(), prompt, int8)
    assert sorted(int8.stored) == sorted(full.layers) == [0, 2, 3, 5]
    # fp32 entries (4 bytes) against int8 codes + one fp32 scale per 16 tokens and head
    assert cache_bytes(full) == 4 * 2 * 64 * 8 * 4
    assert cache_bytes(int8) == 4 * 2 * (64 * 8 + 4 * 4)


def test_greedy_with_int8_cache_tracks_the_full_cache():
    model = kaiju_model().float()
    prompt = torch.tensor([[3, 17, 5, 42, 8, 11, 2]])
    ref = generate(model, prompt, 40, temperature=0, return_logits=True)
    got = generate(model, prompt, 40, temperature=0, return_logits=True, kv_cache_dtype="int8")
    # The first tokens are decided before any block is quantized (16 tokens): identical.
    assert torch.equal(got.tokens[:, :16], ref.tokens[:, :16])
    first_diff = float((got.logits[20] - ref.logits[20]).abs().max())
    assert 0 < first_diff < 0.05 * float(ref.logits[20].abs().max())


def test_unknown_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        make_kv_cache("int4")


@pytest.mark.slow
def test_int8_cache_agrees_with_bf16_over_2000_greedy_tokens():
    """Acceptance: a small Kaiju-style model trained by bench/kaiju.py; greedy with the int8 cache agrees with the
    bf16 cache on >= 99% of 2,000 tokens (measured: 100%, |log p| difference mean 1.9e-3)."""
    import argparse
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench")
    sys.path.insert(0, os.path.abspath(bench))
    import kaiju

    result = kaiju.agreement_part(argparse.Namespace(tokens=2000, train_steps=150))
    assert result["agreement"] >= 0.99, result

"""Generation with a Kaiju-style cache (sliding windows on most layers, K/V shared across layers): the cache holds
one entry per sharing group and greedy decoding equals full recompute token for token."""
from __future__ import annotations

import pytest
import torch
from testlib.kaiju_model import kaiju_model

from megatron_cai.core.transformer.self_attention import KVCache
from megatron_cai.inference.generation import generate, prefill


def test_cache_holds_one_entry_per_sharing_group():
    model = kaiju_model()
    cache = KVCache()
    prefill(model, torch.tensor([[1, 2, 3, 4, 5]]), cache)
    assert sorted(cache.layers) == [0, 2, 3, 5]
    assert cache.position_ids.tolist() == [[0, 1, 2, 3, 4]]


def _cache_equals_recompute(tokens: int) -> None:
    model = kaiju_model()
    prompt = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 9, 1, 0, 33, 4, 4]])
    cached = generate(model, prompt, tokens, temperature=0, return_logits=True)
    plain = generate(model, prompt, tokens, temperature=0, use_cache=False, return_logits=True)
    assert cached.new_tokens.shape == (2, tokens)
    assert torch.equal(cached.tokens, plain.tokens)
    worst = max(float((a - b).abs().max()) for a, b in zip(cached.logits, plain.logits))
    assert worst < 1e-9, worst
    assert len(set(cached.new_tokens[0].tolist())) > 5  # not a degenerate repetition of one token


def test_shared_windowed_cache_equals_recompute():
    """CI size: 24 tokens, three times the window."""
    _cache_equals_recompute(24)


@pytest.mark.slow
def test_shared_windowed_cache_equals_recompute_over_200_greedy_tokens():
    _cache_equals_recompute(200)

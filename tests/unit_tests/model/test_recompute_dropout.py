"""Recompute with dropout: --recompute-granularity selective and full give the gradients of a run without
recompute, with attention dropout (the model-parallel stream) and hidden dropout, on the SDPA path and on the
interval path (the recomputation draws the same masks: the tracker's streams are restored for it)."""
from __future__ import annotations

import pytest
import torch

SEQ, VOCAB = 16, 50


def _grads(recompute: str | None, intervals: bool, seed: int = 5) -> torch.Tensor:
    from testlib.tree import tiny_gpt

    from megatron_cai.core.tensor_parallel.random import model_parallel_manual_seed

    extra = {"recompute_method": "uniform", "recompute_num_layers": 1} if recompute == "full" else {}
    model = tiny_gpt("cpu", seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                     attention_dropout=0.5, hidden_dropout=0.2, recompute_granularity=recompute, **extra).train()
    model_parallel_manual_seed(seed, 0, 0, torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    idx = torch.arange(SEQ).expand(2, SEQ)
    visibility = (idx, torch.full_like(idx, SEQ)) if intervals else None
    model(tokens, idx, labels=tokens, visibility=visibility).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("intervals", [False, True], ids=["sdpa", "intervals"])
def test_recompute_draws_the_same_dropout_masks(intervals):
    plain = _grads(None, intervals)
    assert not torch.equal(plain, _grads(None, intervals, seed=6))  # dropout is on: the masks follow the seed
    for recompute in ("selective", "full"):
        torch.testing.assert_close(_grads(recompute, intervals), plain, rtol=0, atol=1e-6)

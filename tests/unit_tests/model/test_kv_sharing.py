"""Cross-layer KV sharing (--kv-share-pattern): a sharing layer computes only queries and attends with its source
layer's K/V; training equals an explicit reference model (tests/testlib/kv_share_reference.py) in loss and every
gradient, with and without recompute; a sharing group split over pipeline stages is refused naming the layers."""
from __future__ import annotations

import pytest
import torch

from megatron_cai.core.parallel_state import ParallelLayoutError
from megatron_cai.core.transformer.layer_pattern import LayerPatternError, kv_sources, validate_patterns

SEQ, VOCAB = 24, 40
PATTERN = [0, 0, 2, 2]  # with --window-size 5 --window-attn-skip-freq 2: layer 1 (global) shares local layer 0's K/V


def _model(recompute: str | None = None, pattern=PATTERN, **kw):
    from testlib.tree import tiny_gpt

    extra = {"recompute_granularity": recompute}
    if recompute == "full":
        extra.update(recompute_method="uniform", recompute_num_layers=1)
    cfg = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=1, kv_channels=8,
               vocab_size=VOCAB, padded_vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ,
               add_bias_linear=False, normalization="RMSNorm", activation="relu2", position_embedding_type="rope",
               window_size=5, window_attn_skip_freq=2, kv_share_pattern=pattern, attention_backend="cpu")
    cfg.update(extra, **kw)
    return tiny_gpt(**cfg).double()


def _batch(seed: int):
    from megatron_cai.core.transformer import visibility as V

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    rows = []
    for lengths in ([7, 9, 8], [SEQ]):
        start, limit = V.from_document_lengths(lengths)
        rows.append((start, limit, V.document_position_ids(lengths)))
    start, limit, pos = V.batch(rows, SEQ)
    return tokens, labels, pos, (start, limit)


def test_sharing_layers_hold_no_kv_weights():
    model = _model()
    names = {n for n, _ in model.named_parameters()}
    for layer in range(4):
        assert (f"decoder.layers.{layer}.self_attention.linear_kv.weight" in names) == (layer in (0, 2))
        assert f"decoder.layers.{layer}.self_attention.linear_q.weight" in names


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_training_equals_explicit_reference(recompute):
    """5 AdamW iterations: the model and the reference (its own copy of the weights, its own optimizer) agree to
    1e-6 in the loss and every gradient at every iteration."""
    from testlib.kv_share_reference import reference_losses
    from testlib.layer_attention import megatron_windows

    model = _model(recompute)
    model.train()
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2)
    windows = megatron_windows(5, 2, 4)
    first = None
    for it in range(5):
        tokens, labels, pos, vis = _batch(it)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(tokens, pos, labels=labels, visibility=vis).mean()
        loss.backward()
        ref_loss = reference_losses(ref, model.config, tokens, labels, pos, vis, PATTERN, windows).mean()
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-6, (it, loss.item(), ref_loss.item())
        for name, p in model.named_parameters():
            where = f"iteration {it} {name}"
            torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-6, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
        opt.step()
        ref_opt.step()
        first = loss.item() if first is None else first
    tokens, labels, pos, vis = _batch(0)
    assert model(tokens, pos, labels=labels, visibility=vis).mean().item() < first  # it trained


def test_source_receives_the_sharers_gradient():
    """The source layer's K/V weights get the gradient of its sharers' attention too: zeroing the sharer's query
    weights (its attention becomes uniform, so its output no longer depends on K) changes the source's dK."""
    tokens, labels, pos, vis = _batch(0)

    def source_kv_grad(zero_sharer_q: bool) -> torch.Tensor:
        model = _model()
        if zero_sharer_q:
            with torch.no_grad():
                model.decoder.layers["1"].self_attention.linear_q.weight.zero_()
        model(tokens, pos, labels=labels, visibility=vis).mean().backward()
        return model.decoder.layers["0"].self_attention.linear_kv.weight.grad.clone()

    assert (source_kv_grad(False) - source_kv_grad(True)).abs().max() > 1e-6


def test_int_pattern_is_groups_of_n():
    assert kv_sources(3, 7) == [0, 0, 0, 3, 3, 3, 6]
    assert validate_patterns(4, None, None, 1) is None  # every layer its own source: no sharing
    assert validate_patterns(4, None, None, 2) == [0, 0, 2, 2]


@pytest.mark.parametrize("pattern,match", [([0, 0, 1], "must hold 4"), ([0, 2, 2, 2], "earlier layer"),
                                           ([0, 0, 1, 1], "itself takes them from layer 0")])
def test_bad_pattern_names_the_flag(pattern, match):
    with pytest.raises(LayerPatternError, match=match):
        validate_patterns(4, None, None, pattern)


def test_sharing_group_across_pipeline_stages_is_refused():
    """Pipeline stage 2 of 2 holds layers 2-3; layer 3 taking layer 1's K/V is refused, naming both."""
    from testlib.tree import tiny_gpt

    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel

    tiny_gpt()  # initialises the model-parallel state
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       kv_share_pattern=[0, 1, 2, 1])
    GPTModel(config, pre_process=True, post_process=False, layer_numbers=[0, 1])  # its sources are held
    with pytest.raises(ParallelLayoutError, match="layer 3 takes K/V from layer 1, which is in another pipeline"):
        GPTModel(config, pre_process=False, post_process=True, layer_numbers=[2, 3])

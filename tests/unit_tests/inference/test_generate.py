"""Sampling with a KV cache: cache vs recompute, greedy vs brute-force argmax, top-k/top-p, seeds, CLI."""
import contextlib
import io
import math
import sys

import pytest
import torch
from testlib import TOOLS

from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.inference.generation import filter_logits, full_logits, generate, load_model, sample_next

sys.path.insert(0, TOOLS)

CONFIGS = {
    "default_gqa": dict(num_query_groups=2),
    "llama_like_mqa": dict(normalization="RMSNorm", activation="swiglu", add_bias_linear=False, num_query_groups=1,
                           untie_embeddings_and_output_weights=True),
    "gpt2_like": dict(position_embedding_type="learned_absolute", activation="gelu_tanh"),
}


def _model(seed=0, **kw) -> GPTModel:
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, padded_vocab_size=56,
                    seq_length=32, max_position_embeddings=40, hidden_dropout=0.0, attention_dropout=0.0,
                    init_method_std=0.2, **kw)
    m = GPTModel(cfg)
    m.initialize(seed)
    return m.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_matches_recompute_and_greedy_is_argmax(name):
    model = _model(**CONFIGS[name])
    prompt = torch.tensor([[3, 17, 5, 42, 8], [9, 9, 1, 0, 33]])
    cached = generate(model, prompt, 12, temperature=0, return_logits=True)
    plain = generate(model, prompt, 12, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(cached.tokens, plain.tokens)
    for a, b in zip(cached.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Brute force: every generated token is the argmax of the full-sequence logits at the previous position,
    # and the logits recorded per step equal those of one forward over the final sequence.
    ref = full_logits(model, cached.tokens)
    for i in range(12):
        pos = prompt.shape[1] - 1 + i
        torch.testing.assert_close(cached.logits[i], ref[:, pos], rtol=1e-5, atol=1e-5)
        assert torch.equal(cached.tokens[:, pos + 1], ref[:, pos].argmax(-1))
    assert cached.logits[0].shape == (2, 50)  # padding rows are not part of the vocabulary


def test_greedy_deterministic_and_top_k_one_is_greedy():
    model = _model(seed=3)
    greedy = generate(model, [1, 2, 3], 16, temperature=0).tokens
    assert torch.equal(greedy, generate(model, [1, 2, 3], 16, temperature=0).tokens)
    for seed in range(3):
        assert torch.equal(greedy, generate(model, [1, 2, 3], 16, temperature=1.5, top_k=1, seed=seed).tokens)
    a = generate(model, [1, 2, 3], 32, temperature=1.0, seed=7).tokens
    b = generate(model, [1, 2, 3], 32, temperature=1.0, seed=7).tokens
    c = generate(model, [1, 2, 3], 32, temperature=1.0, seed=8).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_filter_logits_by_hand():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda t: torch.isfinite(t[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_k=4)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.4)) == [1]          # 0.5 alone reaches 0.4
    assert kept(filter_logits(logits, top_p=0.75)) == [1, 3]      # 0.5 + 0.3
    assert kept(filter_logits(logits, top_p=0.85)) == [1, 2, 3]   # 0.5 + 0.3 + 0.15
    assert kept(filter_logits(logits, top_k=1, top_p=0.99)) == [1]
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0.0)


def test_sampling_frequencies_follow_temperature_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(40000, 4)
    gen = torch.Generator().manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.5, 1.0), (2.0, 0.8)):
        p = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]) / temperature, 0)
        keep = torch.ones(4, dtype=torch.bool)
        if top_p < 1.0:  # independent nucleus: shortest prefix of the sorted probabilities reaching top_p
            order = p.argsort(descending=True)
            n = next(i + 1 for i in range(4) if p[order[: i + 1]].sum() >= top_p)
            keep = torch.zeros(4, dtype=torch.bool)
            keep[order[:n]] = True
        expected = torch.where(keep, p, 0) / p[keep].sum()
        got = torch.bincount(sample_next(logits, temperature, top_p=top_p, generator=gen), minlength=4) / 40000
        sd = torch.sqrt(expected * (1 - expected) / 40000)
        assert torch.all((got - expected).abs() <= 5 * sd + 1e-9), (temperature, top_p, got, expected)


def test_stops_at_eos_and_checks_position_limit():
    model = _model(seed=1)
    greedy = generate(model, [4, 5], 10, temperature=0).new_tokens[0].tolist()
    eos = greedy[3]
    stop = greedy.index(eos)
    out = generate(model, [4, 5], 10, temperature=0, eos_id=eos)
    assert out.new_tokens[0].tolist() == greedy[: stop + 1]
    learned = _model(**CONFIGS["gpt2_like"])
    with pytest.raises(ValueError, match="40 learned positions"):
        generate(learned, list(range(30)), 11, temperature=0)


def test_generate_cli_on_a_trained_checkpoint(tmp_path):
    import generate as generate_tool
    from testlib.train import TINY_MODEL, train

    ckpt = str(tmp_path / "ckpt")
    train(TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                        "--eval-interval", "0", "--eval-iters", "0", "--log-interval", "100", "--save", ckpt])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = generate_tool.main(["--load", ckpt, "--prompt", "5 6 7", "--max-new-tokens", "6", "--temperature", "0"])
    assert rc == 0
    printed = [int(x) for x in buf.getvalue().split()]
    assert printed[:3] == [5, 6, 7] and len(printed) == 9
    model, ck = load_model(ckpt)
    assert ck.iteration == 2
    tokens = torch.tensor([printed])
    ref = full_logits(model, tokens)
    assert torch.equal(tokens[0, 3:], ref[0, 2:-1].argmax(-1))
    assert not math.isnan(ref.sum().item())

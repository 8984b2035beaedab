"""Kaiju-style attention (MQA, 5:1 local/global windows, cross-layer KV sharing, int8 cache) against a Llama-style
baseline (GQA 8, global attention, SwiGLU, bf16 cache) at equal parameters.

    python bench/kaiju.py [--quick] [--skip-agreement] [--out PREFIX] [--from-json]

Parts (all go to PREFIX.{json,md}, by default bench/results/kaiju):

- ``cache``: KV-cache bytes per token, counted from the cache tensors after a prefill of ``--context`` tokens
  (``int8_kv_cache.cache_bytes``), and the ratio baseline / Kaiju split into its factors: MQA (KV heads), sharing
  (layers per cached group), int8 (bf16 bytes over int8 codes + scales) and the window (1.0 measured: the cache
  keeps every token of local layers; the factor a window-bounded cache would add is printed beside it).
- ``agreement``: a small Kaiju-style model trained here on a synthetic low-entropy Markov corpus, then greedy
  decoding of ``--tokens`` tokens with the bf16 cache and with the int8 cache: the fraction of positions where
  the two continuations agree (up to the first divergence and over all positions), and the per-token
  log-probability difference of the bf16 run's tokens under both caches, over the steps whose contexts are
  still identical.

Not run here (they need a quiet machine): validation loss at 3 seeds and decode tokens/s; ``--quick`` keeps
the sizes small (context 512, 300 tokens, 150 training steps).
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as H  # noqa: E402

from megatron_cai.core.models.gpt.config import GPTConfig  # noqa: E402
from megatron_cai.core.models.gpt.model import GPTModel  # noqa: E402
from megatron_cai.core.transformer.int8_kv_cache import cache_bytes, make_kv_cache  # noqa: E402
from megatron_cai.core.transformer.layer_pattern import group_sources, is_local_layer  # noqa: E402
from megatron_cai.inference.generation import ensure_single_process, generate, prefill  # noqa: E402


def model_config(kind: str, layers: int, hidden: int, heads: int, ffn: int, window: int, vocab: int,
                 seq: int) -> GPTConfig:
    common = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                  seq_length=seq, ffn_hidden_size=ffn, position_embedding_type="rope", normalization="RMSNorm",
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    if kind == "llama":
        return GPTConfig(num_query_groups=8, activation="swiglu", **common)
    return GPTConfig(num_query_groups=1, activation="relu2", window_size=window, window_attn_skip_freq=6,
                     kv_share_pattern=2, **common)


def params(config: GPTConfig) -> int:
    ensure_single_process()
    return sum(p.numel() for p in GPTModel(config).parameters())


def equal_parameter_configs(layers: int, hidden: int, heads: int, window: int, vocab: int, seq: int):
    """The baseline with SwiGLU ffn 8/3 hidden, and the Kaiju model whose relu2 ffn brings it closest."""
    base = model_config("llama", layers, hidden, heads, int(8 * hidden / 3) // 8 * 8, window, vocab, seq)
    target = params(base)
    best = min(range(hidden, 8 * hidden + 1, 8),
               key=lambda f: abs(params(model_config("kaiju", layers, hidden, heads, f, window, vocab, seq)) - target))
    return base, model_config("kaiju", layers, hidden, heads, best, window, vocab, seq)


def cache_part(args) -> dict:
    torch.manual_seed(0)
    base, kaiju = equal_parameter_configs(args.layers, args.hidden, args.heads, args.window, 256, args.context)
    tokens = torch.randint(0, 256, (1, args.context))
    measured = {}
    for name, cfg, dtype in (("llama_bf16", base, "auto"), ("kaiju_int8", kaiju, "int8"),
                             ("kaiju_bf16", kaiju, "auto")):
        model = GPTModel(cfg)
        model.initialize(0)
        model = model.to(torch.bfloat16).eval()
        cache = make_kv_cache(dtype)
        prefill(model, tokens, cache)
        measured[name] = cache_bytes(cache) / args.context
    d = base.kv_channels
    groups = len(group_sources(kaiju))
    local = sum(is_local_layer(kaiju.window_size, kaiju.window_attn_skip_freq, n) for n in range(kaiju.num_layers))
    window_bound = kaiju.num_layers / (kaiju.num_layers - local + local * min(1.0, args.window / args.context))
    factors = {"mqa": base.num_query_groups / kaiju.num_query_groups, "sharing": kaiju.num_layers / groups,
               "int8": measured["kaiju_bf16"] / measured["kaiju_int8"], "window_measured": 1.0,
               "window_if_bounded": window_bound}
    ratio = measured["llama_bf16"] / measured["kaiju_int8"]
    assert measured["llama_bf16"] == base.num_layers * 2 * base.num_query_groups * d * 2  # bf16 K and V, every layer
    return {"params": {"llama": params(base), "kaiju": params(kaiju)}, "ffn": {"llama": base.ffn_hidden_size,
            "kaiju": kaiju.ffn_hidden_size}, "context": args.context, "bytes_per_token": measured,
            "ratio": ratio, "factors": factors, "ratio_from_factors": factors["mqa"] * factors["sharing"]
            * factors["int8"], "meets_one_twentieth": ratio >= 20}


def markov_corpus(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A low-entropy order-1 Markov chain: each token has 3 likely successors."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 3), generator=g)
    probs = torch.tensor([0.8, 0.15, 0.05])
    out = [0]
    for _ in range(length - 1):
        out.append(int(succ[out[-1], torch.multinomial(probs, 1, generator=g)]))
    return torch.tensor(out)


def train_small_kaiju(steps: int, seq: int = 128, vocab: int = 64) -> GPTModel:
    ensure_single_process()
    cfg = GPTConfig(num_layers=6, hidden_size=64, num_attention_heads=4, num_query_groups=1, vocab_size=vocab,
                    seq_length=seq, position_embedding_type="rope", normalization="RMSNorm", activation="relu2",
                    add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, window_size=32,
                    window_attn_skip_freq=6, kv_share_pattern=2)
    model = GPTModel(cfg)
    model.initialize(0)
    data = markov_corpus(vocab, 200_000, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(seq).expand(8, seq)
    for step in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (8,), generator=g)
        batch = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        loss = model(batch[:, :-1], pos, labels=batch[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  train step {step}: loss {loss.item():.3f}", flush=True)
    return model.eval()


def agreement_part(args) -> dict:
    model = train_small_kaiju(args.train_steps).to(torch.bfloat16)
    prompt = markov_corpus(64, 16, 5).unsqueeze(0)
    ref = generate(model, prompt, args.tokens, temperature=0, return_logits=True)
    got = generate(model, prompt, args.tokens, temperature=0, return_logits=True, kv_cache_dtype="int8")
    same = (ref.new_tokens == got.new_tokens)[0]
    first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else args.tokens
    # Log-probability of the chosen token under each cache, at the steps whose contexts are still identical
    # (up to and including the first divergence).
    steps = min(first_diff + 1, args.tokens)
    diff = torch.stack([(torch.log_softmax(a[0].float(), -1)[t] - torch.log_softmax(b[0].float(), -1)[t]).abs()
                        for a, b, t in zip(ref.logits[:steps], got.logits[:steps], ref.new_tokens[0, :steps])])
    return {"tokens": args.tokens, "train_steps": args.train_steps, "agreement": float(same.float().mean()),
            "agree_until": first_diff, "logprob_abs_diff_mean": float(diff.mean()),
            "logprob_abs_diff_max": float(diff.max()), "meets_99_percent": float(same.float().mean()) >= 0.99}


def markdown(result: dict) -> str:
    lines = ["# Kaiju-style attention vs a Llama-style baseline", ""]
    c = result.get("cache")
    if c:
        lines += [f"KV-cache bytes per token at a {c['context']}-token context (counted from the cache tensors; "
                  f"parameters {c['params']['llama']:,} vs {c['params']['kaiju']:,}):", "",
                  "| model | bytes/token |", "|---|---|"]
        lines += [f"| {k} | {v:,.1f} |" for k, v in c["bytes_per_token"].items()]
        f = c["factors"]
        lines += ["", f"Ratio baseline / Kaiju: **{c['ratio']:.1f}x** = MQA {f['mqa']:.0f} x sharing "
                  f"{f['sharing']:.0f} x int8 {f['int8']:.2f} x window {f['window_measured']:.0f} (measured; a "
                  f"window-bounded cache would add {f['window_if_bounded']:.2f}x)", ""]
    a = result.get("agreement")
    if a:
        lines += [f"int8 vs bf16 cache, greedy over {a['tokens']} tokens ({a.get('train_steps')} training steps): "
                  f"agreement {a['agreement']:.4f} "
                  f"(identical for the first {a['agree_until']}); |log p| difference mean "
                  f"{a['logprob_abs_diff_mean']:.2e}, max {a['logprob_abs_diff_max']:.2e}", ""]
    lines += ["Not measured here (a quiet machine): validation loss at 3 seeds, decode tokens/s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "kaiju")
    p.add_argument("--skip-agreement", action="store_true", help="only the cache part (what CI runs)")
    p.add_argument("--tokens", type=int, default=None, help="greedy tokens of the agreement part (default 2000; "
                   "300 with --quick)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps of its model (600; 150 quick)")
    args = H.parse(p, argv)
    out = H.Results(args.out)
    if args.from_json:
        out.rewrite(markdown)
        return
    args.layers, args.hidden, args.heads = (6, 128, 16) if args.quick else (12, 512, 16)
    args.context, args.window = (512, 128) if args.quick else (4096, 1024)
    tokens, steps = (300, 150) if args.quick else (2000, 600)
    args.tokens, args.train_steps = args.tokens or tokens, args.train_steps or steps
    result = {"quick": args.quick, "cache": cache_part(args)}
    print(json.dumps(result["cache"], indent=1), flush=True)
    if not args.skip_agreement:
        result["agreement"] = agreement_part(args)
    out.write(result, markdown)


if __name__ == "__main__":
    main()

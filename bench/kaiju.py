"""Kaiju-style attention (MQA, 5:1 local/global windows, cross-layer KV sharing, int8 QAT and cache) and
multi-latent attention against a Llama-style baseline (GQA 8, global attention, SwiGLU, bf16 cache), at equal
parameters and equal tokens.

    python bench/kaiju.py [--quick] [--parts loss cache branches agreement] [--decode-only] [--from-json]

Three architectures, each at the baseline's parameter count (the MLP width of the other two is solved for it):

- ``llama``: GQA with 8 KV groups, global attention everywhere, SwiGLU, bf16 cache;
- ``kaiju``: MQA, sliding windows on 5 of every 6 layers (``--window-attn-skip-freq 6``), K/V shared by
  neighbouring layers (``--kv-share-pattern 2``), squared ReLU, int8 QAT with dynamic clamping (per token) and
  Attention Z-Reg in training; an int8 cache;
- ``mla``: the baseline with Megatron's multi-latent attention (latent ``hidden / 4``, RoPE key ``head_dim / 2``).

Parts (``--parts``; all of them by default):

- ``loss``: every architecture trained on the demo corpus at ``--seeds`` (the seed sets the initialisation and
  the data order, shared by the three), the same iterations, batch and sequence (equal tokens); validation loss
  on fixed held-out batches: mean ± std per architecture and the paired difference to the baseline. For the
  first seed, branch decoding with a shared prompt on the trained models: greedy tokens of
  ``decode_branches`` against each branch decoded alone (bf16 cache layout; int8 too for ``kaiju``/``mla``).
- ``cache``: random-weight bf16 models of the same three kinds at a larger shape: a prefill of ``--context``
  tokens, KV-cache bytes per token counted from the cache tensors (``int8_kv_cache.cache_bytes``), the ratio to
  the baseline and its factors (MQA, sharing, int8, the window: 1 as measured, the cache keeps every token of
  the local layers; what a window-bounded cache would add is printed beside it); then the timed rows: decode
  tokens/s (``--decode-tokens`` greedy steps after the prefill) and branch decoding (``--branches`` branches of
  ``--branch-suffix`` tokens after a shared ``--branch-prompt``-token prompt, ``--decode-tokens`` new tokens
  each) against one branch decoded alone. Each timed row records the load average beside it.
- ``agreement``: int8 vs bf16 cache on a small Kaiju-style model trained on a low-entropy Markov corpus:
  greedy agreement over ``--tokens`` tokens and the per-token log-probability difference.

``--parts`` runs some parts and keeps the others from an existing PREFIX.json; ``--decode-only`` is
``--parts cache`` (bytes and timings, no training): the cheap re-measurement of the timing rows on a quiet
machine. Torch runs one thread (``BENCH_THREADS``), as the other benches on a shared machine.
Writes PREFIX.{json,md,png} (default bench/results/kaiju).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness as H  # noqa: E402
from harness import training as T  # noqa: E402
from harness.data import QUICK, demo_corpus  # noqa: E402
from harness.runcache import RunCache, settings_key  # noqa: E402

from megatron_cai.core.models.gpt.model import GPTModel  # noqa: E402
from megatron_cai.core.transformer.int8_kv_cache import cache_bytes, make_kv_cache  # noqa: E402
from megatron_cai.core.transformer.layer_pattern import group_sources, is_local_layer  # noqa: E402
from megatron_cai.inference.branches import decode_branches  # noqa: E402
from megatron_cai.inference.generation import (  # noqa: E402
    decode_step,
    ensure_single_process,
    generate,
    inference_config,
    prefill,
)

KINDS = ("llama", "kaiju", "mla")
PARTS = ("loss", "cache", "agreement")
CACHE_ROWS = (("llama", "auto"), ("kaiju", "int8"), ("kaiju", "auto"), ("mla", "auto"), ("mla", "int8"))


# ------------------------------------------------------------------------------------------ architectures
def arch_flags(kind: str, hidden: int, heads: int, window: int, ffn: int, *, training: bool = True) -> list[str]:
    """Megatron flags of one architecture (its MLP width ``ffn``); ``training`` adds Kaiju's training-only
    choices (int8 QAT with dynamic clamping, Attention Z-Reg)."""
    common = ["--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
              "--ffn-hidden-size", str(ffn)]
    if kind == "llama":
        return common + ["--swiglu", "--group-query-attention", "--num-query-groups", "8"]
    if kind == "mla":
        head = hidden // heads
        return common + ["--swiglu", "--multi-latent-attention", "--kv-lora-rank", str(hidden // 4),
                         "--qk-head-dim", str(head), "--qk-pos-emb-head-dim", str(head // 2),
                         "--v-head-dim", str(head), "--rope-type", "rope"]
    kaiju = common + ["--squared-relu", "--group-query-attention", "--num-query-groups", "1",
                      "--window-size", str(window), "--window-attn-skip-freq", "6", "--kv-share-pattern", "2"]
    if training:  # per-token activation clamps: a token's forward does not depend on its batch (decoding)
        kaiju += ["--qat", "int8", "--qat-clamp", "rms", "--qat-granularity", "row", "--attention-zreg-coeff", "1e-4"]
    return kaiju


def model_config(shape_flags: list[str], flags: list[str]):
    """The GPTConfig these flags build (``pretrain_gpt.build_run``)."""
    import pretrain_gpt

    config, _ = pretrain_gpt.build_run(shape_flags + flags, world_size=1)
    return config.model


def count_params(config) -> int:
    ensure_single_process()
    return sum(p.numel() for p in GPTModel(config).parameters())


def equal_parameter_ffn(shape_flags: list[str], hidden: int, heads: int, window: int) -> dict:
    """The baseline's SwiGLU width (8/3 hidden) and, for the others, the MLP width whose parameter count is
    nearest the baseline's (the count is linear in the width: solved from two points)."""
    ffn = {"llama": int(8 * hidden / 3) // 8 * 8}
    target = count_params(model_config(shape_flags, arch_flags("llama", hidden, heads, window, ffn["llama"])))
    for kind in ("kaiju", "mla"):
        a, b = hidden, 2 * hidden
        pa, pb = (count_params(model_config(shape_flags, arch_flags(kind, hidden, heads, window, f))) for f in (a, b))
        ffn[kind] = round(a + (target - pa) * (b - a) / (pb - pa))
    return ffn


# ------------------------------------------------------------------------------------------ loss part
def shape_argv(o, seed: int) -> list[str]:
    argv = T.small_gpt_argv(layers=o.layers, hidden=o.hidden, heads=o.heads, seq=o.seq, batch=o.batch,
                            iters=o.iters, lr=o.lr, seed=seed, data=o._data, tok=o._tok, cache=o.cache_dir,
                            valid_batches=o.eval_iters)
    return [a for a in argv if a != "--squared-relu"]  # the activation is the architecture's


def inference_copy(model: GPTModel) -> GPTModel:
    """A single-process fp32 copy of a trained model for decoding."""
    copy = GPTModel(inference_config(model.config))
    copy.load_state_dict(model.state_dict(), strict=False)
    return copy.float().eval()


def branch_check(o, model: GPTModel, valid_ds, kv_cache_dtype: str) -> dict:
    """Branches after a shared validation prompt, greedy, against each branch decoded alone (equal-length
    suffixes, so that the int8 cache's blocks hold the same tokens both ways)."""
    rows = [valid_ds[i]["tokens"].tolist() for i in range(o.branches)]
    p_len = o.seq * 5 // 8
    prompt, suffixes = rows[0][:p_len], [r[p_len:p_len + o.branch_suffix] for r in rows]
    out = decode_branches(model, prompt, o.branch_new, branches=suffixes, temperature=0,
                          kv_cache_dtype=kv_cache_dtype)
    same = total = 0
    for b, s in enumerate(suffixes):
        alone = generate(model, prompt + s, o.branch_new, temperature=0, kv_cache_dtype=kv_cache_dtype)
        same += int((out.new_tokens[b] == alone.new_tokens[0]).sum())
        total += o.branch_new
    separate = o.branches * (p_len + o.branch_suffix + o.branch_new - 1)
    return {"prompt": p_len, "branches": o.branches, "suffix": o.branch_suffix, "new_tokens": o.branch_new,
            "tokens_equal": same, "tokens": total, "forward_tokens": out.forward_tokens,
            "forward_tokens_separate": separate}


def train_run(o, kind: str, seed: int, ffn: int) -> dict:
    tr = T.build_trainer(shape_argv(o, seed) + arch_flags(kind, o.hidden, o.heads, o.window, ffn))
    curve, train_loss = [(0, T.fixed_valid_loss(tr, o.eval_iters))], []
    while tr.state.iteration < o.iters:
        hist = T.train_chunk(tr, min(o.eval_interval, o.iters - tr.state.iteration))
        train_loss += [h["lm loss"] for h in hist]
        curve.append((tr.state.iteration, T.fixed_valid_loss(tr, o.eval_iters)))
    model = T.core_model(tr)
    out = {"valid_loss": curve[-1][1], "curve": curve, "train_loss": train_loss,
           "params": sum(p.numel() for p in model.parameters())}
    if seed == o.seeds[0]:
        copy = inference_copy(model)
        dtypes = ("auto",) if kind == "llama" else ("auto", "int8")
        out["branches"] = {d: branch_check(o, copy, tr.valid_ds, d) for d in dtypes}
    return out


def loss_part(o) -> dict:
    o._data, o._tok = demo_corpus(o.cache_dir, o.vocab, o.corpus_mb)
    ffn = equal_parameter_ffn(shape_argv(o, o.seeds[0]), o.hidden, o.heads, o.window)
    settings = {k: getattr(o, k) for k in ("layers", "hidden", "heads", "seq", "batch", "iters", "lr", "window",
                                            "vocab", "corpus_mb", "eval_iters", "eval_interval", "branches",
                                            "branch_suffix", "branch_new")}
    runs = RunCache(os.path.join(o.cache_dir, "runs"), settings_key({**settings, "ffn": ffn}))
    per = {k: {} for k in KINDS}
    for seed in o.seeds:
        for kind in KINDS:
            print(f"training {kind} seed {seed} (ffn {ffn[kind]})", flush=True)
            per[kind][str(seed)] = runs.get_or_run(kind, seed, lambda k=kind, s=seed: train_run(o, k, s, ffn[k]))
    summary = {k: {"valid_loss": H.seed_summary(per[k], "valid_loss"), "params": per[k][str(o.seeds[0])]["params"],
                   "ffn": ffn[k]} for k in KINDS}
    for k in ("kaiju", "mla"):
        summary[k]["vs_llama"] = H.paired_gap(per[k], per["llama"], "valid_loss")
    return {"settings": settings, "seeds": o.seeds, "tokens_per_run": o.iters * o.batch * o.seq,
            "summary": summary, "per_seed": per}


# ------------------------------------------------------------------------------------------ cache part
def timed(fn):
    """(result, seconds, load average before)."""
    load = H.machine()["load_average"]
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, load


def cache_row(o, model: GPTModel, kv_dtype: str, tokens: torch.Tensor) -> dict:
    cache = make_kv_cache(kv_dtype)
    logits = prefill(model, tokens, cache)
    row = {"bytes_per_token": cache_bytes(cache) / tokens.shape[1]}

    def decode():
        nxt = logits.argmax(-1)
        for _ in range(o.decode_tokens):
            nxt = decode_step(model, nxt, cache).argmax(-1)

    _, secs, load = timed(decode)
    row["decode"] = {"tokens": o.decode_tokens, "seconds": secs, "tokens_per_s": o.decode_tokens / secs,
                     "load_average": load}
    prompt = tokens[0, :o.branch_prompt].tolist()
    suffixes = [tokens[0, o.branch_prompt + 8 * b:o.branch_prompt + 8 * b + o.branch_suffix].tolist()
                for b in range(o.branches)]
    shared, t_shared, load_b = timed(lambda: decode_branches(model, prompt, o.decode_tokens, branches=suffixes,
                                                             temperature=0, kv_cache_dtype=kv_dtype))
    _, t_alone, load_a = timed(lambda: generate(model, prompt + suffixes[0], o.decode_tokens, temperature=0,
                                                kv_cache_dtype=kv_dtype))
    new = o.branches * o.decode_tokens
    row["branches"] = {"prompt": o.branch_prompt, "branches": o.branches, "suffix": o.branch_suffix,
                       "new_tokens": o.decode_tokens, "seconds_shared": t_shared, "seconds_one_alone": t_alone,
                       "tokens_per_s_shared": new / t_shared, "tokens_per_s_alone": o.decode_tokens / t_alone,
                       "separate_over_shared": o.branches * t_alone / t_shared, "forward_tokens": shared.forward_tokens,
                       "forward_tokens_separate": o.branches * (o.branch_prompt + o.branch_suffix
                                                                + o.decode_tokens - 1),
                       "load_average": [load_b, load_a]}
    return row


def cache_part(o) -> dict:
    shape = ["--num-layers", str(o.cache_layers), "--hidden-size", str(o.cache_hidden), "--num-attention-heads",
             str(o.cache_heads), "--seq-length", str(o.context), "--max-position-embeddings", str(o.context),
             "--mock-data", "--vocab-size", "256", "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--micro-batch-size", "1", "--train-iters", "1", "--device", "cpu"]
    ffn = equal_parameter_ffn(shape, o.cache_hidden, o.cache_heads, o.cache_window)
    configs = {k: model_config(shape, arch_flags(k, o.cache_hidden, o.cache_heads, o.cache_window, ffn[k],
                                                 training=False)) for k in KINDS}
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (1, o.context))
    rows = {}
    for kind, kv_dtype in CACHE_ROWS:
        model = GPTModel(configs[kind])
        model.initialize(0)
        model = model.to(torch.bfloat16).eval()
        name = f"{kind}_{'int8' if kv_dtype == 'int8' else 'bf16'}"
        print(f"cache row {name}", flush=True)
        rows[name] = cache_row(o, model, kv_dtype, tokens)
    bpt = {k: r["bytes_per_token"] for k, r in rows.items()}
    base, kaiju = configs["llama"], configs["kaiju"]
    groups = len(group_sources(kaiju))
    local = sum(is_local_layer(kaiju.window_size, kaiju.window_attn_skip_freq, n) for n in range(kaiju.num_layers))
    window_bound = kaiju.num_layers / (kaiju.num_layers - local + local * min(1.0, o.cache_window / o.context))
    factors = {"mqa": base.num_query_groups / kaiju.num_query_groups, "sharing": kaiju.num_layers / groups,
               "int8": bpt["kaiju_bf16"] / bpt["kaiju_int8"], "window_measured": 1.0,
               "window_if_bounded": window_bound}
    ratio = bpt["llama_bf16"] / bpt["kaiju_int8"]
    assert bpt["llama_bf16"] == base.num_layers * 2 * base.num_query_groups * base.kv_channels * 2  # bf16 K, V
    return {"params": {k: count_params(c) for k, c in configs.items()}, "ffn": ffn, "context": o.context,
            "shape": {"layers": o.cache_layers, "hidden": o.cache_hidden, "heads": o.cache_heads,
                      "window": o.cache_window},
            "bytes_per_token": bpt, "rows": rows, "ratio": ratio, "factors": factors,
            "ratio_from_factors": factors["mqa"] * factors["sharing"] * factors["int8"],
            "mla_ratio": {"bf16": bpt["llama_bf16"] / bpt["mla_bf16"], "int8": bpt["llama_bf16"] / bpt["mla_int8"]},
            "meets_one_twentieth": ratio >= 20}


# ------------------------------------------------------------------------------------------ agreement part
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
    from megatron_cai.core.models.gpt.config import GPTConfig

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


def agreement_part(o) -> dict:
    model = train_small_kaiju(o.train_steps).to(torch.bfloat16)
    prompt = markov_corpus(64, 16, 5).unsqueeze(0)
    ref = generate(model, prompt, o.tokens, temperature=0, return_logits=True)
    got = generate(model, prompt, o.tokens, temperature=0, return_logits=True, kv_cache_dtype="int8")
    same = (ref.new_tokens == got.new_tokens)[0]
    first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else o.tokens
    # Log-probability of the chosen token under each cache, at the steps whose contexts are still identical
    # (up to and including the first divergence).
    steps = min(first_diff + 1, o.tokens)
    diff = torch.stack([(torch.log_softmax(a[0].float(), -1)[t] - torch.log_softmax(b[0].float(), -1)[t]).abs()
                        for a, b, t in zip(ref.logits[:steps], got.logits[:steps], ref.new_tokens[0, :steps])])
    return {"tokens": o.tokens, "train_steps": o.train_steps, "agreement": float(same.float().mean()),
            "agree_until": first_diff, "logprob_abs_diff_mean": float(diff.mean()),
            "logprob_abs_diff_max": float(diff.max()), "meets_99_percent": float(same.float().mean()) >= 0.99}


# ------------------------------------------------------------------------------------------ report
def _pm(gap: dict) -> str:
    return f"{gap['diff_mean']:+.4f} ± {gap['diff_std']:.4f}"


def _load(load: list[float]) -> str:
    return f"{load[0]:.1f}"


def loss_lines(r: dict) -> list[str]:
    st, s = r["settings"], r["summary"]
    lines = ["## Validation loss at equal parameters and equal tokens", "",
             f"Demo corpus (vocab {st['vocab']}), {st['layers']} layers, hidden {st['hidden']}, {st['heads']} heads, "
             f"seq {st['seq']}, batch {st['batch']}, {st['iters']} iterations (lr {st['lr']:g} cosine): "
             f"{r['tokens_per_run']:,} training tokens per run; seeds {r['seeds']} (initialisation and data order, "
             f"shared by the three). Kaiju's windows: {st['window']} positions (the same fraction of the sequence "
             f"as 1,024 of 4,096). Validation loss on {st['eval_iters']} fixed held-out batches; the seed also picks "
             "those batches (shared by the three), so the spread over seeds is mostly theirs and the paired "
             "difference removes it.", "",
             "| model | parameters | MLP width | valid loss (mean ± std) | minus baseline (paired, mean ± std) |",
             "|---|---:|---:|---:|---:|"]
    for k in KINDS:
        v = s[k]["valid_loss"]
        gap = _pm(s[k]["vs_llama"]) if "vs_llama" in s[k] else "-"
        lines.append(f"| {k} | {s[k]['params']:,} | {s[k]['ffn']} | {H.fmt_pm(v['mean'], v['std'])} | {gap} |")
    lines.append("")
    for k in ("kaiju", "mla"):
        g, a, b = s[k]["vs_llama"], s[k]["valid_loss"], s["llama"]["valid_loss"]
        per_seed = ", ".join(f"{x:+.4f}" for x in g["diff"])
        lines.append(f"- {k} minus llama: {g['diff_mean']:+.4f} (per seed {per_seed}); "
                     f"spreads (std over seeds): {k} {a['std']:.4f}, llama {b['std']:.4f}.")
    lines += ["", "Branch decoding on the trained models (first seed, fp32): a shared validation prompt, branches with "
              "suffixes of one length, greedy; tokens equal to each branch decoded alone, and the positions run "
              "through the model (shared prompt vs every branch alone):", "",
              "| model | cache | prompt | branches x new | tokens equal | forward tokens (shared / alone) |",
              "|---|---|---:|---:|---:|---:|"]
    for k in KINDS:
        for d, b in r["per_seed"][k][str(r["seeds"][0])].get("branches", {}).items():
            lines.append(f"| {k} | {'int8' if d == 'int8' else 'model dtype'} | {b['prompt']} | "
                         f"{b['branches']} x {b['new_tokens']} | {b['tokens_equal']}/{b['tokens']} | "
                         f"{b['forward_tokens']:,} / {b['forward_tokens_separate']:,} |")
    return lines + [""]


def cache_lines(c: dict) -> list[str]:
    sh, f = c["shape"], c["factors"]
    lines = ["## KV cache, decoding and branch decoding", "",
             f"Random-weight bf16 models, {sh['layers']} layers, hidden {sh['hidden']}, {sh['heads']} heads, Kaiju "
             f"windows {sh['window']}; parameters " + ", ".join(f"{k} {v:,}" for k, v in c["params"].items())
             + f". Bytes per token after a prefill of {c['context']:,} tokens, counted from the cache tensors.", "",
             "| model | cache bytes / token | baseline / this | decode tok/s | load | branches tok/s (shared) | "
             "one branch alone tok/s | separate / shared time | forward tokens (shared / alone) | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = c["bytes_per_token"]["llama_bf16"]
    for name, r in c["rows"].items():
        d, b = r["decode"], r["branches"]
        lines.append(f"| {name} | {r['bytes_per_token']:,.1f} | {base / r['bytes_per_token']:.1f}x | "
                     f"{d['tokens_per_s']:.1f} | {_load(d['load_average'])} | {b['tokens_per_s_shared']:.1f} | "
                     f"{b['tokens_per_s_alone']:.1f} | {b['separate_over_shared']:.2f}x | "
                     f"{b['forward_tokens']:,} / {b['forward_tokens_separate']:,} | {_load(b['load_average'][0])} |")
    b = next(iter(c["rows"].values()))["branches"]
    lines += ["", f"Decode: {next(iter(c['rows'].values()))['decode']['tokens']} greedy steps after the "
              f"{c['context']:,}-token prefill. Branches: {b['branches']} branches of {b['suffix']} suffix tokens "
              f"after a shared {b['prompt']:,}-token prompt, {b['new_tokens']} new tokens each, against one of them "
              "decoded alone (prompt included in both). Load: the 1-minute load average when the row started; "
              "timings are noise on a loaded machine (`--decode-only` re-measures them).", "",
              f"Kaiju ratio baseline / Kaiju int8: **{c['ratio']:.1f}x** = MQA {f['mqa']:.0f} x sharing "
              f"{f['sharing']:.0f} x int8 {f['int8']:.2f} x window {f['window_measured']:.0f} (measured; a "
              f"window-bounded cache would add {f['window_if_bounded']:.2f}x). MLA: "
              f"{c['mla_ratio']['bf16']:.1f}x (bf16 latent), {c['mla_ratio']['int8']:.1f}x (int8 latent).", ""]
    return lines


def markdown(result: dict) -> str:
    lines = ["# Kaiju-style attention and MLA vs a Llama-style baseline", "",
             "`python bench/kaiju.py" + (" --quick" if result.get("quick") else "") + "`: see the bench's docstring "
             "for the three architectures (equal parameters: the MLP width of Kaiju and MLA is solved for the "
             "baseline's count).", ""]
    if result.get("loss"):
        lines += loss_lines(result["loss"])
    if result.get("cache"):
        lines += cache_lines(result["cache"])
    a = result.get("agreement")
    if a:
        lines += ["## int8 vs bf16 cache", "",
                  f"Greedy over {a['tokens']} tokens ({a.get('train_steps')} training steps on a Markov corpus): "
                  f"agreement {a['agreement']:.4f} (identical for the first {a['agree_until']}); |log p| difference "
                  f"mean {a['logprob_abs_diff_mean']:.2e}, max {a['logprob_abs_diff_max']:.2e}", ""]
    m = result.get("machine")
    if m:
        lines.append(f"Machine: {m['start']['cpus']} CPUs, load average {m['start']['load_average']} at the start, "
                     f"{m['end']['load_average']} at the end.")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5))
    colors = {"llama": "tab:blue", "kaiju": "tab:red", "mla": "tab:green"}
    loss = result.get("loss")
    if loss:
        for k in KINDS:
            for i, seed in enumerate(sorted(loss["per_seed"][k], key=int)):
                run = loss["per_seed"][k][seed]
                x, y = zip(*run["curve"])
                a.plot(x, y, marker="o", color=colors[k], alpha=0.8, label=k if i == 0 else None)
                b.plot(range(1, len(run["train_loss"]) + 1), run["train_loss"], color=colors[k], alpha=0.5,
                       label=k if i == 0 else None)
    a.set(title="validation loss (every seed)", xlabel="iteration")
    b.set(title="training loss (every seed)", xlabel="iteration")
    cache = result.get("cache")
    if cache:
        names = list(cache["bytes_per_token"])
        vals = [cache["bytes_per_token"][n] for n in names]
        c.bar(range(len(names)), vals, color=[colors[n.split("_")[0]] for n in names])
        c.set_yscale("log")
        c.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        for i, v in enumerate(vals):
            c.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        c.set(title=f"KV-cache bytes per token ({cache['context']:,}-token context)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def _quick(o) -> None:
    o.layers, o.hidden, o.heads, o.seq, o.batch, o.iters, o.window = 6, 32, 8, 64, 2, 2, 16
    o.eval_iters, o.eval_interval, o.vocab, o.corpus_mb = 1, 2, QUICK["vocab"], QUICK["corpus_mb"]
    o.seeds = o.seeds[:2]
    o.branch_new = 4
    o.cache_layers, o.cache_hidden, o.cache_heads, o.context, o.cache_window = 6, 128, 16, 512, 128
    o.branch_prompt, o.decode_tokens = 128, 4
    o.tokens, o.train_steps = 300, 150


def parse(argv=None):
    p = H.parser(__doc__, "kaiju")
    H.add(p, seeds=[1, 2, 3], layers=6, hidden=96, heads=8, seq=128, batch=4, iters=60, lr=3e-3, vocab=4096,
          corpus_mb=4.0, eval_iters=4, eval_interval=20)
    p.add_argument("--window", type=int, default=32, help="Kaiju's window in the loss part")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="the parts to run; the others are kept from an existing PREFIX.json")
    p.add_argument("--skip-agreement", action="store_true", help="leave out the agreement part")
    p.add_argument("--decode-only", action="store_true",
                   help="--parts cache: bytes, decode and branch timings, into the existing PREFIX.json")
    p.add_argument("--branches", type=int, default=4, help="branches sharing a prompt")
    p.add_argument("--branch-suffix", type=int, default=4, help="suffix tokens per branch")
    p.add_argument("--branch-new", type=int, default=24, help="new tokens per branch (loss part's check)")
    p.add_argument("--cache-layers", type=int, default=12)
    p.add_argument("--cache-hidden", type=int, default=512)
    p.add_argument("--cache-heads", type=int, default=16)
    p.add_argument("--cache-window", type=int, default=1024)
    p.add_argument("--context", type=int, default=4096, help="prefill tokens of the cache part")
    p.add_argument("--decode-tokens", type=int, default=32, help="timed greedy decode steps (and branch tokens)")
    p.add_argument("--branch-prompt", type=int, default=1024, help="shared prompt of the timed branch rows")
    p.add_argument("--tokens", type=int, default=2000, help="greedy tokens of the agreement part")
    p.add_argument("--train-steps", type=int, default=150, help="training steps of the agreement part's model")
    return H.parse(p, argv, quick=_quick)


def main(argv: list[str] | None = None) -> None:
    o = parse(argv)
    out = H.Results(o.out)
    if o.from_json:
        out.rewrite(markdown, plot)
        return
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))  # a shared machine: no spinning threads
    parts = ["cache"] if o.decode_only else [x for x in o.parts if not (o.skip_agreement and x == "agreement")]
    result = {}
    if set(parts) != set(PARTS) and os.path.exists(o.out + ".json"):  # the parts not run are kept
        with open(o.out + ".json") as f:
            result = {k: v for k, v in json.load(f).items() if k in PARTS}
    result["quick"] = o.quick
    if "loss" in parts:
        result["loss"] = loss_part(o)
    if "cache" in parts:
        result["cache"] = cache_part(o)
        print(json.dumps({k: v for k, v in result["cache"].items() if k != "rows"}, indent=1), flush=True)
    if "agreement" in parts:
        result["agreement"] = agreement_part(o)
    out.write(result, markdown, plot)


if __name__ == "__main__":
    main()

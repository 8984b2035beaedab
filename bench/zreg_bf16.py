"""What Attention Z-Reg buys in bf16: attention error against an fp64 reference binned by lse, and training.

    python bench/zreg_bf16.py [--seeds 1 2 3] [--zreg 1e-3 1e-2] [--quick] [--out bench/results/zreg_bf16]

Training: a small GPT on the demo corpus under bf16 autocast with Attention Z-Reg off and on at two
coefficients (``--attention-zreg-coeff``), plus the same model in fp32 with Z-Reg off (what bf16 costs at
all), per seed from the same initialisation on the same batches. Every ``--eval-interval`` iterations: the
validation loss on fixed batches and the attention log-sum-exp of every query row (fp64, from the q and k the
attention kernel receives): mean, 99th percentile and max. Reported: final validation loss mean ± std over
seeds and its paired gap to bf16 Z-Reg off, lse statistics, and loss spikes (training loss above the median
of the previous 10 iterations by > 0.5 nats, or non-finite).

Mechanism, on the trained checkpoints (every seed, rows pooled): q, k, v are captured in fp32 (the model run
without autocast on fixed validation batches) and each attention row is computed
- in fp64 (the reference: logits, softmax, output, lse),
- in bf16 step by step (q, k, v rounded to bf16; logits q k^T / sqrt(d) held in bf16; softmax of those held
  in bf16; output P V in bf16), the error of each stage against the reference,
- by the kernels the model runs under bf16 autocast: SDPA (Z-Reg off) and the blocked interval kernel
  (``attend``, Z-Reg on), output error only.
Errors are binned by the row's reference lse: logits max |error| over the row, softmax sum |error| over the
row (L1), output ||error|| / ||reference||. Writes ``--out``.{json,md,png}.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import harness as H
from harness import training as T
from harness.data import QUICK, demo_corpus
from harness.runcache import RunCache, settings_key

BASELINE = "bf16 Z-Reg off"


def configs(zregs: list[float]) -> dict[str, tuple[list[str], bool]]:
    """name -> (extra flags, bf16)."""
    out = {"fp32 Z-Reg off": ([], False), BASELINE: ([], True)}
    for w in zregs:
        out[f"bf16 Z-Reg {w:g}"] = (["--attention-zreg-coeff", str(w)], True)
    return out


# ------------------------------------------------------------------------------------------ capture
class QKVCapture:
    """While ``on``, keeps the q, k, v [b, heads, s, d] each attention layer's core receives."""

    def __init__(self, trainer) -> None:
        from megatron_cai.core.transformer.self_attention import SelfAttention

        self.on, self.items = False, []
        for mod in T.core_model(trainer).modules():
            if isinstance(mod, SelfAttention):
                original = mod._core_attention

                def core(q, k, v, *rest, _orig=original, _layer=mod.layer_number):
                    if self.on:
                        self.items.append((_layer, q.detach(), k.detach(), v.detach()))
                    return _orig(q, k, v, *rest)

                mod._core_attention = core

    def run(self, fn):
        self.on, self.items = True, []
        try:
            fn()
        finally:
            self.on = False
        return self.items


def causal_lse(q, k):
    """fp64 lse [b, h, s] of causal attention rows."""
    import torch

    q, k = q.double(), k.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)


def lse_stats(items) -> dict:
    import torch

    lse = torch.cat([causal_lse(q, k).flatten() for _, q, k, _ in items])
    return {"lse_mean": float(lse.mean()), "lse_p99": float(torch.quantile(lse.float(), 0.99)),
            "lse_max": float(lse.max())}


# ------------------------------------------------------------------------------------------ training
def train_one(opts, name: str, seed: int) -> dict:
    import torch

    flags, bf16 = opts._configs[name]
    t0 = time.time()
    tr = T.build_trainer(T.small_gpt_argv(
        layers=opts.layers, hidden=opts.hidden, heads=opts.heads, seq=opts.seq, batch=opts.batch, iters=opts.iters,
        lr=opts.lr, seed=seed, data=opts._data, tok=opts._tok, cache=opts.cache_dir, bf16=bf16,
        valid_batches=max(opts.eval_iters, opts.final_eval_iters)) + flags)
    cap = QKVCapture(tr)
    curve, train_loss = [], []

    def evaluate() -> None:
        box = {}
        items = cap.run(lambda: box.setdefault("loss", T.fixed_valid_loss(tr, opts.eval_iters)))
        curve.append({"iteration": tr.state.iteration, "valid_loss": box["loss"], **lse_stats(items)})

    evaluate()
    while tr.state.iteration < opts.iters:
        hist = T.train_chunk(tr, min(opts.eval_interval, opts.iters - tr.state.iteration))
        train_loss += [h["lm loss"] for h in hist]
        evaluate()
    final = T.fixed_valid_loss(tr, opts.final_eval_iters)
    torch.save({k: v.detach().clone() for k, v in T.core_model(tr).state_dict().items()},
               os.path.join(opts._cache.dir, f"model_{name.replace(' ', '_')}_seed{seed}.pt"))
    return {"final_valid_loss": final, "curve": curve, "train_loss": train_loss,
            "loss_spikes": H.count_spikes(train_loss), "peak_lse_max": max(c["lse_max"] for c in curve),
            "end_lse_mean": curve[-1]["lse_mean"], "seconds": time.time() - t0}


# ------------------------------------------------------------------------------------------ mechanism
def row_errors(q, k, v) -> dict:
    """Per query row: reference lse and the errors of the bf16 stages and kernels (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from megatron_cai.core.transformer.attention import attend

    d = q.shape[-1]
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    q64, k64, v64 = q.double(), k.double(), v.double()
    s_ref = (q64 @ k64.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s_ref, -1)
    p_ref = torch.softmax(s_ref, -1)
    o_ref = p_ref @ v64
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    s_b = (qb @ kb.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # bf16 out
    s_b = s_b.masked_fill(~mask, float("-inf"))
    p_b = torch.softmax(s_b, -1)  # bf16 in, bf16 out
    o_b = p_b @ vb
    o_sdpa = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    b, t = q.shape[0], q.shape[-2]
    idx = torch.arange(t).expand(b, t)
    o_blk = attend(qb, kb, vb, idx, torch.full_like(idx, t), backend="blocked")
    finite = mask.expand_as(s_ref)
    logit_err = torch.where(finite, (s_b.double() - s_ref).abs(), torch.zeros((), dtype=torch.float64)).amax(-1)
    norm = o_ref.norm(dim=-1).clamp_min(1e-30)
    return {"lse": lse.flatten(), "logits": logit_err.flatten(),
            "softmax": (p_b.double() - p_ref).abs().sum(-1).flatten(),
            "output": ((o_b.double() - o_ref).norm(dim=-1) / norm).flatten(),
            "output sdpa": ((o_sdpa.double() - o_ref).norm(dim=-1) / norm).flatten(),
            "output blocked": ((o_blk.double() - o_ref).norm(dim=-1) / norm).flatten()}


METRICS = ("logits", "softmax", "output", "output sdpa", "output blocked")


def mechanism(opts, name: str, seeds: list[int]) -> dict:
    """Errors vs lse on the trained checkpoints of ``name`` (rows of every seed pooled), binned by lse."""
    import torch

    flags, _ = opts._configs[name]
    rows = {m: [] for m in ("lse", *METRICS)}
    sweep = []
    for seed in seeds:
        tr = T.build_trainer(T.small_gpt_argv(
            layers=opts.layers, hidden=opts.hidden, heads=opts.heads, seq=opts.seq, batch=opts.batch,
            iters=opts.iters, lr=opts.lr, seed=seed, data=opts._data, tok=opts._tok, cache=opts.cache_dir,
            bf16=False, valid_batches=max(opts.eval_iters, opts.final_eval_iters)) + flags)
        state = torch.load(os.path.join(opts._cache.dir, f"model_{name.replace(' ', '_')}_seed{seed}.pt"))
        T.core_model(tr).load_state_dict(state)
        cap = QKVCapture(tr)
        items = cap.run(lambda t=tr: T.fixed_valid_loss(t, opts.mech_batches))  # fp32: no autocast
        with torch.no_grad():
            for _, q, k, v in items:
                for m, val in row_errors(q.float(), k.float(), v.float()).items():
                    rows[m].append(val)
            if name == BASELINE and seed == seeds[0]:
                sweep = logit_scale_sweep(items, opts.sweep_scales)
    cat = {m: torch.cat(v) for m, v in rows.items()}
    edges = [float(e) for e in range(int(math.floor(cat["lse"].min())), int(math.ceil(cat["lse"].max())) + 1,
                                     opts.bin_width)]
    if len(edges) < 2 or edges[-1] < float(cat["lse"].max()):
        edges.append(edges[-1] + opts.bin_width)
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (cat["lse"] >= lo) & (cat["lse"] < hi)
        n = int(sel.sum())
        if n:
            bins.append({"lse_lo": lo, "lse_hi": hi, "rows": n,
                         **{m: float(cat[m][sel].mean()) for m in METRICS}})
    return {"rows": int(cat["lse"].numel()), "bins": bins, "logit_scale_sweep": sweep,
            "overall": {m: float(cat[m].mean()) for m in METRICS},
            "lse_mean": float(cat["lse"].mean()), "lse_max": float(cat["lse"].max()),
            "corr_log_output_err_vs_lse": _corr(cat["lse"], cat["output"].clamp_min(1e-12).log())}


def logit_scale_sweep(items, scales: list[float]) -> list[dict]:
    """The same rows with q scaled by t (logits x t, so larger lse): mean lse and mean errors per t."""
    import torch

    out = []
    with torch.no_grad():
        for t in scales:
            errs = [row_errors(q.float() * t, k.float(), v.float()) for _, q, k, v in items]
            cat = {m: torch.cat([e[m] for e in errs]) for m in ("lse", *METRICS)}
            out.append({"scale": t, "lse_mean": float(cat["lse"].mean()), "lse_max": float(cat["lse"].max()),
                        **{m: float(cat[m].mean()) for m in METRICS}})
    return out


def _corr(x, y) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()).clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ report
def summarise(per: dict) -> dict:
    out = {}
    for name, per_seed in per.items():
        row = {"valid_loss": H.seed_summary(per_seed, "final_valid_loss"),
               "end_lse_mean": H.seed_summary(per_seed, "end_lse_mean"),
               "peak_lse_max": H.seed_summary(per_seed, "peak_lse_max"),
               "loss_spikes": sum(r["loss_spikes"] for r in per_seed.values())}
        if name != BASELINE:
            row["paired_gap"] = H.paired_gap(per_seed, per[BASELINE], "final_valid_loss")
            row["gap_over_spread"] = (row["paired_gap"]["diff_mean"] / max(row["valid_loss"]["std"],
                                      H.seed_summary(per[BASELINE], "final_valid_loss")["std"], 1e-12))
        out[name] = row
    return out


def findings(res: dict) -> list[str]:
    s, mech = res["summary"], res["mechanism"]
    out = []
    off = mech.get(BASELINE)
    if off:
        b = off["bins"]
        c = off["corr_log_output_err_vs_lse"]
        out.append(f"Z-Reg off checkpoints: bf16 attention output error {b[0]['output']:.2e} at lse "
                   f"[{b[0]['lse_lo']:g}, {b[0]['lse_hi']:g}) and {b[-1]['output']:.2e} at [{b[-1]['lse_lo']:g}, "
                   f"{b[-1]['lse_hi']:g}); corr(log error, lse) = {c:+.2f}: "
                   + ("the error rises with lse." if c > 0.3 else "no rise with lse over the range these rows span."))
        sw = off.get("logit_scale_sweep") or []
        if len(sw) > 1:
            a, z = sw[0], sw[-1]
            out.append(f"Logits x{z['scale']:g} (lse mean {a['lse_mean']:.1f} -> {z['lse_mean']:.1f}, max "
                       f"{z['lse_max']:.1f}): bf16 logit error x{z['logits'] / a['logits']:.1f}, softmax L1 error "
                       f"x{z['softmax'] / a['softmax']:.1f}, output error x{z['output'] / a['output']:.2f} (bf16 "
                       f"logits), x{z['output sdpa'] / a['output sdpa']:.2f} (SDPA): the output error is set by bf16 "
                       "rounding of P, V and the output, not by the lse, in this range.")
    for name, m in mech.items():
        if name != BASELINE and off:
            out.append(f"{name}: mean lse {m['lse_mean']:.2f} vs {off['lse_mean']:.2f} off; mean output error "
                       f"{m['overall']['output']:.2e} vs {off['overall']['output']:.2e} (bf16 logits), its kernel "
                       f"{m['overall']['output blocked']:.2e} vs SDPA off {off['overall']['output sdpa']:.2e}; bf16 "
                       f"logit error {m['overall']['logits']:.2e} vs {off['overall']['logits']:.2e} (it follows "
                       "|logit|; lse near 0 here means logits well below 0).")
    spikes = {name: row["loss_spikes"] for name, row in s.items()}
    for name, row in s.items():
        if "paired_gap" in row:
            g = row["paired_gap"]
            z = g["diff_mean"] / g["diff_std"] if g["diff_std"] > 0 else float("inf")
            out.append(f"{name} vs {BASELINE}: valid loss {g['diff_mean']:+.4f} ± {g['diff_std']:.4f} "
                       f"({g['rel_pct_mean']:+.2f}%; {z:+.1f} paired stds, {row['gap_over_spread']:+.1f} seed stds).")
    same = len(set(spikes.values())) == 1
    out.append("Loss spikes (summed over seeds): " + ", ".join(f"{n} {v}" for n, v in spikes.items())
               + (" — the same in every configuration, fp32 included: hard batches, not bf16 numerics."
                  if same else "."))
    return out


def markdown(res: dict) -> str:
    o = res["settings"]
    lines = ["# What Attention Z-Reg buys in bf16", "",
             f"`python bench/zreg_bf16.py{' --quick' if o['quick'] else ''}` — GPT {o['layers']} layers, hidden "
             f"{o['hidden']}, {o['heads']} heads, seq {o['seq']}, batch {o['batch']}, {o['iters']} iterations (lr "
             f"{o['lr']:g} cosine, wd 0.1), demo corpus (vocab {o['vocab']}), seeds {res['seeds']}; every "
             "configuration from the same initialisation on the same batches.", "",
             "## Mechanism: bf16 attention error against fp64, binned by the row's lse", "",
             "Rows of the trained checkpoints (every seed) on fixed validation batches. logits: max |error| over "
             "the row; softmax: sum |error| over the row; output: ||error|| / ||reference|| — for the step-by-step "
             "bf16 pipeline (bf16 logits and probabilities), and for the kernels the model runs (SDPA when Z-Reg is "
             "off, the blocked kernel when on; both keep the softmax in fp32).", ""]
    for name, m in res["mechanism"].items():
        lines += [f"### {name} ({m['rows']:,} rows, mean lse {m['lse_mean']:.2f}, max {m['lse_max']:.2f})", "",
                  "| lse bin | rows | logits | softmax | output (bf16 logits) | output SDPA | output blocked |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for b in m["bins"]:
            lines.append(f"| [{b['lse_lo']:g}, {b['lse_hi']:g}) | {b['rows']} | {b['logits']:.2e} | "
                         f"{b['softmax']:.2e} | {b['output']:.2e} | {b['output sdpa']:.2e} | "
                         f"{b['output blocked']:.2e} |")
        lines.append("")
        if m.get("logit_scale_sweep"):
            lines += ["Logit-scale sweep on these rows (first seed): q x t, so every logit x t and the lse grows; the "
                      "same mean errors:", "",
                      "| t | lse mean | lse max | logits | softmax | output (bf16 logits) | output SDPA | "
                      "output blocked |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in m["logit_scale_sweep"]:
                lines.append(f"| {r['scale']:g} | {r['lse_mean']:.2f} | {r['lse_max']:.2f} | {r['logits']:.2e} | "
                             f"{r['softmax']:.2e} | {r['output']:.2e} | {r['output sdpa']:.2e} | "
                             f"{r['output blocked']:.2e} |")
            lines.append("")
    lines += ["## Training", "",
              f"Final validation loss over {o['final_eval_iters']} fixed batches, mean ± std over seeds; paired gap "
              f"to {BASELINE} of the same seed; lse of every attention row at the last evaluation (mean) and its "
              "peak over training (max).", "",
              "| configuration | valid loss | paired gap | gap (%) | gap / spread | lse mean (end) | lse max (peak) "
              "| spikes |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["summary"].items():
        g = r.get("paired_gap")
        lines.append(
            f"| {name} | {H.fmt_pm(r['valid_loss']['mean'], r['valid_loss']['std'])} | "
            + (f"{g['diff_mean']:+.4f} ± {g['diff_std']:.4f} | {g['rel_pct_mean']:+.2f} ± {g['rel_pct_std']:.2f} | "
               f"{r['gap_over_spread']:+.1f}" if g else "- | - | -")
            + f" | {H.fmt_pm(r['end_lse_mean']['mean'], r['end_lse_mean']['std'], 2)} | "
              f"{H.fmt_pm(r['peak_lse_max']['mean'], r['peak_lse_max']['std'], 2)} | {r['loss_spikes']} |")
    lines += ["", "## Finding", "", *[f"- {f}" for f in res["findings"]], ""]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    names = list(res["per_seed"])
    colors = {n: plt.cm.tab10(i) for i, n in enumerate(names)}
    for name, m in res["mechanism"].items():
        x = [(b["lse_lo"] + b["lse_hi"]) / 2 for b in m["bins"]]
        axes[0].plot(x, [b["logits"] for b in m["bins"]], marker="o", color=colors[name], label=f"{name} logits")
        axes[0].plot(x, [b["softmax"] for b in m["bins"]], marker="s", ls="--", color=colors[name],
                     label=f"{name} softmax L1")
        axes[1].plot(x, [b["output"] for b in m["bins"]], marker="o", color=colors[name],
                     label=f"{name} bf16 logits")
        kernel = "output sdpa" if name == BASELINE else "output blocked"
        axes[1].plot(x, [b[kernel] for b in m["bins"]], marker="x", ls=":", color=colors[name],
                     label=f"{name} {kernel.split()[1]} kernel")
    sweep = res["mechanism"].get(BASELINE, {}).get("logit_scale_sweep", [])
    if sweep:
        axes[1].plot([r["lse_mean"] for r in sweep], [r["output"] for r in sweep], marker="D", color="black",
                     label="Z-Reg off, q x t sweep (bf16 logits)")
        axes[1].plot([r["lse_mean"] for r in sweep], [r["output sdpa"] for r in sweep], marker="D", ls=":",
                     color="gray", label="Z-Reg off, q x t sweep (SDPA)")
    axes[0].set(title="bf16 logits / softmax error vs row lse", xlabel="row lse (fp64)", yscale="log")
    axes[1].set(title="attention output rel. error vs row lse", xlabel="row lse (fp64)", yscale="log")
    for name in names:
        for i, seed in enumerate(sorted(res["per_seed"][name], key=int)):
            c = res["per_seed"][name][seed]["curve"]
            it = [p["iteration"] for p in c]
            axes[2].plot(it[1:], [p["valid_loss"] for p in c[1:]], color=colors[name],
                         label=name if i == 0 else None, alpha=0.8)
            axes[3].plot(it, [p["lse_max"] for p in c], color=colors[name], label=name if i == 0 else None,
                         alpha=0.8)
    axes[2].set(title="validation loss (every seed)", xlabel="iteration")
    axes[3].set(title="attention lse max over rows", xlabel="iteration")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def _quick(o: argparse.Namespace) -> None:
    o.layers, o.hidden, o.heads, o.seq, o.batch = 1, 32, 2, 32, 2
    o.iters, o.eval_interval, o.eval_iters, o.final_eval_iters, o.mech_batches = 6, 3, 1, 1, 1
    o.vocab, o.corpus_mb = QUICK["vocab"], QUICK["corpus_mb"]
    o.seeds = o.seeds[:2]


def parse(argv=None) -> argparse.Namespace:
    p = H.parser(__doc__, "zreg_bf16")
    H.add(p, seeds=[1, 2, 3])
    p.add_argument("--zreg", type=float, nargs=2, default=[1e-3, 1e-2], help="the two Z-Reg coefficients")
    H.add(p, layers=2, hidden=32, heads=2, seq=64, batch=4, vocab=2048, corpus_mb=3.0, iters=80, lr=3e-3,
          eval_interval=20, eval_iters=2, final_eval_iters=6)
    p.add_argument("--mech-batches", type=int, default=2, help="validation batches of the mechanism measurement")
    p.add_argument("--bin-width", type=int, default=1, help="lse bin width")
    p.add_argument("--sweep-scales", type=float, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--train-only", action="store_true", help="train (into the cache) and write no results")
    return H.parse(p, argv, quick=_quick)


def main(argv=None) -> dict:
    import torch

    o = parse(argv)
    if o.from_json:
        H.Results(o.out).rewrite(markdown, plot)
        return {}
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    t0 = time.time()
    o._data, o._tok = demo_corpus(o.cache_dir, o.vocab, o.corpus_mb)
    o._configs = configs(o.zreg)
    settings = {k: v for k, v in vars(o).items()
                if not k.startswith("_") and k not in ("out", "seeds", "train_only", "bench", "from_json")}
    o._cache = RunCache(os.path.join(o.cache_dir, "zreg_bf16"), settings_key(settings))
    # Several processes may run this at once (same flags): they share the runs through the cache's locks.
    items = [(name, seed, lambda n=name, s=seed: train_one(o, n, s)) for seed in o.seeds for name in o._configs]
    per = o._cache.run_all(items, lambda n, s, r: print(
        f"seed {s} {n}: final valid loss {r['final_valid_loss']:.4f}, peak lse {r['peak_lse_max']:.2f} "
        f"({r['seconds']:.0f} s)", flush=True))
    if o.train_only:
        return {}
    mech = {name: mechanism(o, name, o.seeds) for name in o._configs if name != "fp32 Z-Reg off"}
    res = {"seeds": o.seeds, "settings": settings, "per_seed": per, "mechanism": mech}
    res["summary"] = summarise(per)
    res["findings"] = findings(res)
    res["seconds"] = time.time() - t0
    H.Results(o.out).write(res, markdown, plot, record_machine=False)
    return res


if __name__ == "__main__":
    main()

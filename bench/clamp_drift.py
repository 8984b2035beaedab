"""Clamping under drift: int8 / FP8 E4M3 QAT with static, absmax, RMS and weight-RMS clamps vs bf16, 3+ seeds.

    python bench/clamp_drift.py [--seeds 1 2 3] [--quick] [--out bench/results/clamp_drift]

Per seed, a small GPT (ReLU^2 FFN) first trains in bf16 from scratch (``--base-iters``, lr 2e-3, weight decay
0.1): the warm-start checkpoint. The drift regime is then chosen by measuring (on the first seed, bf16): the
growth of the fc2 input's RMS (the ReLU^2 output) over ``--iters`` iterations in each candidate regime

- ``from scratch``: the base run itself (its fc2-input RMS at iteration 0 and at the end);
- ``warm, high lr, no wd``: the checkpoint continued at ``--lr`` with no weight decay;
- ``warm, rescaled``: the same, after the function-preserving rescale fc1 (weight, bias) x s, fc2 x 1/s^2
  (relu(s z)^2 = s^2 relu(z)^2), so the fc2 input starts s^2 times smaller and regrows under Adam;

and the candidate with the largest |log growth| is used for every configuration. In it each configuration
trains from the same checkpoint on the same batches: bf16 (the reference) and int8 / FP8 E4M3 (E5M2
gradients) fake-quantized GEMMs with the activation clamp ``static`` (calibrated on the first forward, at
step 0, then fixed), ``absmax``, ``rms`` and ``weight-rms``. Reported per configuration: the final validation
loss (mean ± std over seeds) and its paired gap to bf16 of the same seed; over training, the fc2 input's RMS
and the fractions of its values zeroed and clipped by the quantizer. Writes ``--out``.{json,md,png}.
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

FORMATS = {"int8": ["--qat", "int8"], "fp8": ["--qat", "fp8", "--fp8-format", "hybrid"]}
CLAMPS = ("static", "absmax", "rms", "weight-rms")
CONFIGS = {"bf16": [], **{f"{fmt} {c}": [*flags, "--qat-clamp", c] for fmt, flags in FORMATS.items()
                          for c in CLAMPS}}
DYNAMIC = tuple(n for n in CONFIGS if n.endswith("rms"))
BASE_LR, BASE_WD = 2e-3, 0.1


# ------------------------------------------------------------------------------------------ probes
class Fc2Probe:
    """While ``on``, records per fc2 layer its input's RMS and (QAT) the clamp's zeroed / clipped fractions."""

    def __init__(self, trainer) -> None:
        from qat_training import _fc2_probe

        self.on, self.now = False, {}
        self.rms: dict[str, float] = {}
        self._qat = {"on": False, "now": {}}
        self.has_qat = bool(_fc2_probe(trainer, self._qat))
        for name, mod in T.core_model(trainer).named_modules():
            if name.endswith("mlp.linear_fc2"):
                mod.register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(_mod, inputs):
            if self.on and name not in self.rms:
                self.rms[name] = float(inputs[0].detach().float().pow(2).mean().sqrt())
        return hook

    def measure(self, fn):
        """Run ``fn`` (an evaluation) with the probe on; return (fn's result, layer-mean statistics)."""
        self.on, self.rms, self._qat["on"], self._qat["now"] = True, {}, self.has_qat, {}
        try:
            out = fn()
        finally:
            self.on, self._qat["on"] = False, False
        stats = {"rms": sum(self.rms.values()) / len(self.rms)}
        if self._qat["now"]:
            q = list(self._qat["now"].values())
            for k in ("zeroed", "clipped", "rel_rmse", "c_over_rms"):
                stats[k] = sum(p[k] for p in q) / len(q)
        return out, stats


def rescale_ffn(model, s: float) -> None:
    """fc1 weight and bias x s, fc2 weight x 1/s^2: the same function for a ReLU^2 FFN, fc2 input x s^2."""
    import torch

    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("mlp.linear_fc1"):
                mod.weight.mul_(s)
                if mod.bias is not None:
                    mod.bias.mul_(s)
            elif name.endswith("mlp.linear_fc2"):
                mod.weight.mul_(1.0 / s**2)


# ------------------------------------------------------------------------------------------ runs
def argv_for(opts, seed: int, iters: int, lr: float, wd: float) -> list[str]:
    return T.small_gpt_argv(layers=opts.layers, hidden=opts.hidden, heads=opts.heads, seq=opts.seq,
                            batch=opts.batch, iters=iters, lr=lr, seed=seed, data=opts._data, tok=opts._tok,
                            cache=opts.cache_dir, weight_decay=wd, warmup=max(1, iters // 20),
                            valid_batches=max(opts.eval_iters, opts.final_eval_iters))


def train_base(opts, seed: int) -> dict:
    """The bf16 warm-start checkpoint of one seed (a .pt in the cache) and its fc2-input RMS growth (JSON)."""
    import torch

    path = os.path.join(opts._bases.dir, f"base_seed{seed}.pt")
    if not os.path.exists(path):
        tr = T.build_trainer(argv_for(opts, seed, opts.base_iters, BASE_LR, BASE_WD))
        probe = Fc2Probe(tr)
        _, first = probe.measure(lambda: T.fixed_valid_loss(tr, opts.eval_iters))
        T.train_chunk(tr, opts.base_iters)
        loss, last = probe.measure(lambda: T.fixed_valid_loss(tr, opts.final_eval_iters))
        base = {"state": {k: v.detach().clone() for k, v in T.core_model(tr).state_dict().items()},
                "consumed": tr.state.consumed_train_samples, "valid_loss": loss,
                "rms_growth": last["rms"] / first["rms"]}
        torch.save(base, path + f".tmp{os.getpid()}")
        os.replace(path + f".tmp{os.getpid()}", path)
    base = torch.load(path)
    return {"path": path, "consumed": base["consumed"], "valid_loss": base["valid_loss"],
            "rms_growth": base["rms_growth"]}


def load_base(meta: dict) -> dict:
    import torch

    return {**meta, "state": torch.load(meta["path"])["state"]}


def run_config(opts, name: str, seed: int, base: dict, lr: float, wd: float, rescale: float) -> dict:
    """One configuration warm-started from ``base`` in the drift regime; curves and the final valid loss."""
    t0 = time.time()
    tr = T.build_trainer(argv_for(opts, seed, opts.iters, lr, wd) + CONFIGS[name])
    model = T.core_model(tr)
    missing, unexpected = model.load_state_dict(load_base(base)["state"], strict=False)
    bad = [k for k in missing if not k.endswith("_static_c")] + list(unexpected)
    if bad:
        raise RuntimeError(f"warm start of {name!r}: checkpoint keys do not match the model: {bad[:5]}")
    if rescale != 1.0:
        rescale_ffn(model, rescale)
    tr.state.consumed_train_samples = base["consumed"]  # continue the data order after the base run
    tr.train_iter = T.loader(tr, tr.train_ds, base["consumed"])
    probe = Fc2Probe(tr)
    curve = []

    def evaluate(it: int) -> None:
        loss, stats = probe.measure(lambda: T.fixed_valid_loss(tr, opts.eval_iters))
        curve.append({"iteration": it, "valid_loss": loss, **stats})

    evaluate(0)  # the first forward: a static clamp calibrates here, at step 0 of the regime
    train_loss = []
    while tr.state.iteration < opts.iters:
        hist = T.train_chunk(tr, min(opts.eval_interval, opts.iters - tr.state.iteration))
        train_loss += [h["lm loss"] for h in hist]
        evaluate(tr.state.iteration)
    final = T.fixed_valid_loss(tr, opts.final_eval_iters)
    return {"final_valid_loss": final, "curve": curve, "train_loss": train_loss,
            "loss_spikes": H.count_spikes(train_loss),
            "seconds": time.time() - t0}


def choose_regime(opts, seed: int, base: dict) -> dict:
    """Measure the fc2-input RMS growth of each candidate regime (bf16, first seed); pick the largest."""
    cands = {"from scratch (lr 2e-3, wd 0.1)": {"growth": base["rms_growth"], "lr": BASE_LR, "wd": BASE_WD,
                                                "rescale": None}}
    labels = (("warm, high lr, no wd", 1.0), (f"warm, rescaled fc1 x{opts.rescale:g}", opts.rescale))
    runs = opts._cache.run_all([(f"candidate {label}", seed, lambda r=rescale: run_config(
        opts, "bf16", seed, base, opts.lr, 0.0, r)) for label, rescale in labels])
    for label, rescale in labels:
        run = runs[f"candidate {label}"][str(seed)]
        cands[label] = {"growth": run["curve"][-1]["rms"] / run["curve"][0]["rms"], "lr": opts.lr, "wd": 0.0,
                        "rescale": rescale, "final_valid_loss": run["final_valid_loss"]}
    warm = {k: v for k, v in cands.items() if v["rescale"] is not None}  # a regime must start from the checkpoint
    chosen = max(warm, key=lambda k: abs(math.log(warm[k]["growth"])))
    return {"candidates": cands, "chosen": chosen, **warm[chosen]}


# ------------------------------------------------------------------------------------------ report
def summarise(per_config: dict) -> dict:
    out = {}
    base = per_config["bf16"]
    for name, per_seed in per_config.items():
        s = H.seed_summary(per_seed, "final_valid_loss")
        gap = H.paired_gap(per_seed, base, "final_valid_loss") if name != "bf16" else None
        spread = max(H.seed_summary(base, "final_valid_loss")["std"], s["std"])
        end = [per_seed[k]["curve"][-1] for k in per_seed]
        row = {"valid_loss": s, "paired_gap": gap, "seed_spread": spread,
               "gap_over_spread": (gap["diff_mean"] / spread if gap and spread > 0 else None),
               "loss_spikes": sum(H.count_spikes(per_seed[k]["train_loss"]) for k in per_seed)}
        for k in ("zeroed", "clipped", "rms"):
            if k in end[0]:
                row[f"{k}_end"] = sum(e[k] for e in end) / len(end)
        out[name] = row
    return out


def markdown(res: dict) -> str:
    o, reg = res["settings"], res["regime"]
    lines = ["# Clamping under drift: static / absmax / RMS / weight-RMS in int8 and FP8 QAT vs bf16", "",
             f"`python bench/clamp_drift.py{' --quick' if o['quick'] else ''}` — GPT {o['layers']} layers, hidden "
             f"{o['hidden']}, {o['heads']} heads, ReLU^2 FFN, seq {o['seq']}, batch {o['batch']}, demo corpus "
             f"(vocab {o['vocab']}), bf16 autocast, seeds {res['seeds']} (the seed sets the initialisation and the "
             f"data order). Base: {o['base_iters']} bf16 iterations from scratch (lr {BASE_LR:g}, wd {BASE_WD:g}); "
             f"then {o['iters']} iterations per configuration from that checkpoint on the same batches. The LM "
             "head stays in bf16; every other GEMM quantizes both inputs (weights: per-row absmax).", "",
             "## Choosing the regime (measured, first seed, bf16)", "",
             "| candidate | fc2-input RMS end / start |", "|---|---:|"]
    for label, c in reg["candidates"].items():
        lines.append(f"| {label} | {c['growth']:.3g}x |")
    lines += ["", f"Chosen: **{reg['chosen']}** (lr {reg['lr']:g}, weight decay {reg['wd']:g}, fc1 x "
              f"{reg['rescale']:g} / fc2 x {1 / reg['rescale'] ** 2:g}): the warm-start candidate whose fc2 input "
              "moves the most, so a clamp fixed at step 0 is the furthest from the activations at the end.", "",
              "## Final validation loss", "",
              f"Mean ± std over {len(res['seeds'])} seeds ({o['final_eval_iters']} fixed validation batches); "
              "paired gap: this configuration minus bf16 of the same seed, mean ± std over seeds; gap / spread: "
              "the mean gap over the larger seed std of the two; gap / paired std: over the std of the paired "
              "gaps; fc2 input at the last evaluation (mean over seeds "
              "and layers): values zeroed (non-zero -> 0) and clipped (|h| > c).", "",
              "| configuration | valid loss | paired gap | gap (%) | gap / spread | gap / paired std | zeroed "
              "| clipped | spikes |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in res["summary"].items():
        g = s["paired_gap"]
        gap = f"{g['diff_mean']:+.4f} ± {g['diff_std']:.4f}" if g else "-"
        pct = f"{g['rel_pct_mean']:+.2f} ± {g['rel_pct_std']:.2f}" if g else "-"
        z = f"{s['gap_over_spread']:+.1f} | {_paired_z(g):+.1f}" if s["gap_over_spread"] is not None else "- | -"
        zer = f"{s['zeroed_end']:.2%}" if "zeroed_end" in s else "-"
        cli = f"{s['clipped_end']:.3%}" if "clipped_end" in s else "-"
        lines.append(f"| {name} | {H.fmt_pm(s['valid_loss']['mean'], s['valid_loss']['std'])} | {gap} | {pct} | "
                     f"{z} | {zer} | {cli} | {s['loss_spikes']} |")
    lines += ["", "## Finding", "", *[f"- {f}" for f in res["findings"]], ""]
    return "\n".join(lines)


def _paired_z(gap: dict) -> float:
    return gap["diff_mean"] / gap["diff_std"] if gap["diff_std"] > 0 else float("inf")


def findings(res: dict) -> list[str]:
    s = res["summary"]
    out = []
    dyn = {n: s[n]["paired_gap"]["rel_pct_mean"] for n in DYNAMIC if n in s}
    ok = [n for n, g in dyn.items() if abs(g) <= 1.0]
    out.append(f"Dynamic clamps within 1% of bf16: {len(ok)}/{len(dyn)} ("
               + ", ".join(f"{n} {g:+.2f}%" for n, g in dyn.items()) + ").")
    for n in s:
        if n == "bf16":
            continue
        g, z = s[n]["paired_gap"], s[n]["gap_over_spread"]
        sep = ("worse than bf16 by more than 3 seed stds" if z is not None and z > 3 else
               "better than bf16 by more than 3 seed stds" if z is not None and z < -3 else
               "not separated from bf16 by 3 seed stds")
        clip = f"clips {s[n]['clipped_end']:.1%} / zeroes {s[n]['zeroed_end']:.1%} of the fc2 input at the end; " \
            if "clipped_end" in s[n] else ""
        out.append(f"{n}: {clip}loss {g['rel_pct_mean']:+.2f} ± {g['rel_pct_std']:.2f}% "
                   f"({z:+.1f} seed stds, {_paired_z(g):+.1f} paired stds) — {sep}.")
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    names = list(res["per_seed"])
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (a_loss, a_rms), (a_zero, a_clip) = axes
    for name in names:
        runs = res["per_seed"][name]
        ls = "-" if name == "bf16" or name.startswith("int8") else "--"
        for i, seed in enumerate(sorted(runs, key=int)):
            c = runs[seed]["curve"]
            it = [p["iteration"] for p in c]
            lab = name if i == 0 else None
            ref = res["per_seed"]["bf16"][seed]["curve"]
            a_loss.plot(it, [p["valid_loss"] - r["valid_loss"] for p, r in zip(c, ref)], ls=ls, color=colors[name],
                        label=lab, alpha=0.8)
            a_rms.plot(it, [p["rms"] for p in c], ls=ls, color=colors[name], label=lab, alpha=0.8)
            if "zeroed" in c[0]:
                a_zero.plot(it, [p["zeroed"] for p in c], ls=ls, color=colors[name], label=lab, alpha=0.8)
                a_clip.plot(it, [max(p["clipped"], 1e-7) for p in c], ls=ls, color=colors[name], label=lab,
                            alpha=0.8)
    a_loss.set(title="validation loss minus bf16 of the same seed (every seed)", xlabel="iteration")
    a_rms.set(title="fc2 input (ReLU^2 output) RMS, mean over layers", xlabel="iteration", yscale="log")
    a_zero.set(title="fc2 input: fraction of non-zero values quantized to 0", xlabel="iteration")
    a_clip.set(title="fc2 input: fraction clipped (|h| > c)", xlabel="iteration", yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"clamp_drift — regime: {res['regime']['chosen']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def _quick(o: argparse.Namespace) -> None:
    o.layers, o.hidden, o.heads, o.seq, o.batch = 1, 32, 2, 32, 2
    o.base_iters, o.iters, o.eval_interval, o.eval_iters, o.final_eval_iters = 6, 6, 3, 1, 1
    o.vocab, o.corpus_mb = QUICK["vocab"], QUICK["corpus_mb"]
    o.seeds = o.seeds[:2]


def parse(argv=None) -> argparse.Namespace:
    p = H.parser(__doc__, "clamp_drift")
    H.add(p, seeds=[1, 2, 3], layers=2, hidden=32, heads=2, seq=32, batch=4, vocab=2048, corpus_mb=3.0)
    p.add_argument("--base-iters", type=int, default=60)
    p.add_argument("--iters", type=int, default=80, help="iterations of each configuration in the drift regime")
    p.add_argument("--lr", type=float, default=4e-3, help="lr of the warm-start regimes (no weight decay)")
    p.add_argument("--rescale", type=float, default=0.1, help="s of the rescaled warm start")
    H.add(p, eval_interval=10, eval_iters=2, final_eval_iters=6)
    p.add_argument("--regime-seed", type=int, default=None, help="seed of the regime choice (default: the first)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    o = H.parse(p, argv, quick=_quick)
    o.regime_seed = o.seeds[0] if o.regime_seed is None else o.regime_seed
    if "bf16" not in o.configs:
        o.configs = ["bf16", *o.configs]
    return o


def main(argv=None) -> dict:
    import torch

    o = parse(argv)
    if o.from_json:
        H.Results(o.out).rewrite(markdown, plot)
        return {}
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    t0 = time.time()
    o._data, o._tok = demo_corpus(o.cache_dir, o.vocab, o.corpus_mb)
    settings = {k: v for k, v in vars(o).items()
                if not k.startswith("_") and k not in ("out", "configs", "seeds", "regime_seed", "bench", "from_json")}
    o._cache = RunCache(os.path.join(o.cache_dir, "clamp_drift"), settings_key(settings))
    base_key = settings_key({k: settings[k] for k in ("layers", "hidden", "heads", "seq", "batch", "vocab",
                                                      "corpus_mb", "base_iters", "eval_iters", "final_eval_iters")})
    o._bases = RunCache(os.path.join(o.cache_dir, "clamp_drift"), f"base_{base_key}")
    # Several processes may run this at once (same flags): they share the runs through the cache's locks.
    seeds = list(dict.fromkeys([o.regime_seed, *o.seeds]))
    bases = {int(s): r for s, r in o._bases.run_all([("base", s, lambda s=s: train_base(o, s)) for s in seeds])[
        "base"].items()}
    regime = choose_regime(o, o.regime_seed, bases[o.regime_seed])
    print(f"regime: {regime['chosen']} ({ {k: round(v['growth'], 3) for k, v in regime['candidates'].items()} })",
          flush=True)
    items = [(name, seed, lambda n=name, s=seed: run_config(o, n, s, bases[s], regime["lr"], regime["wd"],
                                                            regime["rescale"]))
             for seed in o.seeds for name in o.configs]  # seeds outermost: partial results cover whole seeds
    per = o._cache.run_all(items, lambda n, s, r: print(
        f"seed {s} {n}: final valid loss {r['final_valid_loss']:.4f} ({r['seconds']:.0f} s)", flush=True))
    res = {"seeds": o.seeds, "settings": settings, "regime": regime,
           "base": {str(s): {"valid_loss": b["valid_loss"], "rms_growth": b["rms_growth"]} for s, b in bases.items()},
           "per_seed": per, "seconds": time.time() - t0}
    res["summary"] = summarise(per)
    res["findings"] = findings(res)
    H.Results(o.out).write(res, markdown, plot, record_machine=False)
    return res


if __name__ == "__main__":
    main()

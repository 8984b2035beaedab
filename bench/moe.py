"""Mixture of Experts against a dense GPT at equal active parameters and equal tokens, and Squinch on its
expert gradients.

A small GPT on the demo corpus, 4 gloo ranks (DP 4; the MoE runs at EP 2, so each expert lives on an
expert-DP group of 2), trained for --iters iterations at each seed:

    dense (bf16 gradients) | MoE (bf16 gradients) | MoE (Squinch gradients, dense over DP and experts over
    expert DP)

The MoE model has --experts experts of width ffn / top-k each, top-k routing (--topk) and Megatron's aux loss, so
a token's active MLP parameters equal the dense model's (the router adds hidden x experts). Reported per variant:
final validation loss (mean and spread over seeds, on the same held-out sequences), tokens per second, gradient
bytes per iteration (as logged), the bytes per iteration the alltoall dispatcher sends to other ranks
(dispatch and combine, bf16 activations: counted from the routing), and, as a PNG, each MoE layer's expert load
over training (fraction of the routed tokens per expert, first seed, bf16 run).

    python bench/moe.py --seeds 1 2 3 --iters 400      # results/moe.{json,md,png}
    python bench/moe.py --quick                        # 2 iterations of a toy model, every variant

The report also sets the MoE's final validation loss with Squinch gradients against bf16 gradients, seed by seed,
and says whether the Squinch arm's mean lies within the bf16 arm's seed spread (min-max over seeds).

Run time: 9 trainings (3 variants x 3 seeds) of --iters 400 on 4 gloo ranks, one after another, the two MoE arms
at every seed first, then the dense baseline; each row is saved as it finishes (an interrupted run resumes from
bench/results/moe.rows.json). Each row's wall time is recorded ("wall_s") and the table ends with the run's total
and the machine's load; the committed results were measured on a shared, loaded 2-core machine (about 45 min), so
their tokens/s and times are not performance figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import harness as H
from harness.data import QUICK, demo_corpus
from harness.results import load_line

from megatron_cai.testing.distributed import run_distributed

MODEL = dict(layers=4, hidden=128, heads=4, seq=128, ffn=512)
QUICK_MODEL = dict(layers=2, hidden=32, heads=2, seq=16, ffn=64)
VARIANTS = {"dense": ["--grad-reduce-in-bf16"], "moe": ["--grad-reduce-in-bf16"], "moe squinch": ["--squinch"]}


def _argv(name: str, model: dict, opts, data: str, tok: str, seed: int) -> list[str]:
    argv = ["--data-path", data, "--tokenizer-model", tok, "--num-layers", str(model["layers"]),
            "--hidden-size", str(model["hidden"]), "--num-attention-heads", str(model["heads"]),
            "--seq-length", str(model["seq"]), "--max-position-embeddings", str(model["seq"]),
            "--ffn-hidden-size", str(model["ffn"]), "--micro-batch-size", "4", "--global-batch-size", "16",
            "--train-iters", str(opts.iters), "--lr", "2e-3", "--min-lr", "2e-4",
            "--lr-warmup-iters", str(max(opts.iters // 50, 1)), "--weight-decay", "0.1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1000000", "--eval-interval", str(opts.eval_interval),
            "--eval-iters", str(opts.eval_iters), "--seed", str(seed), "--position-embedding-type", "rope",
            "--lr-decay-style", "cosine", "--num-workers", "0", "--swiglu", "--disable-bias-linear",
            *VARIANTS[name]]
    if name.startswith("moe"):
        argv += ["--num-experts", str(opts.experts), "--moe-router-topk", str(opts.topk),
                 "--moe-ffn-hidden-size", str(model["ffn"] // opts.topk), "--moe-aux-loss-coeff", "1e-2",
                 "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
    return argv


class _RoutingCounter:
    """Per MoE layer: routed tokens per expert, per iteration, and the rows sent to other EP ranks."""

    def __init__(self, trainer) -> None:
        from megatron_cai.core import parallel_state as ps

        self.layers = trainer.moe.layers
        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.load = {layer.layer_number: [] for layer in self.layers}
        self.off_rank_rows = 0
        for layer in self.layers:
            layer.router.register_forward_hook(self._hook(layer.layer_number))

    def _hook(self, number: int):
        def hook(module, args, output):
            if not module.training:
                return
            per_expert = output[1].sum(dim=0).float()
            mine = per_expert.view(self.ep, -1)[self.ep_rank].sum()
            self.off_rank_rows += int(per_expert.sum() - mine)
            self.load[number].append(per_expert.tolist())
        return hook


def _train(argv: list[str], world: int, hidden: int) -> dict:
    from harness import training

    trainer = training.build_trainer(argv, world)
    counter = _RoutingCounter(trainer)
    t0 = time.time()
    state = trainer.train()
    seconds = time.time() - t0
    history = state.extra["history"]
    tokens = sum(h["global batch size"] for h in history) * trainer.config.model.seq_length
    return {"train": [h["lm loss"] for h in history], "validation": state.extra.get("validation", []),
            "tokens_per_second": tokens / seconds, "grad_bytes_per_iter": history[-1]["grad comm bytes"],
            "dispatch_bytes_per_iter": 2 * 2 * hidden * counter.off_rank_rows / max(len(history), 1),
            "load": counter.load}


def _worker(rank, world, argvs, hidden):
    return [_train(argv, world, hidden) for argv in argvs]


def _final(run: dict) -> float | None:
    return run["validation"][-1]["lm loss"] if run["validation"] else None


def render(payload: dict) -> str:
    runs, seeds = payload["runs"], payload["seeds"]
    lines = ["# MoE vs dense at equal active parameters (CPU, DP 4, MoE at EP 2)", "",
             f"{payload['model']}; {payload['experts']} experts, top-{payload['topk']}, expert width ffn / top-k; "
             f"{payload['iters']} iterations of 16 x seq tokens; validation on the same held-out sequences.", "",
             "| variant | final validation loss (mean) | std over seeds | tokens/s (median) | grad bytes / iter / rank"
             " | dispatch bytes / iter / rank |", "|---|---|---|---|---|---|"]
    for name in payload["variants"]:
        rs = [runs[f"{name}@{s}"] for s in seeds if f"{name}@{s}" in runs]
        finals = [v for v in map(_final, rs) if v is not None]
        mean = f"{statistics.mean(finals):.4f}" if finals else "-"
        std = f"{statistics.stdev(finals):.4f}" if len(finals) > 1 else "-"
        tps = f"{statistics.median(r['tokens_per_second'] for r in rs):,.0f}" if rs else "-"
        grad = f"{rs[0]['grad_bytes_per_iter']:,}" if rs else "-"
        disp = f"{rs[0]['dispatch_bytes_per_iter']:,.0f}" if rs and name != "dense" else "-"
        lines.append(f"| {name} | {mean} | {std} | {tps} | {grad} | {disp} |")
    lines += ["", *_squinch_vs_bf16(runs, seeds)]
    wall = payload.get("wall_s")
    took = f"\n\nRun time: {wall / 60:.1f} min (the trainings' wall time, one after another)." if wall else ""
    machine = payload.get("machine")
    load = (f" Machine at the start: {load_line(machine['start'])}; at the end: {load_line(machine['end'])} "
            "(shared: tokens/s and run time are not performance figures)." if machine else "")
    return "\n".join(lines) + took + load + f"\n\n![expert load]({payload['name']}.png)\n"


def _squinch_vs_bf16(runs: dict, seeds: list[int]) -> list[str]:
    """The MoE's final validation loss with Squinch expert (and dense) gradients against bf16 gradients, seed by
    seed: is the Squinch arm's mean within the bf16 arm's seed spread (its min-max over seeds)?"""
    finals = {name: {s: _final(runs[f"{name}@{s}"]) for s in seeds if f"{name}@{s}" in runs}
              for name in ("moe", "moe squinch")}
    rows = ["| seed | MoE bf16 | MoE Squinch | Squinch - bf16 |", "|---|---|---|---|"]
    for s in seeds:
        a, b = finals["moe"].get(s), finals["moe squinch"].get(s)
        gap = f"{b - a:+.4f}" if a is not None and b is not None else "-"
        rows.append(f"| {s} | {a if a is None else f'{a:.4f}'} | {b if b is None else f'{b:.4f}'} | {gap} |")
    bf16, squinch = list(finals["moe"].values()), list(finals["moe squinch"].values())
    if len(bf16) < 2 or not squinch:
        return ["Squinch vs bf16 (MoE): not enough finished seeds yet.", "", *rows]
    lo, hi, mean = min(bf16), max(bf16), statistics.mean(squinch)
    verdict = "within" if lo <= mean <= hi else "outside"
    gaps = [finals["moe squinch"][s] - finals["moe"][s] for s in seeds
            if s in finals["moe"] and s in finals["moe squinch"]]
    paired = (f" Paired by seed, Squinch is above bf16 at {sum(g > 0 for g in gaps)} of {len(gaps)} seeds (mean gap "
              f"{statistics.mean(gaps):+.4f})." if gaps else "")
    return [f"Squinch vs bf16 gradients (MoE, final validation loss, {len(squinch)} and {len(bf16)} seeds): Squinch "
            f"mean {mean:.4f}, bf16 mean {statistics.mean(bf16):.4f}, bf16 seed spread [{lo:.4f}, {hi:.4f}] (std "
            f"{statistics.stdev(bf16):.4f}): the Squinch mean is **{verdict}** the bf16 run's seed spread.{paired}",
            "", *rows]


def plot(payload: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    run = payload["runs"].get(f"moe@{payload['seeds'][0]}")
    if not run:
        return
    layers = sorted(run["load"], key=int)
    fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 4), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        steps = run["load"][layer]
        for e in range(len(steps[0]) if steps else 0):
            ax.plot([s[e] / max(sum(s), 1) for s in steps], lw=0.8, label=f"expert {e}")
        ax.set(title=f"layer {layer}: expert load", xlabel="micro-batch", ylabel="fraction of routed tokens")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _timed(run, argv: list[str]) -> dict:
    """One training's row, with its wall time."""
    t0 = time.perf_counter()
    row = run([argv])[0]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _quick(o: argparse.Namespace) -> None:
    o.iters, o.eval_interval, o.eval_iters, o.seeds = 2, 2, 1, o.seeds[:1]


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "moe")
    H.add(p, iters=400, eval_interval=50, seeds=[1, 2, 3])
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    opts = H.parse(p, argv, quick=_quick)
    start = time.perf_counter()
    model = QUICK_MODEL if opts.quick else MODEL
    settings = {"iters": opts.iters, "model": model, "experts": opts.experts, "topk": opts.topk}
    out = H.Results(opts.out, settings)
    if opts.from_json:
        out.rewrite(render, plot)
        return
    size = dict(vocab=QUICK["vocab"], max_mb=QUICK["corpus_mb"]) if opts.quick else {}
    data, tok = demo_corpus(opts.cache_dir, **size)
    def run(argvs: list[list[str]]) -> list[dict]:
        return run_distributed(_worker, 4, (argvs, model["hidden"]), env={"OMP_NUM_THREADS": "1"},
                               timeout=6 * 3600)[-1]

    # the two MoE arms (bf16 and Squinch gradients, acceptance 3.2) at every seed first, then the dense baseline
    order = sorted(VARIANTS, key=lambda name: name == "dense")
    keys = [(name, seed) for name in order for seed in opts.seeds]
    runs = {}
    if opts.quick:  # every variant in one set of ranks
        runs = dict(zip((f"{n}@{s}" for n, s in keys), run([_argv(n, model, opts, data, tok, s) for n, s in keys])))
    for name, seed in keys:
        argv = _argv(name, model, opts, data, tok, seed)
        runs[f"{name}@{seed}"] = runs.get(f"{name}@{seed}") or out.row(f"{name}@{seed}", lambda a=argv: _timed(run, a))
    wall = sum(r.get("wall_s", 0.0) for r in runs.values()) if not opts.quick else time.perf_counter() - start
    out.write({**settings, "seeds": opts.seeds, "wall_s": round(wall, 1), "variants": list(VARIANTS), "name": "moe",
               "runs": runs}, render, plot, record_machine=True)


if __name__ == "__main__":
    main()

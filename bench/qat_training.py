"""QAT training: the small GPT on the demo corpus in bf16, int8 QAT (dynamic and static clamps) and FP8 QAT.

    python bench/qat_training.py [--iters 150] [--cache-dir /tmp/megatron_cai_bench/qat_training]

Data: tools/make_demo_corpus.py -> tools/train_tokenizer.py -> tools/preprocess_data.py, built once into
``--cache-dir`` (not committed). Every configuration trains the same model from the same initialisation
on the same batches through ``pretrain_gpt.py``'s training path, under bf16 autocast (fp32 master
weights), each in its own process:

- ``bf16``: no quantization (the reference);
- ``int8 weight-rms`` / ``int8 rms``: int8 GEMM inputs with dynamic clamping (activations:
  c = alpha * RMS predicted from the weights, or measured; weights: per-row absmax);
- ``int8 static``: the activation clamps calibrated once, at initialisation (the first batch's absmax,
  the way a user would pick them) and then fixed;
- ``fp8 weight-rms``: FP8 E4M3 GEMM inputs with dynamic clamping, E5M2 output gradients (hybrid).

Reports the final validation loss (a fixed set of validation batches) of each, its ratio to bf16,
and, for the fc2 inputs (the ReLU^2 activations, where the static clamp fails), how the activation's
RMS drifted from initialisation and what the clamp did at the end (c / RMS, values zeroed, clipped).
Writes bench/results/qat_training.{json,md,png}; ``--quick`` trains every configuration for 4 iterations
of a toy model, in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import harness as H
from harness import training
from harness.data import QUICK, demo_corpus

CONFIGS = {
    "bf16": [],
    "int8 weight-rms": ["--qat", "int8", "--qat-clamp", "weight-rms"],
    "int8 rms": ["--qat", "int8", "--qat-clamp", "rms"],
    "int8 static": ["--qat", "int8", "--qat-clamp", "static"],
    "fp8 weight-rms": ["--qat", "fp8", "--fp8-format", "hybrid", "--qat-clamp", "weight-rms"],
}
DYNAMIC = ("int8 weight-rms", "int8 rms", "fp8 weight-rms")


def training_argv(opts, data: str, tok: str) -> list[str]:
    return ["--squared-relu",
            "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads",
            str(opts.heads), "--seq-length", str(opts.seq), "--max-position-embeddings", str(opts.seq),
            "--micro-batch-size", str(opts.batch), "--global-batch-size", str(opts.batch),
            "--train-iters", str(opts.iters), "--lr", str(opts.lr), "--min-lr", str(opts.lr / 10),
            "--lr-warmup-iters", str(opts.iters // 10), "--weight-decay", "0.1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--bf16", "--seed", str(opts.seed), "--data-path", data,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok, "--split", "949,50,1",
            "--data-cache-path", os.path.join(opts.cache_dir, "index"), "--eval-interval", str(opts.eval_interval),
            "--eval-iters", str(opts.eval_iters), "--log-interval", str(opts.iters), "--device", "cpu",
            "--make-vocab-size-divisible-by", "128", "--no-exit-signal-handler",
            "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]


# ------------------------------------------------------------------------------------------ one run

def _fc2_probe(trainer, record: dict):
    """Wrap the fc2 quantizers so that, while ``record['on']``, each forward logs its input's statistics."""
    import torch

    from megatron_cai.core.quantization import expand_clamp, fake_quant_with_clamp, quantization_error_stats

    layers = {}
    for name, mod in trainer.model[0].module.named_modules():
        if name.endswith("mlp.linear_fc2") and mod.gemm_quantizer is not None:
            layers[name] = mod.gemm_quantizer
    for name, q in layers.items():
        original = q.input_clamp

        def input_clamp(x, predicted_input_rms=None, name=name, q=q, original=original):
            c, rule = original(x, predicted_input_rms)
            if record["on"] and name not in record["now"]:
                with torch.no_grad():
                    cfg = q.config
                    xq = fake_quant_with_clamp(x, cfg.operand_fmt, c, granularity=cfg.granularity)
                    s = quantization_error_stats(x, xq, expand_clamp(c, x, cfg.granularity))
                    rms = float(x.float().pow(2).mean().sqrt())
                    record["now"][name] = {"rms": rms, "c_over_rms": float(c.float().mean()) / rms, **s}
            return c, rule

        q.input_clamp = input_clamp
    return layers


def run_one(name: str, opts, data: str, tok: str) -> dict:
    trainer = training.build_trainer(training_argv(opts, data, tok) + CONFIGS[name])
    record = {"on": False, "now": {}}
    has_probe = bool(_fc2_probe(trainer, record))
    valid, probes = [], []
    evaluate = trainer.evaluate

    def evaluate_and_record(iterator=None) -> dict:
        if iterator is not None:  # the end-of-run evaluation on the validation and test sets: not a curve point
            return evaluate(iterator)
        trainer.valid_iter = training.loader(trainer, trainer.valid_ds)  # the same batches at every evaluation
        record["on"], record["now"] = has_probe, {}
        out = evaluate()
        record["on"] = False
        valid.append((trainer.state.iteration, out["lm loss"]))
        if has_probe:
            probes.append((trainer.state.iteration, record["now"]))
        return out

    trainer.evaluate = evaluate_and_record
    evaluate_and_record()  # iteration 0, at initialisation: a static clamp calibrates on this first batch
    start = time.time()
    state = trainer.train()
    seconds = time.time() - start
    # Final validation loss on a fixed set of batches (the same for every configuration).
    trainer.config.logging.eval_iters = opts.final_eval_iters
    trainer.valid_iter = training.loader(trainer, trainer.valid_ds)
    final = evaluate()["lm loss"]
    return {"name": name, "final_valid_loss": final, "valid_curve": valid, "fc2_probes": probes,
            "train_loss": [h["lm loss"] for h in state.extra["history"]], "seconds": seconds,
            "static_c": {n: float(m.input_static_c) for n, m in trainer.model[0].module.named_modules()
                         if hasattr(m, "input_static_c") and "linear_fc2" in n}}


# ------------------------------------------------------------------------------------------ report

def _fc2_summary(run: dict) -> dict:
    """Mean over layers of the fc2-input statistics at the first and the last evaluation."""
    if not run["fc2_probes"]:
        return {}
    first, last = run["fc2_probes"][0][1], run["fc2_probes"][-1][1]

    def mean(probe: dict, key: str) -> float:
        return sum(p[key] for p in probe.values()) / len(probe)

    return {"rms_growth": mean(last, "rms") / mean(first, "rms"), "c_over_rms_init": mean(first, "c_over_rms"),
            "c_over_rms_end": mean(last, "c_over_rms"), "zeroed_end": mean(last, "zeroed"),
            "clipped_end": mean(last, "clipped"), "rel_rmse_end": mean(last, "rel_rmse")}


def report(payload: dict) -> str:
    runs, opts = payload["runs"], argparse.Namespace(**payload["settings"])
    ref = runs["bf16"]["final_valid_loss"] if "bf16" in runs else None
    lines = ["# QAT training: bf16 vs int8 / FP8 fake-quantized GEMMs", "",
             f"`python bench/qat_training.py` — GPT {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads, "
             f"ReLU^2 FFN, seq {opts.seq}, batch {opts.batch}, {opts.iters} iterations (lr {opts.lr:g} cosine, "
             f"weight decay 0.1), bf16 autocast, on the demo corpus (Python stdlib source, vocab {opts.vocab}); "
             f"same initialisation and batches for every run. Final validation loss over {opts.final_eval_iters} "
             f"fixed validation batches. The LM head stays in bf16; every other GEMM quantizes both inputs "
             f"(weights: per-row absmax).", "",
             "fc2 input (ReLU^2 output), mean over layers: RMS growth from initialisation to the end, the clamp "
             "in units of the activation RMS (init -> end), and at the end the fraction of non-zero values "
             "quantized to zero, the fraction clipped, and the relative RMSE of the quantized activation.", "",
             "| run | final valid loss | ratio to bf16 | fc2-input RMS growth | fc2 c/RMS init -> end | zeroed | "
             "clipped | rel RMSE | time (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        ratio = run["final_valid_loss"] / ref if ref else float("nan")
        s = run.get("fc2", {})
        fc2 = "- | - | - | - | -"
        if s:
            fc2 = (f"{s['rms_growth']:.2f}x | {s['c_over_rms_init']:.1f} -> {s['c_over_rms_end']:.1f} | "
                   f"{s['zeroed_end']:.2%} | {s['clipped_end']:.3%} | {s['rel_rmse_end']:.4f}")
        lines.append(f"| {name} | {run['final_valid_loss']:.4f} | {ratio:.4f} | {fc2} | {run['seconds']:.0f} |")
    if ref:
        lines += ["", "Goal: int8 and FP8 with dynamic clamping within 2% of the bf16 validation loss: "
                  + ", ".join(f"{n} {runs[n]['final_valid_loss'] / ref - 1:+.2%}" for n in DYNAMIC if n in runs)
                  + "."]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    colors = dict(zip(CONFIGS, ("black", "tab:blue", "tab:green", "tab:red", "tab:purple")))
    ref = dict(runs["bf16"]["valid_curve"]) if "bf16" in runs else None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, run in runs.items():
        it, loss = zip(*run["valid_curve"])
        axes[0].plot(it, loss, marker=".", label=name, color=colors[name])
        if ref:
            axes[1].plot(it[1:], [100 * (v / ref[i] - 1) for i, v in zip(it[1:], loss[1:])], marker=".",
                         label=name, color=colors[name])
        if run["fc2_probes"]:
            its = [i for i, _ in run["fc2_probes"]]
            ratio = [sum(p["c_over_rms"] for p in probe.values()) / len(probe) for _, probe in run["fc2_probes"]]
            axes[2].plot(its, ratio, marker=".", label=name, color=colors[name])
    axes[0].set(title="validation loss", xlabel="iteration", ylabel="loss")
    axes[1].set(title="validation loss vs bf16 (%)", xlabel="iteration", ylabel="%")
    axes[2].set(title="fc2 input (ReLU^2): clamp c / RMS, mean over layers", xlabel="iteration", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lo = min(min(loss for _, loss in run["valid_curve"][1:]) for run in runs.values())
    axes[0].set_ylim(lo - 0.1, lo + 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def one_process(name: str, opts, argv: list[str]) -> dict:
    """One configuration in a process of its own (its threads, its memory), through ``--_run``."""
    path = os.path.join(opts.cache_dir, f"run_{name.replace(' ', '_')}.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--_run", name, "--_json", path],
                   cwd=H.ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "qat_training")
    H.add(p, iters=150, layers=4, hidden=128, heads=4, seq=128, batch=8, lr=2e-3, vocab=2048, corpus_mb=3.0,
          seed=1234, eval_interval=25, eval_iters=4, final_eval_iters=16)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--_run", default=None, help=argparse.SUPPRESS)  # internal: one configuration
    p.add_argument("--_json", default=None, help=argparse.SUPPRESS)
    opts = H.parse(p, argv, quick=dict(iters=4, layers=1, hidden=32, heads=2, seq=32, batch=2, eval_interval=2,
                                       eval_iters=1, final_eval_iters=1, vocab=QUICK["vocab"],
                                       corpus_mb=QUICK["corpus_mb"]))
    settings = {k: v for k, v in vars(opts).items() if not k.startswith("_") and k not in ("from_json", "bench")}
    out = H.Results(opts.out, settings)
    if opts.from_json:
        out.rewrite(report, plot)
        return
    data, tok = demo_corpus(opts.cache_dir, opts.vocab, opts.corpus_mb)
    if opts._run:
        import torch

        torch.set_num_threads(int(os.environ.get("QAT_BENCH_THREADS", "2")))
        with open(opts._json, "w") as f:
            json.dump(run_one(opts._run, opts, data, tok), f)
        return
    passthrough = list(argv if argv is not None else sys.argv[1:])
    runs = {}
    for name in opts.configs:
        t = time.time()
        runs[name] = out.row(name, lambda name=name: run_one(name, opts, data, tok) if opts.quick
                             else one_process(name, opts, passthrough))
        runs[name]["fc2"] = _fc2_summary(runs[name])
        print(f"{name}: final valid loss {runs[name]['final_valid_loss']:.4f} ({time.time() - t:.0f} s)",
              flush=True)
    out.write({"settings": settings, "runs": runs}, report, plot, record_machine=False)


if __name__ == "__main__":
    main()

"""Dynamic clamping vs a static clamp on the activations of a ReLU^2 FFN whose weights shrink.

    python bench/qat_clamp.py [--tokens 4096] [--hidden 256] [--ffn 1024] [--seed 0]

An RMS-normalised Gaussian input (RMSNorm with weight g ~ U(0.8, 1.2)) goes through fc1 (hidden -> ffn,
init std 0.02) and relu^2; fc1's weight is scaled by 1, 0.1 and 0.01 (weight decay / muP multipliers
shrinking it). The fc2 input h = relu(fc1(x))^2 is fake-quantized to int8 and FP8 E4M3 under each clamp
rule:

- ``absmax`` (per tensor and per row), ``rms`` (alpha * RMS(h), per tensor and per row),
- ``static``: c fixed to the absmax of a calibration batch at weight scale 1 (a typical calibrated value),
- ``weight-rms``: c = alpha * RMS predicted from fc1's weight and the norm weight alone
  (``predict_relu2_ffn_rms``), with no reduction over h;

and reports the fraction of non-zero values that become zero, the fraction clipped (|h| > c) and the
relative RMSE ||h_q - h|| / ||h||. A second table sweeps alpha for the rms rule on the ReLU^2 output and
on a Gaussian (post-norm) GEMM input, which is where dynamic_clamp.DEFAULT_ALPHA comes from.
Writes bench/results/qat_clamp.{json,md}; ``--quick``: 256 tokens, hidden 32, ffn 128.
"""
from __future__ import annotations

import argparse

import harness as H
import torch

from megatron_cai.core.quantization import (
    DEFAULT_ALPHA,
    compute_clamp,
    default_alpha,
    expand_clamp,
    fake_quant_with_clamp,
    post_norm_rms,
    predict_relu2_ffn_rms,
    quantization_error_stats,
)

SCALES = (1.0, 0.1, 0.01)
FORMATS = ("int8", "fp8_e4m3")
RULES = (("absmax", "tensor"), ("absmax", "row"), ("static", "tensor"), ("rms", "tensor"), ("rms", "row"),
         ("weight-rms", "tensor"))
SWEEP_ALPHAS = (2, 4, 6, 8, 12, 16, 24, 32, 64, 128)


def rms_norm_input(tokens: int, hidden: int, g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, hidden, generator=gen) * 3.0 + 0.5
    return g * x / x.pow(2).mean(-1, keepdim=True).sqrt()


def measure(h: torch.Tensor, fmt: str, rule: str, gran: str, *, static: float, predicted: torch.Tensor,
            alpha: float | None = None) -> dict:
    c = compute_clamp(h, rule, granularity=gran, alpha=alpha, static_value=static, predicted_rms=predicted,
                      fmt=fmt)
    hq = fake_quant_with_clamp(h, fmt, c, granularity=gran)
    stats = quantization_error_stats(h, hq, expand_clamp(c, h, gran))
    stats["c_over_rms"] = float(c.float().mean() / h.pow(2).mean().sqrt())
    return stats


def run(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    g = 0.8 + 0.4 * torch.rand(args.hidden, generator=gen)
    w1 = torch.randn(args.ffn, args.hidden, generator=gen) * 0.02
    x = rms_norm_input(args.tokens, args.hidden, g, gen)
    x_calib = rms_norm_input(args.tokens, args.hidden, g, gen)
    static = float((torch.relu(x_calib @ w1.T) ** 2).abs().max())  # calibrated once, at scale 1

    rows, predictions = [], []
    for scale in SCALES:
        w = w1 * scale
        h = torch.relu(x @ w.T) ** 2
        predicted = predict_relu2_ffn_rms(w, post_norm_rms(g))
        measured = float(h.pow(2).mean().sqrt())
        predictions.append({"scale": scale, "measured_rms": measured, "predicted_rms": float(predicted),
                            "ratio": float(predicted) / measured})
        for fmt in FORMATS:
            for rule, gran in RULES:
                s = measure(h, fmt, rule, gran, static=static, predicted=predicted)
                alpha = default_alpha(fmt, rule) if rule != "static" else None
                rows.append({"fmt": fmt, "scale": scale, "rule": rule, "granularity": gran, "alpha": alpha, **s})

    # alpha sweep for the rms rule (per tensor): ReLU^2 output vs Gaussian post-norm GEMM input
    h1 = torch.relu(x @ w1.T) ** 2
    sweep = []
    for name, t in (("relu2", h1), ("gaussian", x)):
        for fmt in FORMATS:
            for a in SWEEP_ALPHAS:
                s = measure(t, fmt, "rms", "tensor", static=static, predicted=None, alpha=float(a))
                sweep.append({"input": name, "fmt": fmt, "alpha": a, **s})
            s = measure(t, fmt, "absmax", "tensor", static=static, predicted=None)
            sweep.append({"input": name, "fmt": fmt, "alpha": "absmax", **s})
    return {"config": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "init_std": 0.02,
                       "seed": args.seed, "static_c": static, "default_alpha": DEFAULT_ALPHA},
            "predictions": predictions, "rows": rows, "alpha_sweep": sweep}


def pct(v: float) -> str:
    return f"{100 * v:.2f}%" if v >= 1e-4 or v == 0 else f"{100 * v:.4f}%"


def to_markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        "# Dynamic vs static clamping on ReLU^2 FFN activations",
        "",
        f"`python bench/qat_clamp.py` — {cfg['tokens']} tokens, RMSNorm'd Gaussian input (hidden "
        f"{cfg['hidden']}) -> fc1 (ffn {cfg['ffn']}, init std {cfg['init_std']}, weight x scale) -> relu^2; the "
        f"fc2 input is quantized. Static c = {cfg['static_c']:.3f} (absmax of a calibration batch at scale 1). "
        f"alpha: int8 {cfg['default_alpha']['int8']:g}, fp8 {cfg['default_alpha']['fp8']:g} (rms, weight-rms).",
        "",
        "zeroed: non-zero values that quantize to 0; clipped: |h| > c; rel RMSE: ||h_q - h|| / ||h||; "
        "c/RMS: the clamp in units of the activation's RMS.",
        "",
        "| format | fc1 weight scale | clamp | granularity | c/RMS | zeroed | clipped | rel RMSE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['fmt']} | {r['scale']:g} | {r['rule']} | {r['granularity']} | {r['c_over_rms']:.1f} | "
                     f"{pct(r['zeroed'])} | {pct(r['clipped'])} | {r['rel_rmse']:.4f} |")
    lines += ["", "## Summary: rel RMSE (zeroed) per weight scale, per-tensor clamps", "",
              "| format | clamp | " + " | ".join(f"scale {s:g}" for s in SCALES) + " |",
              "|---|---|" + "---|" * len(SCALES)]
    for fmt in FORMATS:
        for rule in ("absmax", "static", "rms", "weight-rms"):
            cells = []
            for s in SCALES:
                r = next(r for r in res["rows"] if r["fmt"] == fmt and r["rule"] == rule
                         and r["granularity"] == "tensor" and r["scale"] == s)
                cells.append(f"{r['rel_rmse']:.4f} ({pct(r['zeroed'])})")
            lines.append(f"| {fmt} | {rule} | " + " | ".join(cells) + " |")
    lines += ["", "## Weight-RMS prediction of RMS(relu(fc1(x))^2), from the fc1 and norm weights only", "",
              "| fc1 weight scale | measured RMS | predicted RMS | predicted / measured |", "|---|---|---|---|"]
    for p in res["predictions"]:
        lines.append(f"| {p['scale']:g} | {p['measured_rms']:.4e} | {p['predicted_rms']:.4e} | {p['ratio']:.4f} |")
    lines += ["", "## alpha sweep (rms rule, per tensor): rel RMSE (clipped)", "",
              "| input | format | " + " | ".join(str(a) for a in SWEEP_ALPHAS) + " | absmax |",
              "|---|---|" + "---|" * (len(SWEEP_ALPHAS) + 1)]
    for name in ("relu2", "gaussian"):
        for fmt in FORMATS:
            cells = [f"{r['rel_rmse']:.4f} ({pct(r['clipped'])})" for r in res["alpha_sweep"]
                     if r["input"] == name and r["fmt"] == fmt]
            lines.append(f"| {name} | {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "qat_clamp")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    H.add(p, seed=0)
    args = H.parse(p, argv, quick=dict(tokens=256, hidden=32, ffn=128))
    out = H.Results(args.out)
    if args.from_json:
        out.rewrite(to_markdown)
        return
    torch.set_num_threads(min(2, torch.get_num_threads()))
    out.write(run(args), to_markdown, record_machine=False)


if __name__ == "__main__":
    main()

"""Real-GEMM QAT paths on the GPU: ``quantized_linear`` (int8 ``_int_mm`` / FP8 ``_scaled_mm``) against
its fake-quant reference ``F.linear(fake_quant(x), fake_quant(w))`` (max relative error, forward and
backward) and against a bf16 ``F.linear`` (time ratio); Transformer Engine's FP8 ``Linear`` when it is
installed. The dry run uses the CPU ops where this torch build has them and records the rest as skipped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Budget, StepResults, environment, parser, pick_device, time_fn

from megatron_cai.core.quantization import gemm_backends as gb
from megatron_cai.core.quantization.dynamic_clamp import compute_clamp
from megatron_cai.core.quantization.fake_quant import fake_quant_with_clamp


def check_format(fmt: str, m: int, k: int, n: int, device: torch.device, reps: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(m + n)
    x = torch.randn(m, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    cx = compute_clamp(x, "absmax", granularity="tensor", fmt=fmt)
    cw = compute_clamp(w, "absmax", granularity="row", fmt=fmt)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = F.linear(fake_quant_with_clamp(xr, fmt, cx), fake_quant_with_clamp(wr, fmt, cw, granularity="row"))
    gy = torch.randn_like(ref)
    ref.backward(gy)
    xq, wq = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = gb.quantized_linear(xq, cx, wq, cw, fmt, x_granularity="tensor", w_granularity="row")
    out.backward(gy)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()

    row = {"path": f"quantized_linear {fmt}", "shape": f"{m}x{k}x{n}", "fwd_rel_err": rel(out, ref),
           "dx_rel_err": rel(xq.grad, xr.grad), "dw_rel_err": rel(wq.grad, wr.grad)}
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    t_q = time_fn(lambda: gb.quantized_linear(x, cx, w, cw, fmt, x_granularity="tensor", w_granularity="row"),
                  device, reps)
    t_b = time_fn(lambda: F.linear(xb, wb), device, reps)
    row.update(fwd_ms=t_q["median_s"] * 1e3, bf16_linear_ms=t_b["median_s"] * 1e3,
               bf16_time_ratio=t_b["median_s"] / t_q["median_s"])
    return row


def check_te(m: int, k: int, n: int, device: torch.device, reps: int) -> dict:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)
    cache: dict = {}
    with gb.te_fp8_autocast(True):
        out = gb.te_linear(x, w, cache)
    ref = F.linear(x.float(), w.float())
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()

    def run():
        with gb.te_fp8_autocast(True):
            gb.te_linear(x, w, cache)

    t = time_fn(run, device, reps)
    tb = time_fn(lambda: F.linear(x, w), device, reps)
    return {"path": "transformer_engine fp8 Linear", "shape": f"{m}x{k}x{n}", "fwd_rel_err": err,
            "fwd_ms": t["median_s"] * 1e3, "bf16_linear_ms": tb["median_s"] * 1e3,
            "bf16_time_ratio": tb["median_s"] / t["median_s"]}


# The time a row needs left to start, on the GPU (an 8k x 4k x 4k GEMM path: fake-quant reference forward and
# backward, the real path, 10 timed calls each of it and of bf16; ~4 s) and in the dry run (toy sizes).
ROW_NEED_S = {"int8": 8.0, "fp8_e4m3": 8.0, "transformer_engine": 8.0}
DRY_RUN_ROW_NEED_S = 1.0

COLUMNS = ["path", "shape", "fwd_rel_err", "dx_rel_err", "dw_rel_err", "fwd_ms", "bf16_linear_ms", "bf16_time_ratio",
           "error"]


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_qat", 40).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    m, k, n = (64, 128, 96) if args.dry_run else (8192, 4096, 4096)
    reps = 1 if args.dry_run else 10
    res = StepResults(args.out, "Real-GEMM QAT paths (int8 / FP8 / Transformer Engine)", COLUMNS,
                      dry_run=args.dry_run, environment=environment(device))
    bad = False
    for fmt in ("int8", "fp8_e4m3"):
        if not gb.real_gemm_available(fmt, device, require_gpu=not args.dry_run):
            res.add({"path": f"quantized_linear {fmt}", "error": f"no real {fmt} GEMM on {device}"})
        elif not budget.allows(DRY_RUN_ROW_NEED_S if args.dry_run else ROW_NEED_S[fmt]):
            res.skip(fmt)
        else:
            row = res.add(check_format(fmt, m, k, n, device, reps))
            bad = bad or row["fwd_rel_err"] > 0.05
    if not gb.transformer_engine_available():
        res.add({"path": "transformer_engine fp8 Linear", "error": "Transformer Engine not installed"})
    elif device.type == "cuda" and budget.allows(ROW_NEED_S["transformer_engine"]):
        res.add(check_te(m, k, n, device, reps))
    return res.finish(not bad)


if __name__ == "__main__":
    raise SystemExit(main())

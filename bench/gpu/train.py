"""Training throughput on the GPU: a ~350M-parameter GPT (24 layers, hidden 1024, 16 heads, seq 2048),
bf16 autocast, AdamW, for each attention backend. Reports tokens/s and MFU = model FLOPs per token x
tokens/s / the GPU's peak dense bf16 FLOP/s (6 x parameters + 6 x layers x seq x hidden per token for
causal attention, forward + backward).
"""
from __future__ import annotations

import time

import torch
from common import Budget, environment, markdown_table, parser, pick_device, write_results

from megatron_cai.core import device as dev
from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel

# Peak dense bf16 tensor-core FLOP/s by device-name fragment (first match).
PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12,
             "A10": 125e12, "4090": 165e12}


def peak_flops(name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def run_backend(backend: str, cfg: GPTConfig, device: torch.device, steps: int, warmup: int, mbs: int,
                use_bf16: bool) -> dict:
    model = GPTModel(GPTConfig(**{**cfg.to_dict(), "attention_backend": backend})).to(device)
    model.initialize(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **({"fused": True} if
                            device.type == "cuda" else {}))
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length + 1), generator=g).to(device)
    pos = torch.arange(cfg.seq_length, device=device).expand(mbs, -1)
    losses, t_start = [], None
    for step in range(steps):
        if step == warmup:
            dev.synchronize(device)
            t_start = time.perf_counter()
        with dev.autocast(device, use_bf16):
            loss = model(tokens[:, :-1], pos, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    dev.synchronize(device)
    seconds = time.perf_counter() - t_start
    n_params = sum(p.numel() for p in model.parameters())
    return {"backend": backend, "params_M": n_params / 1e6, "steps_timed": steps - warmup,
            "tokens_per_s": (steps - warmup) * mbs * cfg.seq_length / seconds,
            "first_loss": losses[0].item(), "last_loss": losses[-1].item(),
            "peak_mem_GiB": dev.max_memory_allocated(device) / 2**30, "n_params": n_params}


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "gpu_train", 160)
    p.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s (default: by GPU name)")
    args = p.parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    ps.initialize_model_parallel()
    if args.dry_run:
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=128, seq_length=64,
                        hidden_dropout=0.0, attention_dropout=0.0)
        steps, warmup, mbs, backends = 3, 1, 1, ["triton", "blocked"]
    else:
        cfg = GPTConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=32768,
                        seq_length=2048, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                        activation="swiglu", ffn_hidden_size=2816, add_bias_linear=False)
        steps, warmup, mbs, backends = 50, 5, 4, ["triton", "flex", "eager"]
    peak = None if args.dry_run else peak_flops(dev.device_name(device), args.peak_tflops)
    rows = []
    for backend in backends:
        if not budget.allows(backend, 5.0 if args.dry_run else 40.0):
            continue
        try:
            r = run_backend(backend, cfg, device, steps, warmup, mbs, use_bf16=not args.dry_run)
        except Exception as e:  # recorded per backend (e.g. out of memory for eager)
            rows.append({"backend": backend, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        flops_per_token = 6 * r["n_params"] + 6 * cfg.num_layers * cfg.seq_length * cfg.hidden_size
        r["TFLOPs_per_s"] = flops_per_token * r["tokens_per_s"] / 1e12
        r["MFU"] = flops_per_token * r["tokens_per_s"] / peak if peak else None
        rows.append(r)
        dev.synchronize(device)
    payload = {"environment": environment(device), "dry_run": args.dry_run, "config": cfg.to_dict(),
               "micro_batch": mbs, "steps": steps, "warmup_steps": warmup, "peak_flops": peak, "rows": rows,
               "skipped": budget.skipped}
    table = markdown_table(rows, ["backend", "params_M", "tokens_per_s", "TFLOPs_per_s", "MFU", "first_loss",
                                  "last_loss", "peak_mem_GiB", "error"])
    write_results(args.out, "GPT training throughput per attention backend", payload, table)
    ours = [r for r in rows if r["backend"] == "triton"]
    return 0 if ours and "error" not in ours[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())

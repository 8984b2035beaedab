#!/usr/bin/env python
"""Squinch v1 codec: bits per element, error vs other gradient formats, and codec throughput.

    python bench/squinch_codec.py [--quick] [--numel 800000] [--grad-steps 10] [--throughput-numel 16777216]

Writes bench/results/squinch_codec.{json,md,png}. Sections:
1. bits per element of the payload (6.0 exactly for numel divisible by 8);
2. error table: relative L2 error, relative L2 error per magnitude decile (of the non-zero |x|) and the
   fraction of non-zero values decoded to zero, for Squinch (deterministic / stochastic), bf16, fp8 e4m3
   with one per-tensor scale, int8 absmax per 32 and int4 absmax per 64 (ZeRO++ qgZ class, fp32 scales),
   on Gaussian, Laplace and Student-t(3) data and on real gradients of this repo's GPT model trained a few
   steps on the demo corpus (capture_real_gradients);
3. CPU throughput (torch reference and C fast path, same run): GB/s of input read and the ratio to the
   read bandwidth of a plain tensor copy, plus time relative to copying the fp32 tensor of the same numel;
4. the same for the Triton kernels against a device copy, only where CUDA is available.
"""
from __future__ import annotations

import importlib.util
import math
import os
import platform
import time

import harness as H
import torch

from megatron_cai.core import squinch
from megatron_cai.core.squinch import cpu_kernels

ROOT = H.ROOT


# ---- formats compared ----------------------------------------------------------------------------------
def _absmax_groups(x: torch.Tensor, group: int, qmax: int) -> torch.Tensor:
    n = x.numel()
    pad = (-n) % group
    g = torch.cat([x, x.new_zeros(pad)]).view(-1, group)
    scale = g.abs().amax(dim=1, keepdim=True) / qmax
    q = torch.where(scale > 0, torch.round(g / torch.where(scale > 0, scale, 1.0)), 0.0).clamp_(-qmax, qmax)
    return (q * scale).reshape(-1)[:n]


def fp8_e4m3_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().max() / 448.0
    if scale == 0:
        return torch.zeros_like(x)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


FORMATS = {
    # name: (bits per element, round trip)
    "squinch (deterministic)": (6.0, lambda x: squinch.decode(squinch.encode(x), x.numel())),
    "squinch (stochastic)": (6.0, lambda x: squinch.decode(
        squinch.encode(x, stochastic=True, generator=torch.Generator().manual_seed(0)), x.numel())),
    "bf16": (16.0, lambda x: x.bfloat16().float()),
    "fp8 e4m3, per-tensor scale": (8.0, fp8_e4m3_per_tensor),
    "int8 absmax / 32 (fp32 scale)": (9.0, lambda x: _absmax_groups(x, 32, 127)),
    "int4 absmax / 64 (fp32 scale)": (4.5, lambda x: _absmax_groups(x, 64, 7)),
}


def error_stats(x: torch.Tensor, xh: torch.Tensor) -> dict:
    """Relative L2 error, relative L2 error per |x| decile (non-zero x), fraction of non-zeros -> 0."""
    x, xh = x.double(), xh.double()
    rel = ((xh - x).norm() / x.norm()).item()
    nz = x != 0
    xs, xhs = x[nz], xh[nz]
    order = torch.argsort(xs.abs())
    deciles = []
    for chunk in torch.tensor_split(order, 10):
        deciles.append(((xhs[chunk] - xs[chunk]).norm() / xs[chunk].norm()).item())
    zeroed = ((xhs == 0).sum() / max(1, xs.numel())).item()
    return {"rel_l2": rel, "rel_l2_by_decile": deciles, "frac_nonzero_to_zero": zeroed}


def synthetic(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(n, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    laplace = -torch.sign(u) * torch.log1p(-2 * u.abs())
    chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).pow(2).sum(0)
    student = torch.randn(n, generator=g, dtype=torch.float64) / torch.sqrt(chi2 / 3)
    return {"Gaussian": gauss.float(), "Laplace": laplace.float(), "Student-t(3)": student.float()}


# ---- real gradients ------------------------------------------------------------------------------------
def _demo_corpus_bytes(max_bytes: int) -> bytes:
    """The demo corpus (tools/make_demo_corpus.py: the stdlib's own source files, MD5 order) as bytes."""
    spec = importlib.util.spec_from_file_location("make_demo_corpus", os.path.join(ROOT, "tools",
                                                                                   "make_demo_corpus.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = mod.stdlib_dir()
    out = bytearray()
    for rel in mod.list_source_files(root, 256):
        for rec in mod.file_records(root, rel):
            out += rec["text"].encode("utf-8") + b"\0"
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def capture_real_gradients(steps: int = 10, capture_at: tuple[int, ...] = (1, 10), seed: int = 0,
                           micro_batch: int = 8, seq_length: int = 256, layers: int = 4,
                           hidden: int = 256) -> dict[str, torch.Tensor]:
    """Train this repo's GPT model (4 layers, hidden 256, byte-level tokens of the demo corpus) with AdamW
    for `steps` steps on CPU and return the flat fp32 gradient (all parameters, bucket order) at the
    steps in `capture_at` (1-based), keyed "GPT grads, step k"."""
    try:
        from megatron_cai.core import parallel_state as ps
        from megatron_cai.core.models.gpt.config import GPTConfig
        from megatron_cai.core.models.gpt.model import GPTModel
    except ImportError as e:
        raise RuntimeError(f"capture_real_gradients: the GPT model package is not importable ({e})") from e
    data = torch.frombuffer(bytearray(_demo_corpus_bytes(2_000_000)), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    was_init = ps.model_parallel_is_initialized()
    if not was_init:
        ps.initialize_model_parallel()
    try:
        cfg = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
                        padded_vocab_size=256, seq_length=seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                        activation="relu2")
        model = GPTModel(cfg)
        model.initialize(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        pos = torch.arange(seq_length).expand(micro_batch, -1)
        grads = {}
        for step in range(1, steps + 1):
            starts = torch.randint(0, data.numel() - seq_length - 1, (micro_batch,), generator=g)
            window = torch.stack([data[s:s + seq_length + 1] for s in starts.tolist()])
            loss = model(window[:, :-1], pos, window[:, 1:]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if step in capture_at:
                grads[f"GPT grads, step {step}"] = torch.cat(
                    [p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])
                print(f"  captured step {step}: loss {loss.item():.3f}, {grads[f'GPT grads, step {step}'].numel()} "
                      "gradient elements", flush=True)
            opt.step()
        return grads
    finally:
        if not was_init:
            ps.destroy_model_parallel()


# ---- throughput ----------------------------------------------------------------------------------------
def _round_times(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Wall times per function over `rounds` interleaved rounds (one warm-up call each first)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm up (and build the C kernel)
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def _ops(n: int, backend: str, device: str, W: int) -> tuple[dict, dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device)
    r32 = torch.randn(n, generator=g, device=device) * 1e-3
    rbf = r32.bfloat16()
    xbf = x.bfloat16()
    payload = squinch.encode(x, backend=backend)
    P = torch.stack([squinch.encode(x * (w + 1), backend=backend) for w in range(W)])
    out = torch.zeros(n, device=device)
    pb = payload.numel()
    send = torch.empty_like(payload)  # a preallocated send buffer, as the gradient reducer uses
    fns = {
        "encode fp32": (lambda: squinch.encode(x, backend=backend, out=send), 4 * n),
        "encode bf16": (lambda: squinch.encode(xbf, backend=backend, out=send), 2 * n),
        "fused encode + feedback (fp32 grad, fp32 residual)": (
            lambda: squinch.encode_with_feedback(x, r32, backend=backend, out=send), 8 * n),
        "fused encode + feedback (fp32 grad, bf16 residual)": (
            lambda: squinch.encode_with_feedback(x, rbf, backend=backend, out=send), 6 * n),
        "decode": (lambda: squinch.decode(payload, n, out=out, backend=backend), pb),
        f"decode_accumulate W={W}": (lambda: squinch.decode_accumulate(P, out, backend=backend), W * pb + 4 * n),
    }
    return {k: v[0] for k, v in fns.items()}, {k: v[1] for k, v in fns.items()}


def cpu_throughput(n: int, rounds: int, W: int = 4) -> dict:
    """Best-of-rounds GB/s and two ratios to a plain fp32 copy timed in the same rounds: from the best
    times, and the median over rounds of the per-round ratio (robust when other jobs share the CPU)."""
    src, dst = torch.randn(n), torch.empty(n)
    res = {"numel": n, "threads": torch.get_num_threads(), "rows": []}
    backends = ["cpu", "torch"] if cpu_kernels.available() else ["torch"]
    for backend in backends:
        fns, nbytes = _ops(n, backend, "cpu", W)
        fns["copy"] = lambda: dst.copy_(src)
        times = _round_times(fns, rounds if backend == "cpu" else max(2, rounds // 10))
        copy_times = times.pop("copy")
        ct = min(copy_times)
        copy_gbps = 4 * n / ct / 1e9
        if backend == "cpu":
            res["copy_read_GBps"] = copy_gbps
        for op, ts in times.items():
            t = min(ts)
            gbps = nbytes[op] / t / 1e9
            per_round = sorted((nbytes[op] / to) / (4 * n / tc) for to, tc in zip(ts, copy_times))
            res["rows"].append({"backend": backend, "op": op, "seconds": t, "input_GBps": gbps,
                                "ratio_vs_copy_bandwidth": gbps / copy_gbps,
                                "ratio_vs_copy_bandwidth_median_round": per_round[len(per_round) // 2],
                                "fp32_copy_time_ratio": ct / t, "copy_read_GBps": copy_gbps})
    return res


def cpu_kernel_cost(n: int = 1 << 17, calls: int = 300, W: int = 4) -> dict | None:
    """One thread, cache-resident tensors, min over many short calls: the codec's compute cost per
    element next to a copy's, which a busy shared machine disturbs far less than the large-tensor run."""
    if not cpu_kernels.available():
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fns, nbytes = _ops(n, "cpu", "cpu", W)
        src, dst = torch.randn(n), torch.empty(n)
        fns["copy"] = lambda: dst.copy_(src)
        times = {k: min(v) for k, v in _round_times(fns, calls).items()}
    finally:
        torch.set_num_threads(threads)
    ct = times.pop("copy")
    rows = [{"op": op, "ns_per_element": t / n * 1e9, "input_GBps": nbytes[op] / t / 1e9,
             "ratio_vs_copy_bandwidth": (nbytes[op] / t) / (4 * n / ct)} for op, t in times.items()]
    return {"numel": n, "copy_ns_per_element": ct / n * 1e9, "copy_read_GBps": 4 * n / ct / 1e9, "rows": rows}


def gpu_throughput(n: int, reps: int = 20, W: int = 8) -> dict | None:
    if not torch.cuda.is_available():
        return None
    dev = "cuda"
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    fns, nbytes = _ops(n, "triton", dev, W)

    def timed(f) -> float:
        f()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = math.inf
        for _ in range(reps):
            start.record()
            f()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    ct = timed(lambda: dst.copy_(src))
    copy_gbps = 4 * n / ct / 1e9
    rows = []
    for op, f in fns.items():
        t = timed(f)
        gbps = nbytes[op] / t / 1e9
        rows.append({"backend": "triton", "op": op, "seconds": t, "input_GBps": gbps,
                     "ratio_vs_copy_bandwidth": gbps / copy_gbps, "fp32_copy_time_ratio": ct / t})
    return {"numel": n, "device": torch.cuda.get_device_name(), "copy_read_GBps": copy_gbps, "rows": rows}


# ---- report ----------------------------------------------------------------------------------------------
def _fmt(v: float) -> str:
    return f"{v:.2g}" if v < 0.01 else f"{v:.3f}"


def markdown(res: dict) -> str:
    lines = ["# Squinch v1 codec benchmark", "",
             f"Host: {res['host']}; torch {res['torch']}; {res['threads']} CPU threads; "
             f"load average at start {res['loadavg']}.", "",
             "## Bits per element", "", "| numel | payload bytes | bits / element |", "| --- | --- | --- |"]
    for b in res["bits"]:
        lines.append(f"| {b['numel']} | {b['bytes']} | {b['bits_per_element']:.4f} |")
    lines += ["", "## Round-trip error", "",
              "Relative L2 error ||x' - x|| / ||x||; D1..D10: the same within magnitude deciles of the non-zero "
              "|x| (D1 = smallest); 'to zero': fraction of non-zero values decoded to 0.", ""]
    for data, rows in res["errors"].items():
        lines += [f"### {data} ({res['error_numel'][data]} elements)", "",
                  "| format | bits/elem | rel. L2 | " + " | ".join(f"D{i}" for i in range(1, 11)) + " | to zero |",
                  "| --- " * 14 + "|"]
        for name, st in rows.items():
            dec = " | ".join(_fmt(v) for v in st["rel_l2_by_decile"])
            lines.append(f"| {name} | {FORMATS[name][0]:g} | {_fmt(st['rel_l2'])} | {dec} | "
                         f"{st['frac_nonzero_to_zero']:.4f} |")
        lines.append("")
    if res.get("real_gradients_note"):
        lines += [f"Real gradients: {res['real_gradients_note']}", ""]
    cpu = res["cpu_throughput"]
    lines += ["## CPU throughput", "",
              f"{cpu['numel']} elements, {cpu['threads']} threads, interleaved rounds. 'vs copy': GB/s of input "
              "read divided by the read bandwidth of a plain fp32 tensor copy timed in the same rounds (best "
              "times; and the median over rounds of the per-round ratio, which is robust to other jobs on a "
              f"shared machine; copy best {cpu['copy_read_GBps']:.1f} GB/s read). 'fp32-copy time / op time': "
              "the op against copying the fp32 tensor of the same numel once. Input read: encode x; fused: grad "
              "+ residual; decode: the payload; decode_accumulate: W payloads + out.", "",
              "| backend | op | input GB/s | vs copy (best) | vs copy (median round) | fp32-copy time / op time |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in cpu["rows"]:
        lines.append(f"| {r['backend']} | {r['op']} | {r['input_GBps']:.2f} | {r['ratio_vs_copy_bandwidth']:.3f} | "
                     f"{r['ratio_vs_copy_bandwidth_median_round']:.3f} | {r['fp32_copy_time_ratio']:.3f} |")
    kc = res.get("cpu_kernel_cost")
    if kc is not None:
        lines += ["", f"Kernel cost, 1 thread, {kc['numel']} elements (cache-resident), min of many calls; copy "
                  f"{kc['copy_ns_per_element']:.3f} ns/element ({kc['copy_read_GBps']:.1f} GB/s read):", "",
                  "| op | ns / element | input GB/s | vs copy |", "| --- | --- | --- | --- |"]
        for r in kc["rows"]:
            lines.append(f"| {r['op']} | {r['ns_per_element']:.3f} | {r['input_GBps']:.2f} | "
                         f"{r['ratio_vs_copy_bandwidth']:.3f} |")
    gpu = res.get("gpu_throughput")
    lines += ["", "## GPU throughput (Triton)", ""]
    if gpu is None:
        lines.append("Not measured: no CUDA device in this run (the section runs where CUDA exists).")
    else:
        lines += [f"{gpu['numel']} elements on {gpu['device']}; device copy {gpu['copy_read_GBps']:.0f} GB/s read.", "",
                  "| op | input GB/s | vs copy | fp32-copy time / op time |", "| --- | --- | --- | --- |"]
        for r in gpu["rows"]:
            lines.append(f"| {r['op']} | {r['input_GBps']:.1f} | {r['ratio_vs_copy_bandwidth']:.3f} | "
                         f"{r['fp32_copy_time_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def render(res: dict) -> str:
    """The report, with the figure that ``plot`` draws."""
    return markdown(res) + "\n![relative error by magnitude decile](squinch_codec.png)\n"


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    datasets = list(res["errors"])
    rows = -(-len(datasets) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.6 * rows), sharey=True, squeeze=False)
    axes = axes.reshape(-1)
    for ax in axes[len(datasets):]:
        ax.axis("off")
    for ax, data in zip(axes, datasets):
        for name, st in res["errors"][data].items():
            ax.semilogy(range(1, 11), st["rel_l2_by_decile"], marker="o", ms=3, label=name)
        ax.set_title(data, fontsize=9)
        ax.set_xlabel("|x| decile (1 = smallest)")
        ax.grid(alpha=0.3)
    for r in range(rows):
        axes[3 * r].set_ylabel("relative L2 error in decile")
    axes[len(datasets) - 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = H.parser(__doc__, "squinch_codec")
    ap.add_argument("--numel", type=int, default=800_000, help="elements per synthetic error dataset")
    ap.add_argument("--grad-steps", type=int, default=10, help="training steps before the last capture")
    ap.add_argument("--throughput-numel", type=int, default=1 << 24)
    H.add(ap, rounds=30)
    ap.add_argument("--gpu-numel", type=int, default=1 << 27)
    args = H.parse(ap, argv, quick=dict(numel=20_000, grad_steps=2, throughput_numel=1 << 16, rounds=2,
                                        gpu_numel=1 << 20))
    out = H.Results(args.out)
    if args.from_json:
        out.rewrite(render, plot)
        return
    res = {"host": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "loadavg": [round(v, 2) for v in os.getloadavg()],
           "cpu_fast_path": cpu_kernels.available()}
    res["bits"] = [{"numel": n, "bytes": squinch.payload_nbytes(n),
                    "bits_per_element": 8 * squinch.payload_nbytes(n) / n} for n in (8, 1 << 20, 1_000_000, 1_000_003)]
    datasets = synthetic(args.numel)
    try:
        print("capturing real gradients ...", flush=True)
        size = dict(layers=1, hidden=32, micro_batch=2, seq_length=32) if args.quick else {}
        datasets.update(capture_real_gradients(steps=args.grad_steps, capture_at=(1, args.grad_steps), **size))
        res["real_gradients_note"] = (f"GPT ({size.get('layers', 4)} layers, hidden {size.get('hidden', 256)}, byte "
                                      "tokens of the demo corpus), AdamW lr 1e-3, micro-batch "
                                      f"{size.get('micro_batch', 8)} x {size.get('seq_length', 256)}; all parameters' "
                                      f"gradients, flat, at steps 1 and {args.grad_steps}.")
    except Exception as e:  # the model package may be absent or changing
        res["real_gradients_note"] = f"skipped ({type(e).__name__}: {e})"
        print(f"NOTE: real-gradient rows skipped: {e}", flush=True)
    res["errors"], res["error_numel"] = {}, {}
    for data, x in datasets.items():
        res["error_numel"][data] = x.numel()
        res["errors"][data] = {name: error_stats(x, fn(x)) for name, (_, fn) in FORMATS.items()}
    print("measuring CPU throughput ...", flush=True)
    res["cpu_throughput"] = cpu_throughput(args.throughput_numel, args.rounds)
    res["cpu_kernel_cost"] = cpu_kernel_cost(n=1 << 12, calls=3) if args.quick else cpu_kernel_cost()
    res["gpu_throughput"] = gpu_throughput(args.gpu_numel)
    out.write(res, render, plot, record_machine=False)  # res["loadavg"]: the load at the start


if __name__ == "__main__":
    main()

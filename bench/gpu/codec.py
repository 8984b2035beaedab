"""Squinch codec on the GPU: fused Triton encode, encode with error feedback and decode-accumulate
against device-to-device copy bandwidth, payloads checked byte for byte against the torch reference.

Bandwidth counts the bytes each op must move (encode: read fp32 + write 0.75 B/elem; error feedback:
also read and write the fp32 residual; decode-accumulate of W rows: read W payloads + read/write fp32);
the copy reference is ``dst.copy_(src)`` (read + write). Ratio = op bandwidth / copy bandwidth.
"""
from __future__ import annotations

import torch
from common import Budget, environment, markdown_table, parser, pick_device, time_fn, write_results

from megatron_cai.core.squinch import codec, reference


def check_bytes(n: int, device: torch.device, world: int) -> dict:
    """Triton vs torch reference at n elements: payloads, residuals and decode-accumulate bit-identical."""
    g = torch.Generator(device="cpu").manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.logspace(-6, 2, n).roll(n // 3)).to(device)
    r0 = (torch.randn(n, generator=g) * 1e-3).to(device)
    p_tri = codec.encode(x, backend="triton")
    p_ref = codec.encode(x, backend="torch")
    r_tri, r_ref = r0.clone(), r0.clone()
    pe_tri, nf_tri = codec.encode_with_feedback(x, r_tri, backend="triton")
    pe_ref, nf_ref = codec.encode_with_feedback(x, r_ref, backend="torch")
    rows = torch.stack([p_tri] * world)
    acc_tri = torch.ones(n, device=device)
    acc_ref = acc_tri.clone()
    codec.decode_accumulate(rows, acc_tri, backend="triton")
    reference.decode_accumulate(rows, acc_ref)
    return {
        "payload_identical": bool(torch.equal(p_tri, p_ref)),
        "feedback_payload_identical": bool(torch.equal(pe_tri, pe_ref)),
        "residual_identical": bool(torch.equal(r_tri.view(torch.int32), r_ref.view(torch.int32))),
        "nonfinite_agree": bool(nf_tri.item() == nf_ref.item()),
        "decode_accumulate_identical": bool(torch.equal(acc_tri.view(torch.int32), acc_ref.view(torch.int32))),
    }


def bandwidth_rows(n: int, device: torch.device, reps: int, world: int) -> list[dict]:
    x = torch.randn(n, device=device)
    dst = torch.empty_like(x)
    res = torch.zeros_like(x)
    payload = codec.encode(x, backend="triton")
    rows_in = torch.stack([payload] * world)
    acc = torch.zeros_like(x)
    pbytes = payload.numel()
    ops = {
        "d2d copy": (lambda: dst.copy_(x), 8 * n),
        "encode": (lambda: codec.encode(x, backend="triton", out=payload), 4 * n + pbytes),
        "encode + error feedback": (lambda: codec.encode_with_feedback(x, res, backend="triton", out=payload),
                                    12 * n + pbytes),
        f"decode-accumulate (W={world})": (lambda: codec.decode_accumulate(rows_in, acc, backend="triton"),
                                           world * pbytes + 8 * n),
    }
    out = []
    for name, (fn, nbytes) in ops.items():
        t = time_fn(fn, device, reps)
        out.append({"elements": n, "op": name, "median_ms": t["median_s"] * 1e3, "spread_ms":
                    (t["max_s"] - t["min_s"]) * 1e3, "GBps": nbytes / t["median_s"] / 1e9})
    copy_bw = out[0]["GBps"]
    for r in out:
        r["ratio_vs_copy"] = r["GBps"] / copy_bw
    return out


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_codec", 50).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    sizes = [4100] if args.dry_run else [16 << 20, 64 << 20, 256 << 20]
    reps = 1 if args.dry_run else 20
    world = 8
    checks, rows = {}, []
    for n in sizes:
        if not budget.allows(f"{n} elements", 1.0 if args.dry_run else 8.0):
            continue
        checks[n] = check_bytes(min(n, 1 << 24), device, world)
        rows += bandwidth_rows(n, device, reps, world)
    ok = all(all(c.values()) for c in checks.values())
    ef = [r["ratio_vs_copy"] for r in rows if r["op"] == "encode + error feedback"]
    payload = {"environment": environment(device), "dry_run": args.dry_run, "rows": rows,
               "byte_checks": {str(k): v for k, v in checks.items()}, "all_identical": ok,
               "goal_encode_ef_ratio_min": min(ef) if ef else None, "skipped": budget.skipped}
    table = markdown_table(rows, ["elements", "op", "median_ms", "spread_ms", "GBps", "ratio_vs_copy"])
    table += f"\n\nByte-identical to the torch reference: {ok} ({checks})"
    write_results(args.out, "Squinch codec on the GPU vs copy bandwidth", payload, table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

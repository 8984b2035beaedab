"""The quickstart's closing summary, read from its logs: loss reduction, gradient bytes against bf16, a sample.

    python examples/quickstart_summary.py --data PREFIX --seq-length 256 --data-parallel 2 \
        --logs part1.log part2.log --sample sample.log [--seconds N]

- loss: the first and the last logged training ``lm loss`` (Megatron's log line), and the last validation loss;
- bytes: ``grad comm bytes`` of the log line is what one rank sent for gradient reduction in an iteration
  (Squinch: 6 bits per gradient plus a flag byte per row). A bf16 reduce-scatter of the same N gradients
  (``> number of parameters ...: N``) sends (DP - 1) / DP x 2 bytes x N per rank, an all-reduce twice that;
- packing: the corpus's documents per token (from its .idx), so how many documents a row holds on average;
- the sample that ``tools/generate.py`` wrote.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|")
LM_LOSS = re.compile(r"\| lm loss: ([0-9.Ee+-]+) \|")
GRAD_BYTES = re.compile(r"\| grad comm bytes: (\d+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")
PARAMS = re.compile(r"> number of parameters on .*: (\d+)\s*$")


def parse_logs(paths: list[str]) -> dict:
    """Training log lines (iteration, lm loss, grad comm bytes), validation losses and the parameter count."""
    train, valid, params = [], [], None
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                it, loss, nbytes = ITERATION.search(line), LM_LOSS.search(line), GRAD_BYTES.search(line)
                if it and loss:
                    train.append((int(it.group(1)), float(loss.group(1)), int(nbytes.group(1)) if nbytes else None))
                if m := VALID.search(line):
                    valid.append((int(m.group(1)), float(m.group(2))))
                if m := PARAMS.search(line):
                    params = int(m.group(1))
    if not train:
        raise SystemExit(f"error: no training log line with an lm loss in {', '.join(paths)}")
    return {"train": train, "valid": valid, "params": params}


def bf16_bytes(params: int, dp: int, collective: str) -> float:
    """Bytes one rank sends to reduce ``params`` bf16 gradients over ``dp`` ranks."""
    per_copy = (dp - 1) / dp * 2 * params
    return per_copy if collective == "reduce-scatter" else 2 * per_copy


def documents_per_row(prefix: str, seq_length: int) -> tuple[int, int, float]:
    """(documents, tokens, mean documents a row of ``seq_length`` tokens touches) of an indexed dataset."""
    from megatron_cai.core.datasets.indexed_dataset import IndexedDataset

    lengths = IndexedDataset(prefix).sequence_lengths
    docs, tokens = len(lengths), int(sum(int(n) for n in lengths))
    return docs, tokens, 1 + (seq_length - 1) * docs / tokens


def summary(logs: dict, dp: int, collective: str, packing: tuple[int, int, float] | None, seq_length: int,
            sample: str | None, seconds: int | None) -> list[str]:
    (it0, first, _), (it1, last, _) = logs["train"][0], logs["train"][-1]
    lines = ["", "== summary",
             f"lm loss (training): {first:.3f} at iteration {it0} -> {last:.3f} at iteration {it1} "
             f"({100 * (1 - last / first):.0f}% lower)"]
    if logs["valid"]:
        it, v = logs["valid"][-1]
        lines.append(f"validation lm loss at iteration {it}: {v:.3f}")
    sent = [b for _, _, b in logs["train"] if b is not None]
    if sent and logs["params"]:
        per_iter, ref = sent[-1], bf16_bytes(logs["params"], dp, collective)
        lines += [f"gradient bytes per rank and iteration: {per_iter:,} sent with Squinch (the log's grad comm bytes)",
                  f"  a bf16 {collective} of the same {logs['params']:,} gradients at DP = {dp} sends {ref:,.0f}:",
                  f"  Squinch sends {per_iter / ref:.3f} of that ({ref / per_iter:.2f}x fewer bytes)"]
    if packing:
        docs, tokens, per_row = packing
        lines += [f"packed documents: {docs:,} documents of {tokens / docs:.0f} tokens on average; a "
                  f"{seq_length}-token row", f"  holds {per_row:.1f} of them, each seeing only itself "
                  "(--reset-attention-mask)"]
    if sample:
        lines += ["sample:", sample.rstrip()]
    if seconds is not None:
        lines.append(f"quickstart time: {seconds} s (installs included)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--logs", nargs="+", required=True, help="pretrain_gpt.py logs, in order")
    p.add_argument("--data-parallel", type=int, required=True)
    p.add_argument("--collective", choices=["reduce-scatter", "all-reduce"], default="reduce-scatter",
                   help="what bf16 gradients would use: reduce-scatter with --use-distributed-optimizer")
    p.add_argument("--data", default=None, help="the data prefix (.bin/.idx): documents per row")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--sample", default=None, help="tools/generate.py's output")
    p.add_argument("--seconds", type=int, default=None)
    args = p.parse_args(argv)
    sample = open(args.sample, errors="replace").read() if args.sample and os.path.exists(args.sample) else None
    packing = documents_per_row(args.data, args.seq_length) if args.data else None
    print("\n".join(summary(parse_logs(args.logs), args.data_parallel, args.collective, packing, args.seq_length,
                            sample, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

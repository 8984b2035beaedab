"""Visibility-interval attention on CPU: block-skipping path vs dense-mask paths, and tree packing savings.

    python bench/attention.py [--seq 2048 4096 8192] [--demo-trees] [--tree-jsonl PATH] [--tree-data PREFIX]

For each sequence length and workload (packed documents of 100-1000 tokens; packed code trees) it
times forward+backward (batch 1, 2 heads, head_dim 64, fp32) of
  - ``blocked``: the block-skipping backend (the CPU default), also with Z-Reg on,
  - ``sdpa-dense``: torch scaled_dot_product_attention with a dense bool mask built from the intervals,
  - ``eager-dense``: the fp32 reference backend (explicit T x T mask and lse),
and measures each one's peak memory as the rise of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs; tracemalloc cannot see torch's allocator). It also reports the mask storage
(2 int32 per token vs a T x T bool mask), the fraction of 128 x 128 tiles the block map keeps, and
the tokens saved by packing each tree once instead of flattening every root-to-leaf branch.

Tree sources: ``synthetic`` (random code-shaped trees: module header -> top-level definitions ->
methods), ``stdlib`` (the same shape parsed with ``ast`` from Python's standard library, ~4 bytes per
token) and, with ``--tree-jsonl``, a tree corpus in the issue's JSONL format
(``{"text", "children", "bidirectional"}`` nested nodes), e.g. ``tools/make_demo_corpus.py --tree``,
and with ``--tree-data`` a corpus preprocessed by ``tools/preprocess_data.py --tree`` (real token
counts from its ``.tree`` sidecar), or with ``--demo-trees`` the demo one (``harness.data.demo_trees``:
``make_demo_corpus.py --tree``, sentencepiece 2048, ``preprocess_data.py --tree``, built in --cache-dir).
Trees longer than a row are cut as the training dataset cuts them (last subtrees dropped), then packed
first fit. Writes bench/results/attention.{json,md}; ``--quick``: T = 256, one repeat, a few trees.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import subprocess
import sys
import sysconfig
import time

import harness as H
import torch
from harness.data import demo_trees

from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import attend

HEADS, HEAD_DIM = 2, 64
Tree = tuple[list[int], list[int], list[bool]]  # parents, node_lengths, bidirectional


# ---------------------------------------------------------------------------------- tree sources
def synthetic_trees(rng: random.Random, n: int) -> list[Tree]:
    """Code-shaped trees: header -> functions / classes -> methods (token counts per node)."""
    out = []
    for _ in range(n):
        parents, lengths = [-1], [rng.randint(20, 200)]
        for _ in range(rng.randint(2, 10)):
            if rng.random() < 0.35:  # a class with methods
                cls = len(parents)
                parents.append(0)
                lengths.append(rng.randint(10, 60))
                for _ in range(rng.randint(1, 8)):
                    parents.append(cls)
                    lengths.append(rng.randint(20, 250))
            else:
                parents.append(0)
                lengths.append(rng.randint(30, 300))
        out.append((parents, lengths, [False] * len(parents)))
    return out


def _ntok(text: str) -> int:
    return max(1, len(text.encode()) // 4)


def stdlib_trees(max_files: int = 400) -> list[Tree]:
    """Module header -> top-level defs -> methods, parsed from the stdlib (tokens ~ bytes / 4)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:max_files]
    out = []
    for f in files:
        try:
            src = open(os.path.join(root, f), encoding="utf-8").read()
            mod = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        line_start = [0]
        for line in src.encode().splitlines(keepends=True):
            line_start.append(line_start[-1] + len(line))

        def nbytes(node, starts=line_start):
            return (starts[node.end_lineno - 1] + node.end_col_offset) - (starts[node.lineno - 1] + node.col_offset)

        parents, lengths, header = [-1], [0], line_start[-1]
        for node in mod.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            size = nbytes(node)
            header -= size
            me = len(parents)
            parents.append(0)
            lengths.append(size)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        lengths[me] -= nbytes(sub)
                        parents.append(me)
                        lengths.append(nbytes(sub))
        lengths = [max(1, n // 4) for n in [header, *lengths[1:]]]
        out.append((parents, lengths, [False] * len(parents)))
    return out


def jsonl_trees(path: str) -> list[Tree]:
    """Trees in the issue's JSONL format: one nested ``{"text", "children", "bidirectional"}`` per line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            parents, lengths, bidir = [], [], []
            stack = [(json.loads(line), -1)]
            while stack:
                node, par = stack.pop()
                me = len(parents)
                parents.append(par)
                lengths.append(_ntok(node.get("text", "")))
                bidir.append(bool(node.get("bidirectional", False)))
                stack.extend((c, me) for c in reversed(node.get("children", [])))
            out.append((parents, lengths, bidir))
    return out


def tree_data_trees(prefix: str) -> list[Tree]:
    """Trees of a ``preprocess_data.py --tree`` prefix, with their real token counts per node."""
    from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
    from megatron_cai.core.datasets.tree_format import TreeSidecar

    side = TreeSidecar(prefix, IndexedDataset(prefix).sequence_lengths)
    return [(t.parents, t.lengths, t.bidirectional) for t in map(side.tree, range(len(side)))]


def _cut(tree: Tree, seq: int) -> Tree:
    """The tree as the training dataset cuts it to fit ``seq`` tokens (tree_dataset.cut_tree)."""
    from megatron_cai.core.datasets.tree_dataset import cut_tree

    parents, lengths, bidir = tree
    k, tok = cut_tree(lengths, seq)
    lengths = list(lengths[:k])
    lengths[-1] -= sum(lengths) - tok
    return list(parents[:k]), lengths, list(bidir[:k])


def pack_trees(trees: list[Tree], seq: int) -> tuple[V.TreeLayout, int]:
    """First fit of whole (cut to ``seq`` where longer) trees into one row; returns (layout, trees packed)."""
    chosen, used = [], 0
    for t in trees:
        t = _cut(t, seq)
        n = sum(t[1])
        if used + n <= seq:
            chosen.append(V.from_tree(*t))
            used += n
    return V.concat_layouts(chosen), len(chosen)


def branch_savings(trees: list[Tree]) -> dict:
    """Tokens of each tree packed once vs every root-to-leaf branch flattened as its own sequence."""
    tree_tok = flat_tok = leaves = 0
    for parents, lengths, _ in trees:
        path = [0] * len(parents)  # tokens on the root-to-node path, node included
        has_child = [False] * len(parents)
        for n in V.from_tree(parents, lengths).order.tolist():  # preorder: parents first
            path[n] = lengths[n] + (path[parents[n]] if parents[n] >= 0 else 0)
            if parents[n] >= 0:
                has_child[parents[n]] = True
        tree_tok += sum(lengths)
        leaf_paths = [path[n] for n in range(len(parents)) if not has_child[n]]
        leaves += len(leaf_paths)
        flat_tok += sum(leaf_paths)
    return dict(trees=len(trees), leaves=leaves, tree_tokens=tree_tok, flattened_tokens=flat_tok,
                saving=1 - tree_tok / flat_tok, ratio=flat_tok / tree_tok)


def packed_docs(rng: random.Random, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = []
    while sum(lens) < seq:
        lens.append(rng.randint(100, 1000))
    lens[-1] -= sum(lens) - seq
    return V.from_document_lengths(lens)


# ---------------------------------------------------------------------------------- measurement
def _rss_kb() -> tuple[int, int]:
    vals = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0])
    return vals["VmRSS"], vals["VmHWM"]


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _step(fn, q, k, v) -> None:
    for x in (q, k, v):
        x.grad = None
    out = fn()
    out.backward(torch.ones_like(out))
    for x in (q, k, v):
        x.grad = None


def peak_mib(fn, q, k, v) -> float | None:
    """Peak RSS rise in MiB of one fwd+bwd (the second of two, so one-time allocations do not count)."""
    peak = None
    for _ in range(2):
        if not _reset_peak():
            return None
        base, _ = _rss_kb()
        _step(fn, q, k, v)
        _, hwm = _rss_kb()
        peak = (hwm - base) / 1024
    return peak


def best_times(methods: dict, q, k, v, repeats: int) -> dict:
    """Best-of-``repeats`` fwd+bwd seconds per method, methods interleaved (fair under shared CPUs)."""
    for fn in methods.values():
        _step(fn, q, k, v)  # warm-up
    best = {m: float("inf") for m in methods}
    for _ in range(repeats):
        for m, fn in methods.items():
            t0 = time.perf_counter()
            _step(fn, q, k, v)
            best[m] = min(best[m], time.perf_counter() - t0)
    return best


def bench_row(name: str, start: torch.Tensor, limit: torch.Tensor, seq: int, repeats: int,
              memory: bool) -> dict:
    s, lim = V.batch([(start, limit)], seq)
    V.validate(s, lim)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, requires_grad=True) for _ in range(3))
    tiles, _ = V.block_map(s, lim, 128, 128)
    methods = {
        "blocked": lambda: attend(q, k, v, s, lim, backend="blocked"),
        "blocked+zreg": lambda: attend(q, k, v, s, lim, backend="blocked", zreg_coeff=1e-4),
        "sdpa-dense": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=V.dense_mask(s, lim).unsqueeze(1)),
        "eager-dense": lambda: attend(q, k, v, s, lim, backend="eager"),
    }
    row = dict(workload=name, seq=seq, tokens=int(start.numel()), tile_density=float(tiles.float().mean()),
               interval_mask_bytes=2 * 4 * seq, dense_mask_bytes=seq * seq)
    if memory:
        row.update({m: peak_mib(fn, q, k, v) for m, fn in methods.items()})
    else:
        row.update(best_times(methods, q, k, v, repeats))
    return row


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = H.parser(__doc__, "attention")
    H.add(ap, repeats=5, threads=None)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--tree-jsonl", default=None, help="tree corpus in the issue's JSONL format")
    ap.add_argument("--tree-data", default=None, help="tree corpus prefix written by preprocess_data.py --tree")
    ap.add_argument("--demo-trees", action="store_true", help="build the demo tree corpus and use it as --tree-data")
    ap.add_argument("--no-stdlib", action="store_true", help="skip the stdlib-parsed trees")
    ap.add_argument("--synthetic-trees", type=int, default=600, help="random code-shaped trees")
    ap.add_argument("--stdlib-files", type=int, default=400, help="stdlib modules parsed into trees")
    ap.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    return H.parse(ap, argv, quick=dict(seq=[256], repeats=1, synthetic_trees=40, stdlib_files=20, demo_trees=True))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = H.Results(args.out)
    if args.from_json:
        out.rewrite(render)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.demo_trees and not args.tree_data:
        size = dict(max_mb=H.data.QUICK["corpus_mb"], vocab=H.data.QUICK["vocab"]) if args.quick else {}
        args.tree_data = demo_trees(args.cache_dir, **size)["prefix"]

    rng = random.Random(0)
    sources = {"synthetic-trees": synthetic_trees(rng, args.synthetic_trees)}
    if not args.no_stdlib:
        sources["stdlib-trees"] = stdlib_trees(args.stdlib_files)
    if args.tree_jsonl:
        sources["jsonl-trees"] = jsonl_trees(args.tree_jsonl)
    if args.tree_data:
        sources["demo-trees"] = tree_data_trees(args.tree_data)
    savings = {name: branch_savings(trees) for name, trees in sources.items()}

    rows = []
    for seq in args.seq:
        work = [("packed-docs", *packed_docs(random.Random(seq), seq))]
        for name, trees in sources.items():
            shuffled = trees[:]
            random.Random(seq).shuffle(shuffled)
            lay, n_trees = pack_trees(shuffled, seq)
            work.append((f"{name} ({n_trees} trees)", lay.start, lay.limit))
        for name, st, li in work:
            row = bench_row(name, st, li, seq, args.repeats, args.memory_worker)
            rows.append(row)
            if not args.memory_worker:
                times = ", ".join(f"{m} {row[m]:.3f}s" for m in METHODS)
                print(f"T={seq} {name}: {times}", flush=True)
    if args.memory_worker:
        print("MEMORY " + json.dumps(rows), flush=True)
        return 0
    peaks = memory_pass([*(argv if argv is not None else sys.argv[1:]), "--tree-data", args.tree_data]
                        if args.tree_data else argv)
    for row, mem in zip(rows, peaks or [None] * len(rows)):
        for m in METHODS:
            row[m] = dict(seconds=row[m], peak_mib=None if mem is None else mem[m])
    config = dict(heads=HEADS, head_dim=HEAD_DIM, batch=1, dtype="float32", threads=torch.get_num_threads(),
                  torch=torch.__version__, repeats=args.repeats)
    out.write(dict(config=config, rows=rows, branch_savings=savings), render)
    return 0


METHODS = ("blocked", "blocked+zreg", "sdpa-dense", "eager-dense")


def memory_pass(argv: list[str] | None) -> list[dict] | None:
    """Re-run the workloads in a child whose malloc returns every block >= 64 KiB to the OS on free,
    so that the peak RSS follows live tensor memory (timings are taken without this setting)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", *(argv if argv is not None else sys.argv[1:])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    if proc.returncode != 0 or not lines:
        print(f"memory pass failed (rc={proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("MEMORY "):])


def _mib(x):
    return "n/a" if x is None else f"{x:.0f}"


def _ratio(a, b):
    return "n/a" if a is None or not b else f"{a / b:.0f}x"


def render(payload: dict) -> str:
    rows, savings, cfg = payload["rows"], payload["branch_savings"], payload["config"]
    lines = [
        "# Visibility-interval attention on CPU",
        "",
        f"batch {cfg['batch']}, {cfg['heads']} heads, head_dim {cfg['head_dim']}, fp32, forward+backward, "
        f"{cfg['threads']} threads, torch {cfg['torch']}; time: best of {cfg['repeats']}. "
        "Memory: rise of the peak RSS during one fwd+bwd (inputs excluded; measured in a child with "
        "MALLOC_MMAP_THRESHOLD_=65536 so freed blocks leave RSS). Ratios are dense / blocked.",
        "",
        "| T | workload | tiles kept | blocked s | +Z-Reg s | sdpa-dense s | eager-dense s | sdpa/blocked"
        " | eager/blocked | blocked MiB | sdpa MiB | eager MiB | sdpa/blocked mem | eager/blocked mem"
        " | mask: intervals vs T x T |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, z, sd, e = (r[m] for m in ("blocked", "blocked+zreg", "sdpa-dense", "eager-dense"))
        lines.append(
            f"| {r['seq']} | {r['workload']} | {r['tile_density']:.0%} | {b['seconds']:.3f} | "
            f"{z['seconds']:.3f} | {sd['seconds']:.3f} | {e['seconds']:.3f} | "
            f"{sd['seconds'] / b['seconds']:.1f}x | {e['seconds'] / b['seconds']:.1f}x | "
            f"{_mib(b['peak_mib'])} | {_mib(sd['peak_mib'])} | {_mib(e['peak_mib'])} | "
            f"{_ratio(sd['peak_mib'], b['peak_mib'])} | {_ratio(e['peak_mib'], b['peak_mib'])} | "
            f"{r['interval_mask_bytes'] / 1024:.0f} KiB vs {r['dense_mask_bytes'] / 2**20:.0f} MiB |"
        )
    if "machine" in payload:
        lines += ["", f"Machine: {H.results.load_line(payload['machine']['start'])} at the start, "
                  f"{H.results.load_line(payload['machine']['end'])} at the end."]
    lines += ["", "## Tree packing vs flattening every root-to-leaf branch", "",
              "| source | trees | leaves | tokens as trees | tokens as flattened branches | saved | ratio |",
              "|---|---|---|---|---|---|---|"]
    for name, s in savings.items():
        lines.append(f"| {name} | {s['trees']} | {s['leaves']} | {s['tree_tokens']} | "
                     f"{s['flattened_tokens']} | {s['saving']:.0%} | {s['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

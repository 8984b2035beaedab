"""Context parallelism per rank: bytes sent and attention FLOPs against a dense ring, imbalance, memory.

For sequences of T = 16k and 32k tokens and CP = 1, 2, 4, on three batches (one row each):

- plain causal;
- packed documents of mean length T/16: lengths uniform in [1, T/8] (the last one cut at T);
- packed documents with exponential lengths of mean T/16 (heavy-tailed: a document longer than T/CP,
  whose balance needs it spread over ranks, turns up in about a third of the rows at CP 4);
- packed trees: code-shaped trees (header -> definitions -> methods; bench/attention.py's generator),
  whole trees first-fit into the row (a few hundred to a few thousand tokens each).

The packed rows are drawn with ``--seeds`` seeds; each ratio is the worst rank's, reported as the median
over seeds with the min and max.

**Exact counts** (no timing; computed from the attention plan that the implementation executes, whose
byte counts tests/unit_tests/parallel/test_context_parallel_attention.py checks against a brute force):

- bytes each rank sends for attention: K and V rows of the keys some remote query can see (forward), the
  same again in backward plus the dK/dV of the keys it received, sent back to their owners; against a
  dense ring that ignores visibility (each rank's T/CP keys to every other rank, forward and again in
  backward, and dK/dV back), for Llama-3-8B attention shapes (8 KV heads of 128, bf16: 4 KiB per key);
- attention FLOPs each rank computes: ``4 x head_dim x heads`` per (query, key) pair of every 128 x 128
  tile the kernels visit (forward; the backward visits the same tiles), against the dense ring's every
  (local query, key) pair; the exact visible pairs beside it;
- the work imbalance: max over mean of the ranks' visible (query, key) pairs.

**Measured** (gloo ranks on CPU): a 1-layer GPT (hidden 128, 4 heads, 2 KV heads, fp32, blocked kernel)
runs one forward on each rank's share of the row: the bytes of the tensors it saves for backward (exact,
``saved_tensors_hooks``, each storage once) and the peak resident memory above the start of the forward
(every tensor above 64 KiB its own mmap, so resident memory follows live tensors; bench/fsdp_memory.py's
method), per rank.

    python bench/context_parallel.py [--quick] [--seq 16384 32768] [--cp 1 2 4] [--seeds 5] [--no-memory]
    # writes bench/results/context_parallel.{json,md}; --quick: T = 2048, one seed, memory on one batch at CP 2
"""
from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as H  # noqa: E402  (puts the repository root on sys.path)
from harness.scripts import load_module  # noqa: E402

from megatron_cai.core.context_parallel.batch import split_for  # noqa: E402
from megatron_cai.core.context_parallel.plan import build_rank_plan  # noqa: E402
from megatron_cai.core.context_parallel.split import imbalance, visible_keys_per_query  # noqa: E402
from megatron_cai.core.transformer import attention_tiling  # noqa: E402
from megatron_cai.core.transformer import visibility_layouts as V  # noqa: E402
from megatron_cai.testing.distributed import run_distributed  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ELEMENT_BYTES = 32, 8, 128, 2  # Llama-3-8B attention, bf16
KEY_BYTES = 2 * KV_HEADS * HEAD_DIM * ELEMENT_BYTES  # K and V of one key
FLOPS_PER_PAIR = 4 * HEAD_DIM * HEADS  # QK^T and PV, forward
TILE = 128
KINDS = ("plain causal", "packed documents", "packed documents (exponential)", "packed trees")
MIB = 1 << 20


# ------------------------------------------------------------------------------------------ batches
def batch_of(kind: str, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row: tokens, position_ids and (packed data) the visibility intervals."""
    rng = random.Random(seed * 7919 + seq)
    batch = {"tokens": torch.zeros(1, seq, dtype=torch.int64)}
    if kind == "plain causal":
        batch["position_ids"] = torch.arange(seq).unsqueeze(0)
        return batch
    if kind.startswith("packed documents"):
        lens, total = [], 0
        while total < seq:
            n = max(1, round(rng.expovariate(16 / seq))) if "exponential" in kind else rng.randint(1, seq // 8)
            lens.append(min(n, seq - total))
            total += lens[-1]
        start, limit = V.from_document_lengths(lens)
        pos = V.document_position_ids(lens)
    else:
        trees = load_module("bench/attention.py")  # by path: bench/gpu/attention.py is also "attention"
        lay, _ = trees.pack_trees(trees.synthetic_trees(rng, 4 * seq // 1000 + 8), seq)
        start, limit, pos = V.pad(lay.start, lay.limit, seq, lay.position_ids)
    batch.update(visibility_start=start.unsqueeze(0), visibility_limit=limit.unsqueeze(0),
                 position_ids=pos.unsqueeze(0))
    return batch


def intervals(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    seq = batch["tokens"].shape[1]
    if "visibility_start" in batch:
        return batch["visibility_start"], batch["visibility_limit"]
    return torch.arange(seq).unsqueeze(0), torch.full((1, seq), seq)


# --------------------------------------------------------------------------------------- exact counts
def _tile_pairs(start: torch.Tensor, limit: torch.Tensor, num_queries: int) -> int:
    """(query, key) pairs in the TILE x TILE tiles that the kernels visit for one key set."""
    seq = start.shape[-1]
    tiles, _ = attention_tiling.block_map(start, limit, TILE, TILE, num_queries=num_queries)
    rows = torch.clamp(num_queries - torch.arange(tiles.shape[-2]) * TILE, max=TILE)
    cols = torch.clamp(seq - torch.arange(tiles.shape[-1]) * TILE, max=TILE)
    return int((tiles[0].to(torch.int64) * rows.view(-1, 1) * cols.view(1, -1)).sum())


def exact_rows(kind: str, seq: int, cp: int, seed: int = 0) -> list[dict]:
    """Per rank: bytes sent, FLOPs, visible pairs, and the dense ring's, from the rank's attention plan."""
    batch = batch_of(kind, seq, seed)
    start, limit = intervals(batch)
    split = split_for(batch, cp)
    work = visible_keys_per_query(start, limit)[0]
    local = seq // cp
    rows = []
    for r in range(cp):
        plan = build_rank_plan(split, r, start, limit, batch["position_ids"])
        sent = sum(s.num_sent for s in plan.steps)
        received = sum(s.num_received for s in plan.steps)
        pairs = _tile_pairs(plan.start, plan.limit, local)
        pairs += sum(_tile_pairs(s.start, s.limit, local) for s in plan.steps if s.num_received)
        dense_fwd = (cp - 1) * local
        rows.append({
            "kind": kind, "seq": seq, "cp": cp, "seed": seed, "rank": r, "chunks": split.num_chunks,
            "visible_pairs": int(work[split.token_index(r)].sum()),
            "forward_bytes": sent * KEY_BYTES, "total_bytes": (2 * sent + received) * KEY_BYTES,
            "dense_forward_bytes": dense_fwd * KEY_BYTES, "dense_total_bytes": 3 * dense_fwd * KEY_BYTES,
            "flops": pairs * FLOPS_PER_PAIR, "visible_flops": int(work[split.token_index(r)].sum()) * FLOPS_PER_PAIR,
            "dense_flops": local * seq * FLOPS_PER_PAIR,
        })
    loads = [row["visible_pairs"] for row in rows]
    for row in rows:
        row["imbalance"] = imbalance(loads)
    return rows


# ------------------------------------------------------------------------------------------- memory
def _memory_worker(rank, world, kind: str, seq: int):
    import torch.distributed as dist
    from fsdp_memory import peak_during

    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.context_parallel import get_batch_on_this_cp_rank
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel

    ps.initialize_model_parallel(context_parallel_size=world)
    torch.manual_seed(0)
    config = GPTConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                       seq_length=seq, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="blocked")
    model = GPTModel(config)
    model.initialize(0)
    batch = batch_of(kind, seq)
    batch["tokens"] = torch.randint(0, 256, (1, seq))
    batch["labels"] = torch.randint(0, 256, (1, seq))
    batch["loss_mask"] = torch.ones(1, seq)
    local = get_batch_on_this_cp_rank(batch)
    vis = local.get("visibility") or intervals(batch)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def forward():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(local["tokens"], local["position_ids"], labels=local["labels"], visibility=vis)
        forward.loss = out.sum()

    dist.barrier()
    peak = peak_during(forward)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"saved": sum(saved.values()) - params, "peak": peak}


def memory_rows(kind: str, seq: int, cp: int) -> list[dict]:
    res = run_distributed(_memory_worker, cp, (kind, seq), timeout=3600)
    return [{"kind": kind, "seq": seq, "cp": cp, "rank": r, "saved_bytes": m["saved"], "peak_bytes": m["peak"]}
            for r, m in enumerate(res)]


# -------------------------------------------------------------------------------------------- output
def summarize(rows: list[dict]) -> list[dict]:
    """One line per (kind, T, CP): per seed the worst rank's ratios, then median / min / max over seeds."""
    out = []
    keys = sorted({(r["kind"], r["seq"], r["cp"]) for r in rows if "flops" in r},
                  key=lambda k: (KINDS.index(k[0]), k[1], k[2]))
    for key in keys:
        exact = [r for r in rows if (r["kind"], r["seq"], r["cp"]) == key and "flops" in r]
        per_seed = []
        for seed in sorted({r["seed"] for r in exact}):
            ranks = [r for r in exact if r["seed"] == seed]
            per_seed.append({
                "chunks": ranks[0]["chunks"], "imbalance": ranks[0]["imbalance"],
                "total_bytes": max(r["total_bytes"] for r in ranks), "dense_total_bytes": ranks[0]["dense_total_bytes"],
                "bytes_ratio": max(r["total_bytes"] / r["dense_total_bytes"] for r in ranks) if key[2] > 1 else 0.0,
                "flops": max(r["flops"] for r in ranks), "dense_flops": ranks[0]["dense_flops"],
                "flops_ratio": max(r["flops"] / r["dense_flops"] for r in ranks),
                "visible_ratio": max(r["visible_flops"] / r["dense_flops"] for r in ranks)})
        line = {"kind": key[0], "seq": key[1], "cp": key[2], "seeds": len(per_seed),
                "chunks": sorted({p["chunks"] for p in per_seed}),
                "dense_total_bytes": per_seed[0]["dense_total_bytes"], "dense_flops": per_seed[0]["dense_flops"]}
        for k in ("imbalance", "total_bytes", "bytes_ratio", "flops", "flops_ratio", "visible_ratio"):
            line[k] = H.spread([p[k] for p in per_seed])
        mem = [r for r in rows if (r["kind"], r["seq"], r["cp"]) == key and "peak_bytes" in r]
        if mem:
            line["max_saved_bytes"] = max(r["saved_bytes"] for r in mem)
            line["max_peak_bytes"] = max(r["peak_bytes"] for r in mem)
        out.append(line)
    return out


def acceptance(summary: list[dict]) -> list[str]:
    """The issue's targets: on every T measured, over every seed (the worst one)."""
    lines = []
    for s in summary:
        if s["kind"] == "packed documents" and s["cp"] == 4:
            b, f = s["bytes_ratio"]["max"], s["flops_ratio"]["max"]
            verdict = "met" if max(b, f) <= 0.3 else "NOT met"
            lines.append(f"packed documents, CP 4, T {s['seq']}: each rank sends <= {b:.3f} x and computes <= "
                         f"{f:.3f} x the dense ring over {s['seeds']} seeds (target 0.3): {verdict}")
    for kind, cap in (("plain causal", 1.05), ("packed trees", 1.15)):
        worst = max((s["imbalance"]["max"] for s in summary if s["kind"] == kind), default=None)
        if worst is not None:
            lines.append(f"{kind}: imbalance <= {worst:.4f} at every T, CP and seed (target {cap}): "
                         f"{'met' if worst <= cap else 'NOT met'}")
    return lines


def _cell(spread: dict, fmt: str) -> str:
    if spread["min"] == spread["max"]:
        return format(spread["median"], fmt)
    return f"{format(spread['median'], fmt)} ({format(spread['min'], fmt)}-{format(spread['max'], fmt)})"


def markdown(summary: list[dict], memory: bool) -> str:
    head = ("| batch | T | CP | chunks | imbalance | bytes sent / rank MiB | dense ring MiB | ratio | attention GFLOP "
            "/ rank | dense ring | ratio | visible-pair ratio |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|"
    if memory:
        head += " saved for backward MiB / rank | peak MiB / rank |"
        sep += "---|---|"
    lines = [head, sep]
    for s in summary:
        mib = {k: s["total_bytes"][k] / MIB for k in ("median", "min", "max")}
        gflop = {k: s["flops"][k] / 1e9 for k in ("median", "min", "max")}
        line = (f"| {s['kind']} | {s['seq']} | {s['cp']} | {'/'.join(map(str, s['chunks']))} | "
                f"{_cell(s['imbalance'], '.3f')} | {_cell(mib, '.1f')} | {s['dense_total_bytes'] / MIB:.1f} | "
                f"{_cell(s['bytes_ratio'], '.3f') if s['cp'] > 1 else ''} | {_cell(gflop, '.1f')} | "
                f"{s['dense_flops'] / 1e9:.1f} | {_cell(s['flops_ratio'], '.3f')} | "
                f"{_cell(s['visible_ratio'], '.3f')} |")
        if memory:
            line += "".join(f" {s[k] / MIB:.1f} |" if k in s else " |" for k in ("max_saved_bytes", "max_peak_bytes"))
        lines.append(line)
    return "\n".join(lines)


def render(payload: dict) -> str:
    """The report, from the JSON alone (``--from-json`` rewrites it)."""
    memory = any("peak_bytes" in r for r in payload["rows"])
    m = payload["machine"]["end"]
    return ("# Context parallelism per rank (bench/context_parallel.py)\n\n" + __doc__.split("\n\n", 1)[1]
            .split("    python")[0] + f"\nT = {', '.join(map(str, payload['seqs']))}; CP = "
            f"{', '.join(map(str, payload['cp']))}; {payload['seeds']} seed(s) per packed batch. Bytes are forward + "
            "backward (the dense ring's likewise); GFLOP are forward (the backward visits the same tiles). Ratios "
            "are the worst rank's; cells with a range are the median (min-max) over seeds. Memory: the first "
            f"seed's row. Load average at the end {m['load_average']} on {m['cpus']} CPUs (no timings here: every "
            "number but the peak is an exact count).\n\n"
            + markdown(payload["summary"], memory) + "\n\n" + "\n".join(f"- {c}" for c in payload["acceptance"])
            + "\n")


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "context_parallel")
    p.add_argument("--seq", type=int, nargs="*", default=[16384, 32768], help="sequence lengths T")
    p.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4], help="context-parallel sizes")
    p.add_argument("--seeds", type=int, default=5, help="rows drawn per packed batch")
    p.add_argument("--memory-kinds", nargs="*", default=list(KINDS), choices=KINDS,
                   help="batches whose memory is measured on gloo ranks (none: exact counts only)")
    p.add_argument("--memory-cp", type=int, nargs="*", default=None,
                   help="context-parallel sizes whose memory is measured (default: every --cp)")
    p.add_argument("--no-memory", dest="memory_kinds", action="store_const", const=[],
                   help="exact counts only (no gloo ranks)")
    # --quick: one short T, one seed, memory on one batch at CP 2 (one launch of gloo ranks)
    a = H.parse(p, argv, quick=dict(seq=[2048], seeds=1, memory_kinds=["packed documents"], memory_cp=[2]))
    memory_cp = a.cp if a.memory_cp is None else a.memory_cp
    out = H.Results(a.out, {"seq": a.seq, "cp": a.cp, "seeds": a.seeds, "memory": [a.memory_kinds, memory_cp]})
    if a.from_json:
        out.rewrite(render)
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks: RSS follows live tensors
    rows = []
    for seq in a.seq:
        for kind in KINDS:
            for cp in a.cp:
                for seed in range(1 if kind == "plain causal" else a.seeds):
                    rows += out.row(f"{kind}|{seq}|{cp}|{seed}",
                                    lambda k=kind, s=seq, c=cp, d=seed: exact_rows(k, s, c, d))
                if kind in a.memory_kinds and cp in memory_cp:  # on the first seed's row
                    rows += out.row(f"{kind}|{seq}|{cp}|memory", lambda k=kind, s=seq, c=cp: memory_rows(k, s, c))
                print(summarize([r for r in rows if (r["kind"], r["seq"], r["cp"]) == (kind, seq, cp)])[0],
                      flush=True)
    summary = summarize(rows)
    out.write({"seqs": a.seq, "cp": a.cp, "seeds": a.seeds, "key_bytes": KEY_BYTES, "flops_per_pair": FLOPS_PER_PAIR,
               "tile": TILE, "rows": rows, "summary": summary, "acceptance": acceptance(summary)}, render)


if __name__ == "__main__":
    main()

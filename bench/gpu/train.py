"""GPT training throughput on the GPU through what users run: pretrain_gpt.py's own Trainer (its flags,
data path from a Megatron .bin/.idx corpus, our AdamW, Squinch reducer, log line), bf16, sequence 2048,
for a ~350M and a ~1.3B GPT (head dim 128): plain causal (SDPA), packed documents with
--reset-attention-mask (our Triton visibility kernel) and packed documents with Z-Reg. The peer is a plain
PyTorch loop of the same model: torch.optim.AdamW(fused=True), SDPA, torch.compile per transformer layer
(and the same loop eager), on plain causal rows; our rows are reported as ratios to the compiled peer.
The Kaiju pattern (docs/kaiju.md: MQA, windows of 1,024 on 5 of every 6 layers, K/V shared by neighbouring
layers) trains through the same Trainer, and decodes greedily after a prefill of the row's sequence with the
int8 KV cache, beside the baseline (8 KV heads, bf16 cache): tokens/s and cache bytes per token.
The anchor: megatron-core 0.19.2's own GPTModel (mcore_peer.py) on the 350M model, its windows of
iterations alternated with our Trainer's in one process, both rows side by side.

Step time is the median over the timed iterations (after warm-up; each iteration ends with the Trainer's
one host sync), the spread their max - min. MFU = model FLOPs (megatron-core's formula, causal attention
included, as in the Trainer's --log-throughput) per second over the measured bf16 matmul rate
(gpu_env.json) and over the datasheet peak. A counter on Triton's launch entry point and on ``attend`` /
SDPA proves which attention kernel each row ran (for the peers, in one eager forward: a counter inside
the compiled layers would make Dynamo recompile them); the compiled peer records Dynamo's graph count and
graph breaks and fails its row unless every layer ran the one graph.
"""
from __future__ import annotations

import contextlib
import gc
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from common import (
    Budget,
    KernelCounter,
    StepResults,
    ceilings,
    count_calls,
    environment,
    parser,
    pick_device,
)

import pretrain_gpt
from megatron_cai.core import device as dev
from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_cai.core.models.gpt.model import build_model_chunks
from megatron_cai.core.transformer import attention as attention_mod
from megatron_cai.training.logging import gpt_flops_per_iteration
from megatron_cai.training.training import Trainer

VOCAB = 32000  # NullTokenizer ids; EOD = VOCAB
MODELS = {
    "350M": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "8",
             "--ffn-hidden-size", "2816"],
    "1.3B": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--ffn-hidden-size", "5632"],
    "toy": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--ffn-hidden-size", "128"],
}
KAIJU = ["--group-query-attention", "--num-query-groups", "1", "--window-size", "1024", "--window-attn-skip-freq", "6",
         "--kv-share-pattern", "2"]
DECODE_TOKENS = 64  # greedy steps timed after the prefill (the dry run: 4)
# (row name, model, kind, extra flags), most decisive first; the 1.3B rows last.
ROWS = [
    ("ours: plain causal (SDPA)", "350M", "ours", []),
    ("peer: AdamW(fused) + SDPA + torch.compile", "350M", "peer-compiled", []),
    ("ours vs megatron-core GPTModel, alternated", "350M", "vs-mcore", []),
    ("ours: packed docs (Triton visibility kernel)", "350M", "ours", ["--reset-attention-mask"]),
    ("ours: packed docs + Z-Reg", "350M", "ours", ["--reset-attention-mask", "--attention-zreg-coeff", "1e-4"]),
    ("peer: eager", "350M", "peer-eager", []),
    ("ours: Kaiju pattern (MQA, 5:1 windows, KV sharing)", "350M", "ours", KAIJU),
    ("decode: baseline, bf16 cache", "350M", "decode", []),
    ("decode: Kaiju pattern, int8 cache", "350M", "decode", KAIJU + ["--kv-cache-dtype-for-bench", "int8"]),
    ("ours: plain causal (SDPA)", "1.3B", "ours", []),
    ("ours: packed docs (Triton visibility kernel)", "1.3B", "ours", ["--reset-attention-mask"]),
    ("peer: AdamW(fused) + SDPA + torch.compile", "1.3B", "peer-compiled", []),
]
COLUMNS = ["row", "model", "params_M", "tokens_per_s", "vs_peer", "vs_megatron_core", "step_ms", "spread_ms", "TFLOPs",
           "MFU_measured", "MFU_datasheet", "peak_mem_GiB", "attention", "error"]


def build_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    """A Megatron .bin/.idx corpus of random documents (64 to 1024 tokens, EOD-terminated)."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    written = 0
    while written < tokens:
        n = int(rng.integers(64, 1024))
        builder.add_document(np.append(rng.integers(0, VOCAB, n), VOCAB))
        written += n + 1
    builder.finalize(prefix + ".idx")


def base_flags(model: str, seq: int, mbs: int, iters: int, data: str, dry_run: bool) -> list[str]:
    flags = MODELS[model] + [
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
        "--global-batch-size", str(mbs), "--train-iters", str(iters), "--log-interval", str(iters),
        "--eval-iters", "0", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--data-path", data, "--split", "1,0,0",
        "--data-cache-path", os.path.dirname(data), "--position-embedding-type", "rope", "--normalization",
        "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--squinch", "--seed", "1234"]
    # the CPU dry run: fp32 (the interpreter's bf16 dot is wrong) and our kernel forced (CPU's default is
    # the blocked torch path); on CUDA the default backend is our Triton kernel
    return flags + (["--attention-backend", "triton"] if dry_run else ["--bf16"])


@dataclass
class Alternate:
    """Another model's training iteration, run in windows of ``window`` iterations between our Trainer's
    iterations once our warm-up is done (ours and theirs alternate on the same GPU, same process);
    ``build(model_config)`` makes it once the Trainer exists and returns one iteration (ending with a
    host read). Its timed iterations land in ``steps``, after ``warmup`` untimed ones."""

    build: Callable[..., Callable[[], float]]
    window: int
    warmup: int
    steps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def run_window(self, step: Callable[[], float], device: torch.device) -> None:
        if not self.losses:  # its first window: warm up first
            self.losses += [step() for _ in range(self.warmup)]
        for _ in range(self.window):
            t0 = time.perf_counter()
            self.losses.append(step())
            dev.synchronize(device)
            self.steps.append(time.perf_counter() - t0)


def run_ours(argv: list[str], warmup: int, device: torch.device, alternate: Alternate | None = None) -> dict:
    """Train through pretrain_gpt's Trainer; per-iteration times (each ends with the loop's host sync and
    includes the Trainer's bookkeeping between iterations; not the alternated model's windows)."""
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    out = io.StringIO()
    counter, calls = KernelCounter(), {}
    with contextlib.redirect_stdout(out):
        trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step,
                          tokenizer)
        theirs = alternate.build(config.model) if alternate else None
        durations: list[float] = []
        last = [0.0]
        step = trainer.train_step

        def timed_step():
            done = len(durations)
            if theirs is not None and done >= warmup and (done - warmup) % alternate.window == 0:
                alternate.run_window(theirs, device)
                dev.synchronize(device)
                last[0] = time.perf_counter()
            result = step()
            dev.synchronize(device)
            now = time.perf_counter()
            durations.append(now - last[0])
            last[0] = now
            return result

        trainer.train_step = timed_step
        with counter.active(), count_calls(attention_mod, "attend", calls), \
                count_calls(torch.nn.functional, "scaled_dot_product_attention", calls):
            dev.synchronize(device)
            last[0] = time.perf_counter()
            state = trainer.train()
    n_params = sum(p.numel() for m in trainer.model for p in m.module.parameters())
    history = state.extra["history"]
    lines = [ln for ln in out.getvalue().splitlines() if " iteration " in ln]
    del trainer
    return {"config": config, "n_params": n_params, "steps": durations[warmup:],
            "loss": [h["lm loss"] for h in history], "log_line": lines[-1].strip() if lines else None,
            "kernels": counter.counts, "calls": calls}


def run_peer(argv: list[str], warmup: int, device: torch.device, compiled: bool, dry_run: bool) -> dict:
    """The same model in a plain loop: fused AdamW, bf16 autocast, SDPA (no visibility), optional compile.

    Compiled, each transformer layer is one graph that every layer shares: nothing inside it may change
    between calls (a Python-side call counter there is guarded on, and every layer call recompiles until
    Dynamo's recompile limit, after which the layers run eagerly). So the SDPA calls are counted in one
    eager forward before compiling, and the timed loop records Dynamo's ``compile_stats``."""
    config, _ = pretrain_gpt.build_run(argv, world_size=1)
    cfg, run = config.model, config.training
    ps.initialize_model_parallel()
    model = build_model_chunks(cfg, run.seed)[0].to(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, VOCAB, (run.micro_batch_size, cfg.seq_length + 1), generator=g).to(device)
    pos = torch.arange(cfg.seq_length, device=device).expand(run.micro_batch_size, -1)

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        with dev.autocast(device, run.bf16):
            return model(tokens[:, :-1], pos, labels=tokens[:, 1:]).float().mean()

    calls: dict[str, int] = {}
    with count_calls(torch.nn.functional, "scaled_dot_product_attention", calls), torch.no_grad():
        loss_of(model)  # eager: which attention one forward runs, counted outside any compiled region
    if compiled:
        torch._dynamo.reset()
        for layer in model.decoder.layers.values():
            layer.compile(backend="eager" if dry_run else "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            **({"fused": True} if device.type == "cuda" else {}))
    stamps, losses = [], []
    with compile_stats() as stats:
        dev.synchronize(device)
        stamps.append(time.perf_counter())
        for _ in range(run.train_iters):
            loss = loss_of(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # one host sync per iteration, as the Trainer's
            stamps.append(time.perf_counter())
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt
    steps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    out = {"config": config, "n_params": n_params, "steps": steps, "loss": losses, "log_line": None,
           "kernels": {}, "calls": calls}
    if compiled:  # one graph for every layer, no graph break: else the "compiled" peer ran (partly) eagerly
        out["compile"] = stats
        if stats["unique_graphs"] != 1 or stats["graph_breaks"]:
            out["error"] = (f"the peer is not compiled once: {stats['unique_graphs']} graphs, "
                            f"{stats['graph_breaks']} graph breaks {stats['break_reasons'][:2]}")
    return out


@contextlib.contextmanager
def compile_stats() -> Iterator[dict]:
    """Dynamo's graph count (a recompile adds one), graph breaks and their reasons, of what runs inside
    (filled on exit)."""
    from torch._dynamo.utils import counters

    counters.clear()
    stats: dict = {}
    try:
        yield stats
    finally:
        stats.update(unique_graphs=counters["stats"].get("unique_graphs", 0),
                     graph_breaks=sum(counters["graph_break"].values()),
                     break_reasons=[str(r)[:200] for r in counters["graph_break"]])


ALTERNATED_ROUNDS = 3  # ours / megatron-core windows of `window` iterations each, after the warm-up


def run_vs_mcore(argv: list[str], warmup: int, window: int, device: torch.device, dry_run: bool) -> tuple[dict, dict]:
    """Our Trainer and megatron-core's GPTModel (mcore_peer.py) on the same model and batch size,
    alternating windows of ``window`` iterations (ALTERNATED_ROUNDS each, after ``warmup`` each)."""
    import mcore_peer

    made: dict = {}

    def build(model_cfg) -> Callable[[], float]:
        mbs = int(argv[argv.index("--micro-batch-size") + 1])
        made["run"] = mcore_peer.build(model_cfg, mbs, device, bf16=not dry_run)
        return made["run"].step

    alternate = Alternate(build=build, window=window, warmup=warmup)
    try:
        ours = run_ours(argv, warmup, device, alternate)
    finally:
        if "megatron.core" in sys.modules:
            mcore_peer.teardown()
    run = made.pop("run")
    theirs = {"config": ours["config"], "n_params": run.n_params, "steps": alternate.steps, "loss": alternate.losses,
              "log_line": None, "kernels": {}, "calls": {}, "megatron_core": {"optimizer": run.optimizer,
                                                                              "from": run.source}}
    return ours, theirs


def run_decode(argv: list[str], device: torch.device, dry_run: bool) -> dict:
    """Greedy decoding of a randomly initialised model of these flags (bf16 on the GPU): a prefill of the
    row's sequence less the decoded tokens, then each decode step timed (ending with a device sync); the
    cache's bytes per token, counted from its tensors. ``--kv-cache-dtype-for-bench int8``: the int8 cache."""
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.core.transformer.int8_kv_cache import cache_bytes, make_kv_cache
    from megatron_cai.inference.generation import decode_step, ensure_single_process, inference_config, prefill

    kv_dtype = "auto"
    if "--kv-cache-dtype-for-bench" in argv:
        i = argv.index("--kv-cache-dtype-for-bench")
        kv_dtype, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    config, _ = pretrain_gpt.build_run(argv, world_size=1)
    ensure_single_process()
    model = GPTModel(inference_config(config.model))
    model.initialize(1234)
    model = model.to(device=device, dtype=torch.float32 if dry_run else torch.bfloat16).eval()
    tokens = 4 if dry_run else DECODE_TOKENS
    context = config.model.seq_length - tokens
    prompt = torch.randint(0, VOCAB, (1, context), device=device, generator=torch.Generator().manual_seed(0)
                           if device.type == "cpu" else None)
    cache = make_kv_cache(kv_dtype)
    counter, calls, steps = KernelCounter(), {}, []
    with torch.no_grad(), counter.active(), count_calls(attention_mod, "attend", calls):
        nxt = prefill(model, prompt, cache).argmax(-1)
        bytes_per_token = cache_bytes(cache) / context
        for _ in range(tokens):
            dev.synchronize(device)
            t0 = time.perf_counter()
            nxt = decode_step(model, nxt, cache).argmax(-1)
            dev.synchronize(device)
            steps.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    del model, cache
    return {"n_params": n_params, "steps": steps, "context": context, "kv_cache": kv_dtype,
            "kv_bytes_per_token": bytes_per_token, "kernels": counter.counts, "calls": calls}


def decode_figures(r: dict) -> dict:
    step = statistics.median(r["steps"])
    return dict(params_M=r["n_params"] / 1e6, step_ms=step * 1e3, spread_ms=(max(r["steps"]) - min(r["steps"])) * 1e3,
                timed_iterations=len(r["steps"]), tokens_per_s=1.0 / step, context=r["context"],
                kv_bytes_per_token=r["kv_bytes_per_token"], kernel_launches=r["kernels"], calls=r["calls"],
                attention=f"{r['kv_cache']} cache {r['kv_bytes_per_token']:,.0f} B/token, context {r['context']}")


def measure(kind: str, name: str, argv: list[str], warmup: int, window: int, device: torch.device,
            dry_run: bool) -> list[tuple[str, str, dict]]:
    """The (row name, row kind, measurement) rows of one ROWS entry."""
    if kind == "decode":
        return [(name, kind, run_decode(argv, device, dry_run))]
    if kind == "ours":
        return [(name, kind, run_ours(argv, warmup, device))]
    if kind == "vs-mcore":
        ours, theirs = run_vs_mcore(argv, warmup, window, device, dry_run)
        return [("ours: plain causal (SDPA), alternated with megatron-core", "ours-alternated", ours),
                (f"megatron-core 0.19.2 GPTModel, local spec, DDP + {theirs['megatron_core']['optimizer']}",
                 "megatron-core", theirs)]
    return [(name, kind, run_peer(argv, warmup, device, kind == "peer-compiled", dry_run))]


def figures(r: dict, mbs: int, seq: int, ceil: dict, device: torch.device) -> dict:
    """A row's measured columns: median step time and its spread, tokens/s, TFLOP/s, MFU, losses, memory."""
    step = statistics.median(r["steps"])
    flops = gpt_flops_per_iteration(r["config"].model, mbs)
    out = dict(params_M=r["n_params"] / 1e6, step_ms=step * 1e3, spread_ms=(max(r["steps"]) - min(r["steps"])) * 1e3,
               timed_iterations=len(r["steps"]), tokens_per_s=mbs * seq / step, TFLOPs=flops / step / 1e12,
               MFU_measured=flops / step / 1e12 / ceil["bf16_matmul_TFLOPs"], first_loss=r["loss"][0],
               last_loss=r["loss"][-1], peak_mem_GiB=dev.max_memory_allocated(device) / 2**30,
               log_line=r["log_line"], kernel_launches=r["kernels"], calls=r["calls"], compile=r.get("compile"),
               megatron_core=r.get("megatron_core"))
    if ceil.get("datasheet_bf16_TFLOPs"):
        out["MFU_datasheet"] = out["TFLOPs"] / ceil["datasheet_bf16_TFLOPs"]
    if r.get("error"):
        out["error"] = r["error"]
    return {k: v for k, v in out.items() if v is not None}


def describe_attention(r: dict, kind: str) -> str:
    if kind == "megatron-core":
        return "megatron-core's local DotProductAttention (unfused softmax)"
    k, c = r["kernels"], r["calls"]
    parts = [f"attend x{c['attend']}"] if c.get("attend") else []
    parts += [f"SDPA x{c['scaled_dot_product_attention']}"] if c.get("scaled_dot_product_attention") else []
    parts += [f"{name} x{n}" for name, n in sorted(k.items()) if "kernel" in name and not name.startswith("_en")
              and not name.startswith("_de")]
    text = ", ".join(parts) or "none counted"
    return text + " (one eager forward)" if kind.startswith("peer") else text


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_train", 150).parse_args(argv)
    device = pick_device(args.dry_run)
    budget = Budget(args.budget_s)
    seq, mbs, iters, warmup, window = (64, 2, 2, 1, 1) if args.dry_run else (2048, 4, 10, 3, 3)
    res = StepResults(args.out, "GPT training throughput: our Trainer vs a plain PyTorch loop", COLUMNS,
                      dry_run=args.dry_run, environment=environment(device), seq_length=seq, micro_batch=mbs,
                      iterations=iters, warmup_iterations=warmup,
                      goal="ours >= 0.9 of the compiled peer's tokens/s on plain causal; MFU reported per row")
    ceil = ceilings(args.out, device, args.dry_run)
    res.set(ceilings=ceil)
    tmp = tempfile.mkdtemp(prefix="megatron_cai_gpu_train_")
    ok = True
    try:
        data = os.path.join(tmp, "corpus")
        build_corpus(data, 2 * (max(iters, warmup + ALTERNATED_ROUNDS * window) + 2) * mbs * (seq + 1))
        peers: dict[str, float] = {}
        for name, model, kind, extra in ROWS:
            if args.dry_run and model != "350M":  # the toy run proves each kind of row once
                continue
            sizes = "toy" if args.dry_run else model
            need = 5.0 if args.dry_run else (40.0 if model == "1.3B" or kind in ("peer-compiled", "vs-mcore") else 20.0)
            if not budget.allows(need):
                res.skip(f"{name} {model}")
                continue
            row_iters = warmup + ALTERNATED_ROUNDS * window if kind == "vs-mcore" else iters
            argv_row = base_flags(sizes, seq, mbs, row_iters, data, args.dry_run) + extra
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                results = measure(kind, name, argv_row, warmup, window, device, args.dry_run)
            except Exception as e:  # recorded per row (out of memory, a compile failure, ...)
                res.add({"row": name, "model": model, "kind": kind, "flags": " ".join(extra),
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
                ok = ok and kind != "ours"
                continue
            finally:
                gc.collect()
                dev.empty_cache(device)
            for row_name, row_kind, r in results:
                row = {"row": row_name, "model": model, "kind": row_kind, "flags": " ".join(extra)}
                if row_kind == "decode":  # tokens/s of one sequence, one token per step
                    res.add({**row, **decode_figures(r)})
                    continue
                row.update(figures(r, mbs, seq, ceil, device))
                row.update(attention=describe_attention(r, row_kind))
                if row_kind == "peer-compiled" and not row.get("error"):  # a peer that recompiled is no reference
                    peers[model] = row["tokens_per_s"]
                    for other in res.payload["rows"]:  # ours measured before the peer of their model
                        if other.get("model") == model and other.get("tokens_per_s") and other["kind"] != row_kind:
                            other["vs_peer"] = other["tokens_per_s"] / peers[model]
                if model in peers:
                    row["vs_peer"] = row["tokens_per_s"] / peers[model]
                if r["log_line"]:
                    print("  " + r["log_line"], flush=True)
                res.add(row)
            if kind == "vs-mcore":  # ours over megatron-core's tokens/s, on both rows
                ours_row, mcore_row = res.payload["rows"][-2:]
                for r in (ours_row, mcore_row):
                    r["vs_megatron_core"] = ours_row["tokens_per_s"] / mcore_row["tokens_per_s"]
                res.set()
                print(f"  ours {ours_row['step_ms']:.1f} ms (spread {ours_row['spread_ms']:.1f}) vs megatron-core "
                      f"{mcore_row['step_ms']:.1f} ms (spread {mcore_row['spread_ms']:.1f}) per iteration, "
                      f"alternated: ours / megatron-core tokens/s {ours_row['vs_megatron_core']:.3f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res.finish(ok)


if __name__ == "__main__":
    raise SystemExit(main())

"""The training step's overheads, side by side (issue 27):

1. host reads per iteration (``Tensor.item`` / ``__bool__`` / ``tolist`` / ``cpu`` / ``numpy``, counted with
   megatron_cai.testing.host_sync) of the quickstart model in one process, and of a DP=2 Squinch --fp16 run;
2. the optimizer step of the quickstart model: PyTorch's fused AdamW (foreach-free ``torch._fused_adamw_``,
   this tree's DistributedAdamW) against the unfused update it replaced (six elementwise passes and a
   full-size temporary, kept below as ``unfused_adamw_step``), on the same buffers and gradients;
3. the quickstart model's training step with and without ``--compile`` (inductor on the CPU);
4. the quickstart model's training step (tokens/s) of this tree against a baseline tree (``--baseline-rev``,
   exported with ``git archive``, or ``--baseline-repo``), each timing window in a fresh process of its tree.

Each pair alternates (A B B A ...) over ``--repeats`` windows of ``--steps`` steps; figures are medians with
min-max and spread, and every part records the load average it ran at. Timings mean something only on a
quiet machine.

    python bench/step_overhead.py --baseline-rev daa14e1        # bench/results/step_overhead.{json,md}
    python bench/step_overhead.py --quick                       # every part at toy size (CI)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import harness as H
from harness import training
from harness.results import load_line

QUICKSTART = ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
              "--micro-batch-size", "4", "--global-batch-size", "8", "--vocab-size", "4096"]
TOY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "256"]
COMMON = ["--mock-data", "--position-embedding-type", "rope", "--lr", "1e-3", "--min-lr", "1e-4",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters", "0",
          "--num-workers", "0", "--no-exit-signal-handler", "--seed", "1234"]


def flags(model: list[str], iters: int, log_interval: int = 10**6, device: str = "cpu") -> list[str]:
    return model + COMMON + ["--train-iters", str(iters), "--log-interval", str(log_interval), "--device", device]


def timed(fn, steps: int, sync=lambda: None):
    """A window: ``steps`` calls of ``fn``; returns seconds per call. ``sync`` waits for queued device work
    (an accelerator's synchronize) before and after the window."""
    def window() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return (time.perf_counter() - t0) / steps
    return window


def pair(times: dict[str, list[float]], slow: str, fast: str) -> dict:
    """Medians with spread of each side, and the ratio of the medians (``slow`` / ``fast``)."""
    return {"seconds": {k: H.spread(v) for k, v in times.items()}, "windows": times,
            "ratio": statistics.median(times[slow]) / statistics.median(times[fast])}


# ------------------------------------------------------------------------------------- 1. host reads
def logs_at(iteration: int, log_interval: int) -> bool:
    """Megatron's rule: the first iteration and every ``log_interval``-th print the log line."""
    return iteration == 1 or iteration % log_interval == 0


def read_summary(counts: list[int], log_interval: int) -> dict:
    """The most reads in an iteration that does not log, and in one that logs (the last count, which also
    holds the end of the run, is left out)."""
    body = list(enumerate(counts[:-1], start=1))
    return {"per_iteration": counts, "log_interval": log_interval,
            "max_non_logging": max(c for i, c in body if not logs_at(i, log_interval)),
            "max_logging": max((c for i, c in body if logs_at(i, log_interval)), default=None)}


def count_reads(argv: list[str], world_size: int = 1) -> list[int]:
    """Host reads in each iteration of a run of these flags (the last one's count includes the run's end)."""
    from megatron_cai.testing.host_sync import HostSyncCounter

    counter, per_iteration = HostSyncCounter(), []
    trainer = training.build_trainer(argv, world_size)
    before_step = trainer.profiler.before_step

    def counting(iteration):  # the loop calls it first thing in every iteration
        if iteration > 0:
            per_iteration.append(counter.total())
        counter.reset()
        before_step(iteration)

    trainer.profiler.before_step = counting
    counter.install()
    try:
        trainer.train()
    finally:
        counter.uninstall()
    per_iteration.append(counter.total())
    return per_iteration


def _count_rank(rank: int, world_size: int, argv: list[str]) -> list[int]:
    return count_reads(argv, world_size)


def read_counts(model: list[str], iters: int, log_interval: int) -> dict:
    """Reads per iteration: the model alone (fp32, one process) and at DP=2 with Squinch and --fp16 (toy model:
    the counts do not depend on the size)."""
    from megatron_cai.testing.distributed import run_distributed

    single = count_reads(flags(model, iters, log_interval))
    dp2 = run_distributed(_count_rank, 2, (flags(TOY, iters, log_interval) + ["--squinch", "--fp16"],))[0]
    return {"single": read_summary(single, log_interval), "dp2_squinch_fp16": read_summary(dp2, log_interval)}


# --------------------------------------------------------------------------------- 2. optimizer step
def unfused_adamw_step(opt, lr: float) -> None:
    """The update DistributedAdamW made before the fused kernel (issue 27's "today"), on its own buffers:
    decay per run, then lerp, mul + addcmul, sqrt / div / add into a full-size temporary, addcdiv."""
    import torch

    opt.step_count += 1
    b1, b2 = opt.betas
    bc1, bc2_sqrt = 1 - b1 ** opt.step_count, math.sqrt(1 - b2 ** opt.step_count)
    with torch.no_grad():
        for chunk_list in opt.chunks:
            for c in chunk_list:
                for s, e, _decoupled, decay in c.runs:
                    if decay and opt.weight_decay:
                        c.param[s:e].mul_(1 - lr * opt.weight_decay)
                c.exp_avg.lerp_(c.grad, 1 - b1)
                c.exp_avg_sq.mul_(b2).addcmul_(c.grad, c.grad, value=1 - b2)
                denom = (c.exp_avg_sq.sqrt() / bc2_sqrt).add_(opt.eps)
                c.param.addcdiv_(c.exp_avg, denom, value=-lr / bc1)


def optimizer_times(argv: list[str], repeats: int, steps: int, sync=lambda: None) -> dict:
    """Seconds per optimizer step, fused (this tree) against unfused, on the same buffers and gradients of the
    model of these flags."""
    import torch

    trainer = training.build_trainer(argv)
    trainer.train_step()  # real gradients in the buffers
    opt = trainer.optimizer
    elements = sum(c.hi - c.lo for chunk_list in opt.chunks for c in chunk_list)
    steps_of = {"unfused": lambda: unfused_adamw_step(opt, 1e-3), "fused": lambda: opt.step(1e-3, 1e-3)}
    for fn in steps_of.values():  # warm up both
        fn()
    times = H.alternate({k: timed(fn, steps, sync) for k, fn in steps_of.items()}, repeats, mirror=True)
    return {"elements": elements, "threads": torch.get_num_threads(), **pair(times, "unfused", "fused")}


# ------------------------------------------------------------------------------------- 3. --compile
def compile_times(model: list[str], repeats: int, steps: int, backend: str) -> dict:
    """Seconds per training step with and without --compile (two Trainers, alternating windows).

    ``backend`` "inductor" is ``--compile``; another (--quick: "aot_eager", no code generation) compiles the
    same layers in place with that backend."""
    from megatron_cai.core.transformer.compile import compile_transformer_layers

    argv = flags(model, 10**6)
    eager = training.build_trainer(argv)
    if backend == "inductor":
        compiled = training.build_trainer(argv + ["--compile"])
    else:
        compiled = training.build_trainer(argv)
        compile_transformer_layers(training.core_model(compiled), backend=backend)
    t0 = time.perf_counter()
    compiled.train_step()  # compiles (inductor: C++ on the CPU)
    first_s = time.perf_counter() - t0
    eager.train_step()
    tokens = eager.config.training.global_batch_size * eager.config.model.seq_length
    times = H.alternate({"eager": timed(eager.train_step, steps), "compiled": timed(compiled.train_step, steps)},
                        repeats, mirror=True)
    res = pair(times, "eager", "compiled")
    return {"backend": backend, "tokens_per_step": tokens, "first_compiled_step_s": first_s,
            "tokens_per_s": {k: tokens / v["median"] for k, v in res["seconds"].items()}, **res}


# ------------------------------------------------------------------ 4. this tree vs a baseline tree
def window(model: list[str], steps: int, warmup: int) -> dict:
    """One timing window in this process: ``warmup`` steps, then ``steps`` timed steps."""
    import megatron_cai

    trainer = training.build_trainer(flags(model, warmup + steps + 1))
    for _ in range(warmup):
        trainer.train_step()
    seconds = timed(trainer.train_step, steps)()
    tokens = trainer.config.training.global_batch_size * trainer.config.model.seq_length
    return {"seconds_per_step": seconds, "tokens_per_s": tokens / seconds, "package": megatron_cai.__file__}


def _worker(repo: str, model: list[str], steps: int, warmup: int) -> dict:
    """:func:`window` in a fresh process that imports ``repo``'s package; its result."""
    env = {**os.environ, "PYTHONPATH": repo}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--repo", repo, "--model", json.dumps(model),
           "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"window in {repo} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["package"].startswith(os.path.realpath(repo)):
        raise RuntimeError(f"the window for {repo} imported {res['package']}")
    return res


def export_rev(rev: str, cache: str) -> str:
    """The tree of git revision ``rev`` of this checkout, exported once into ``cache`` (``git archive``)."""
    sha = subprocess.run(["git", "-C", H.ROOT, "rev-parse", "--verify", rev + "^{commit}"], capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise SystemExit(f"error: --baseline-rev {rev}: not a commit of {H.ROOT}")
    dest = os.path.join(cache, "baseline-" + sha.stdout.strip()[:12])
    if not os.path.exists(os.path.join(dest, "pretrain_gpt.py")):
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.Popen(["git", "-C", H.ROOT, "archive", sha.stdout.strip()], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"error: --baseline-rev {rev}: git archive failed")
    return os.path.realpath(dest)


def baseline_comparison(baseline: str, label: str, model: list[str], repeats: int, steps: int,
                        warmup: int) -> dict:
    trees = {"baseline": baseline, "this": os.path.realpath(H.ROOT)}
    runs = H.alternate({k: (lambda repo=repo: _worker(repo, model, steps, warmup)) for k, repo in trees.items()},
                       repeats, mirror=True)
    tps = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
    return {"trees": trees, "baseline_label": label, "tokens_per_s": {k: H.spread(v) for k, v in tps.items()},
            "windows": tps, "ratio": statistics.median(tps["this"]) / statistics.median(tps["baseline"])}


# ------------------------------------------------------------------------------------------ report
def _row(name: str, s: dict, scale: float) -> str:
    return (f"| {name} | {s['median'] * scale:.3f} | {s['min'] * scale:.3f}-{s['max'] * scale:.3f} | "
            f"{100 * s['spread']:.1f}% |")


def render(payload: dict) -> str:
    s, rows, meta = payload["settings"], payload["rows"], payload.get("row_load", {})
    quick = " (QUICK: toy sizes, not a measurement)" if s["quick"] else ""
    lines = ["# Training-step overheads (issue 27)", "",
             f"torch {s['torch']}, {s['threads']} threads, CPU, fp32; model {' '.join(s['model'])}; "
             f"{s['repeats']} alternated windows (A B B A ...) of {s['steps']} steps per pair{quick}.", ""]

    def load(key):
        return f" (load average {meta[key]})" if key in meta else ""

    r = rows["reads"]
    lines += [f"## Host reads per iteration (item / __bool__ / tolist / cpu / numpy){load('reads')}", "",
              f"Log interval {r['single']['log_interval']}; iteration 1 logs too (Megatron's first log line).", "",
              "| run | max, iterations that do not log | max, logging iterations |", "|---|---|---|"]
    for name, c in r.items():
        lines.append(f"| {name} | {c['max_non_logging']} | {c['max_logging']} |")
    o = rows["optimizer"]
    lines += ["", f"## Optimizer step ({o['elements']:,} owned elements, {o['threads']} threads){load('optimizer')}",
              "", "| update | median ms | min-max ms | spread |", "|---|---|---|---|"]
    lines += [_row(k, v, 1e3) for k, v in o["seconds"].items()]
    lines.append(f"\nunfused / fused time (fused speed-up): {o['ratio']:.2f}x")
    c = rows["compile"]
    lines += ["", f"## Training step with and without --compile ({c['backend']}; {c['tokens_per_step']} tokens per "
              f"step; first compiled step {c['first_compiled_step_s']:.1f} s){load('compile')}", "",
              "| step | median s | min-max s | spread |", "|---|---|---|---|"]
    lines += [_row(k, v, 1.0) for k, v in c["seconds"].items()]
    lines.append("\n" + ", ".join(f"{k} {v:.0f} tokens/s" for k, v in c["tokens_per_s"].items())
                 + f"; eager / compiled time (compile speed-up): {c['ratio']:.3f}x")
    b = rows.get("baseline")
    if b:
        lines += ["", f"## This tree vs {b['baseline_label']} (training step, tokens/s; each window a fresh "
                  f"process){load('baseline')}", "", "| tree | median tokens/s | min-max | spread |",
                  "|---|---|---|---|"]
        for k, v in b["tokens_per_s"].items():
            lines.append(f"| {k} | {v['median']:.0f} | {v['min']:.0f}-{v['max']:.0f} | {100 * v['spread']:.1f}% |")
        lines.append(f"\nthis / baseline tokens/s: {b['ratio']:.3f}")
    if "machine" in payload:
        lines += ["", f"Machine: {load_line(payload['machine']['start'])} at the start, "
                  f"{load_line(payload['machine']['end'])} at the end."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "step_overhead")
    H.add(p, repeats=7, steps=5)
    p.add_argument("--optimizer-steps", type=int, default=20, help="optimizer steps per window")
    p.add_argument("--sync-iters", type=int, default=20, help="iterations of the host-read count")
    p.add_argument("--log-interval", type=int, default=10, help="log interval of the host-read count")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of part 3 (inductor: --compile; --quick: aot_eager)")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline-rev", default=None, help="git revision of this checkout to compare with")
    base.add_argument("--baseline-repo", default=None, help="another checkout to compare with")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each baseline window")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repo", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    opts = H.parse(p, argv, quick=dict(repeats=1, steps=1, optimizer_steps=2, sync_iters=5, log_interval=2,
                                       compile_backend="aot_eager", warmup=1))
    if opts.worker:  # one baseline window, in the tree of --repo (first on sys.path)
        sys.path.insert(0, opts.repo)
        print(json.dumps(window(json.loads(opts.model), opts.steps, opts.warmup)), flush=True)
        return
    import torch

    model = TOY if opts.quick else QUICKSTART
    settings = {"quick": opts.quick, "model": model, "repeats": opts.repeats, "steps": opts.steps,
                "optimizer_steps": opts.optimizer_steps, "sync_iters": opts.sync_iters,
                "log_interval": opts.log_interval, "compile_backend": opts.compile_backend,
                "baseline": opts.baseline_rev or opts.baseline_repo, "torch": torch.__version__,
                "threads": torch.get_num_threads()}
    out = H.Results(opts.out, settings)
    if opts.from_json:
        out.rewrite(render)
        return
    print(f"load average {H.machine()['load_average']}", flush=True)
    rows = {"reads": out.row("reads", lambda: read_counts(model, opts.sync_iters, opts.log_interval))}
    rows["optimizer"] = out.row("optimizer", lambda: optimizer_times(flags(model, 10), opts.repeats,
                                                                     opts.optimizer_steps))
    print(f"optimizer unfused / fused: {rows['optimizer']['ratio']:.2f}x", flush=True)
    rows["compile"] = out.row("compile", lambda: compile_times(model, opts.repeats, opts.steps, opts.compile_backend))
    print(f"--compile eager / compiled: {rows['compile']['ratio']:.3f}x", flush=True)
    baseline, label = None, None
    if opts.baseline_rev:
        baseline, label = export_rev(opts.baseline_rev, opts.cache_dir), f"`{opts.baseline_rev}`"
    elif opts.baseline_repo:
        baseline, label = os.path.realpath(opts.baseline_repo), opts.baseline_repo
    elif opts.quick:  # the path runs; the tree against itself
        baseline, label = os.path.realpath(H.ROOT), "this tree itself (--quick)"
    if baseline:
        rows["baseline"] = out.row("baseline", lambda: baseline_comparison(baseline, label, model, opts.repeats,
                                                                           opts.steps, opts.warmup))
        print(f"this / baseline tokens/s: {rows['baseline']['ratio']:.3f}", flush=True)
    out.write({"settings": settings, "rows": rows,
               "row_load": {k: v["load_average"] for k, v in out.meta.items() if k in rows}}, render)


if __name__ == "__main__":
    main()

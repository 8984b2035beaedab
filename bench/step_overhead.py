"""The training step's overheads, side by side (issue 27):

1. host reads per iteration (``Tensor.item`` / ``__bool__`` / ``tolist`` / ``cpu`` / ``numpy``, counted with
   megatron_cai.testing.host_sync) of the quickstart model, and of a DP=2 Squinch --fp16 run, in this tree
   and, with ``--baseline-repo``, in another checkout (each run in its own process);
2. the optimizer step of the quickstart model: PyTorch's fused AdamW (this tree's DistributedAdamW) against
   the unfused update it replaced (six elementwise passes and a full-size temporary, kept below as
   ``unfused_adamw_step``), alternating windows on the same buffers;
3. the training step with and without ``--compile`` (inductor on the CPU) for the quickstart model, two
   Trainers in one process, alternating windows;
4. with ``--baseline-repo DIR``: the quickstart model's training step (tokens/s) of this tree against that
   checkout's, alternating windows, each window in a fresh process of its tree.

Timings are medians over alternating windows, with their spread, and the load average at the time; they
mean something only on a quiet machine.

    python bench/step_overhead.py --quick                       # toy sizes, a few minutes; --out /tmp/...
    python bench/step_overhead.py --baseline-repo /path/to/old  # writes bench/results/step_overhead.*
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUICKSTART = ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
              "--micro-batch-size", "8", "--global-batch-size", "8", "--vocab-size", "4096"]
TOY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
       "--micro-batch-size", "4", "--global-batch-size", "4", "--vocab-size", "512"]
COMMON = ["--mock-data", "--position-embedding-type", "rope", "--lr", "1e-3", "--min-lr", "1e-4",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters", "0",
          "--num-workers", "0", "--no-exit-signal-handler", "--seed", "1234"]
SYNC_ITERS, SYNC_LOG = 20, 10


def flags(model: list[str], iters: int, log_interval: int = 10**6) -> list[str]:
    return model + COMMON + ["--train-iters", str(iters), "--log-interval", str(log_interval)]


def build_trainer(argv: list[str]):
    """A single-process Trainer for these flags (whichever tree is first on sys.path)."""
    import pretrain_gpt
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.training.training import Trainer

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    return Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def alternate(fns: dict, rounds: int, reps: int, sync=lambda: None) -> dict[str, list[float]]:
    """Seconds per call of each function, ``rounds`` alternating windows of ``reps`` calls each; ``sync``
    waits for queued device work (an accelerator's synchronize) before and after each window."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / reps)
    return times


# ------------------------------------------------------------------------------------- 1. host reads
def _host_sync_counter():
    """This tree's counter, loaded by path (a baseline worker imports the other tree's package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_host_sync", os.path.join(ROOT, "megatron_cai", "testing",
                                                                               "host_sync.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.HostSyncCounter()


def read_summary(counts: list[int], log_interval: int = SYNC_LOG) -> dict:
    """The most reads in an iteration that does not log, and in one that logs (the last count, which also
    holds the end of the run, is left out)."""
    steady = [c for i, c in enumerate(counts[:-1], start=1) if i % log_interval]
    logging = [c for i, c in enumerate(counts[:-1], start=1) if i % log_interval == 0]
    return {"per_iteration": counts, "max_non_logging": max(steady), "max_logging": max(logging, default=None)}


def count_reads(argv: list[str], world_size: int = 1) -> list[int]:
    """Host reads in each iteration of a run of these flags (the last one's count includes the run's end)."""
    counter, per_iteration = _host_sync_counter(), []
    trainer = build_trainer(argv) if world_size == 1 else _distributed_trainer(argv, world_size)
    before_step = trainer.profiler.before_step

    def counting(iteration):
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


def _distributed_trainer(argv: list[str], world_size: int):
    import pretrain_gpt
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
    return Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)


def _count_rank(rank: int, world_size: int, argv: list[str]) -> list[int]:
    return count_reads(argv, world_size)


def read_counts(model: list[str]) -> dict:
    """Reads per iteration: the model alone (fp32, one process) and at DP=2 with Squinch and --fp16 (toy)."""
    from megatron_cai.testing.distributed import run_distributed

    single = count_reads(flags(model, SYNC_ITERS, SYNC_LOG))
    # the counts do not depend on the model's size: the DP=2 run uses the toy model
    dp2 = run_distributed(_count_rank, 2, (flags(TOY, SYNC_ITERS, SYNC_LOG) + ["--squinch", "--fp16"],))[0]
    return {"single": read_summary(single), "dp2_squinch_fp16": read_summary(dp2)}


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


def optimizer_times(argv: list[str], rounds: int, reps: int, sync=lambda: None) -> dict:
    """Seconds per optimizer step, fused (this tree) vs unfused, on the same model's buffers and gradients."""
    import torch

    trainer = build_trainer(argv)
    trainer.train_step()  # real gradients in the buffers
    opt = trainer.optimizer
    n = sum(c.hi - c.lo for chunk_list in opt.chunks for c in chunk_list)
    times = alternate({"unfused": lambda: unfused_adamw_step(opt, 1e-3), "fused": lambda: opt.step(1e-3, 1e-3)},
                      rounds, reps, sync)
    return {"elements": n, "threads": torch.get_num_threads(), "seconds": {k: spread(v) for k, v in times.items()},
            "speedup": statistics.median(times["unfused"]) / statistics.median(times["fused"]), "rounds": times}


# ------------------------------------------------------------------------------------- 3. --compile
def compile_times(argv: list[str], rounds: int, reps: int) -> dict:
    """Seconds per training step with and without --compile (two Trainers, alternating windows)."""
    eager = build_trainer(argv)
    compiled = build_trainer(argv + ["--compile"])
    t0 = time.perf_counter()
    compiled.train_step()  # compiles (inductor's C++ on the CPU)
    compile_s = time.perf_counter() - t0
    eager.train_step()
    tokens = eager.config.training.global_batch_size * eager.config.model.seq_length
    times = alternate({"eager": eager.train_step, "compiled": compiled.train_step}, rounds, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens_per_step": tokens, "first_compiled_step_s": compile_s,
            "seconds": {k: spread(v) for k, v in times.items()},
            "tokens_per_s": {k: tokens / v for k, v in med.items()}, "speedup": med["eager"] / med["compiled"],
            "rounds": times}


# ------------------------------------------------------------------ 4. this tree vs a baseline checkout
def window(argv: list[str], steps: int, warmup: int) -> dict:
    """One timing window in this process: ``warmup`` steps, then ``steps`` timed steps."""
    trainer = build_trainer(argv)
    for _ in range(warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = (time.perf_counter() - t0) / steps
    tokens = trainer.config.training.global_batch_size * trainer.config.model.seq_length
    return {"seconds_per_step": seconds, "tokens_per_s": tokens / seconds}


def _worker(repo: str, task: str, args: list[str]) -> dict:
    """Run ``task`` of this file in a fresh process importing ``repo``'s package; its JSON result."""
    env = {**os.environ, "PYTHONPATH": repo}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", task, "--repo", repo, *args],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"worker {task} in {repo} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_comparison(baseline: str, model: list[str], rounds: int, steps: int, warmup: int) -> dict:
    trees = {"baseline": os.path.abspath(baseline), "this": ROOT}
    tps: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(rounds):
        for name, repo in trees.items():
            tps[name].append(_worker(repo, "window", ["--model", json.dumps(model), "--steps", str(steps),
                                                      "--warmup", str(warmup)])["tokens_per_s"])
    reads = {name: _worker(repo, "reads", ["--model", json.dumps(model)]) for name, repo in trees.items()}
    return {"trees": trees, "tokens_per_s": {k: spread(v) for k, v in tps.items()},
            "ratio": statistics.median(tps["this"]) / statistics.median(tps["baseline"]), "rounds": tps,
            "reads": reads}


# ------------------------------------------------------------------------------------------ report
def report(res: dict) -> str:
    lines = ["# Training-step overheads (issue 27)", "",
             f"{res['environment']}; load average {res['load_avg_before']} before, {res['load_avg_after']} "
             f"after{' (QUICK: toy sizes, not a measurement)' if res['quick'] else ''}.", "",
             "## Host reads per iteration (item / __bool__ / tolist / cpu / numpy)", "",
             "| run | max, iterations that do not log | max, logging iterations |", "|---|---|---|"]
    for name, r in res["reads"].items():
        lines.append(f"| {name} | {r['max_non_logging']} | {r['max_logging']} |")
    o = res["optimizer"]
    lines += ["", f"## Optimizer step ({o['elements']:,} owned elements, {o['threads']} threads)", "",
              "| update | median ms | min-max ms |", "|---|---|---|"]
    for k, v in o["seconds"].items():
        lines.append(f"| {k} | {v['median'] * 1e3:.2f} | {v['min'] * 1e3:.2f}-{v['max'] * 1e3:.2f} |")
    lines.append(f"\nfused / unfused speed-up: {o['speedup']:.2f}x (median of {len(o['rounds']['fused'])} windows)")
    c = res["compile"]
    lines += ["", f"## Training step with and without --compile ({c['tokens_per_step']} tokens per step; first "
              f"compiled step {c['first_compiled_step_s']:.0f} s)", "",
              "| step | median s | min-max s | tokens/s |", "|---|---|---|---|"]
    for k, v in c["seconds"].items():
        lines.append(f"| {k} | {v['median']:.3f} | {v['min']:.3f}-{v['max']:.3f} | {c['tokens_per_s'][k]:.0f} |")
    lines.append(f"\ncompiled / eager speed-up: {c['speedup']:.3f}x")
    b = res.get("baseline")
    if b:
        lines += ["", f"## This tree vs {b['trees']['baseline']} (quickstart step, tokens/s)", "",
                  "| tree | median tokens/s | min-max | host reads, non-logging / logging |", "|---|---|---|---|"]
        for k, v in b["tokens_per_s"].items():
            r = b["reads"][k]
            lines.append(f"| {k} | {v['median']:.0f} | {v['min']:.0f}-{v['max']:.0f} | {r['max_non_logging']} / "
                         f"{r['max_logging']} |")
        lines.append(f"\nthis / baseline: {b['ratio']:.3f}")
    return "\n".join(lines) + "\n"


def run_worker(task: str, opts) -> None:
    sys.path.insert(0, opts.repo)
    model = json.loads(opts.model)
    if task == "window":
        result = window(flags(model, opts.warmup + opts.steps + 1), opts.steps, opts.warmup)
    else:  # reads: one process, fp32 (the baseline's counts, or ours)
        result = read_summary(count_reads(flags(model, SYNC_ITERS, SYNC_LOG)))
    print(json.dumps(result), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="toy sizes and few windows (checks that it runs)")
    p.add_argument("--baseline-repo", default=None, help="another checkout to compare the quickstart step with")
    p.add_argument("--rounds", type=int, default=None, help="alternating windows (default 7; 2 with --quick)")
    p.add_argument("--out", default=None, help="output prefix (default bench/results/step_overhead; "
                                                "/tmp/step_overhead_quick with --quick)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--repo", default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        return run_worker(opts.worker, opts)
    sys.path.insert(0, ROOT)
    import torch

    model = TOY if opts.quick else QUICKSTART
    rounds = opts.rounds or (2 if opts.quick else 7)
    out = opts.out or ("/tmp/step_overhead_quick" if opts.quick else os.path.join(ROOT, "bench", "results",
                                                                                  "step_overhead"))
    res = {"quick": opts.quick, "model": model, "load_avg_before": load_avg(),
           "environment": f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp32"}
    print(f"load average {res['load_avg_before']}", flush=True)
    res["reads"] = read_counts(model)
    print(f"host reads: {res['reads']}", flush=True)
    res["optimizer"] = optimizer_times(flags(model, 10), rounds, 3 if opts.quick else 10)
    print(f"optimizer fused / unfused: {res['optimizer']['speedup']:.2f}x", flush=True)
    res["compile"] = compile_times(flags(model, 10**6), rounds, 2 if opts.quick else 5)
    print(f"--compile: {res['compile']['speedup']:.3f}x", flush=True)
    if opts.baseline_repo:
        res["baseline"] = baseline_comparison(opts.baseline_repo, model, rounds, 2 if opts.quick else 5,
                                              1 if opts.quick else 2)
        print(f"this / baseline tokens/s: {res['baseline']['ratio']:.3f}", flush=True)
    res["load_avg_after"] = load_avg()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    text = report(res)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

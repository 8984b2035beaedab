"""Checkpoint save / load time, bytes and the training stall per save: sync against --async-save, per format.

For three GPT sizes (one CPU process, fp32, Adam: the checkpoint holds about 12 bytes per parameter) a
Trainer trains a few iterations, then saves repeatedly, sync and async alternating (one warm-up save of
each first, not counted: the async staging buffers are allocated by the first save and reused after).

- sync: ``Trainer.save()`` writes and makes the checkpoint current; the save time is the stall.
- async (``--async-save``): ``Trainer.save()`` stages (the collective part, then a copy of every tensor
  into the reused CPU staging buffers) and returns; training goes on, calling the non-blocking finalize
  after each iteration as the training loop does. **stall** = the time blocked in ``save()`` plus in the
  finalize calls; **save time** = from the call of ``save()`` to the checkpoint being current (the writer
  thread's end, plus the finalize that renames it and moves the tracker). **step slowdown** = the mean
  iteration time while the write is in flight over the mean iteration time without a save (the writer
  thread shares the CPU and the GIL with training).
- load: ``Checkpointer.load`` of the checkpoint just written, into the same model (page cache warm).
- bytes: the size of the ``iter_XXXXXXX`` directory.
- content hashes (``training/checkpoint/integrity.py``): every file is hashed as it is written. **hash
  cost** = the sync save time with hashing over the sync save time with the hash computation replaced by
  a no-op (``sync-nohash``, alternated with the others); **verify** = the load-time check of every file
  against its hash (``verify_checkpoint``), shown as a fraction of the sync save time. Issue 28's bound:
  both at most 5% at the largest size (timings need a quiet machine: the load average is recorded).

Each figure is the median over the repeats with min-max. torch_dist (``--ckpt-format torch_dist``, DCP)
is measured when this build implements it; otherwise its rows say "not available".

    python bench/checkpoint.py [--quick] [--repeats 3] [--out bench/results/checkpoint]
"""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time

import harness as H

SIZES = {  # name: (layers, hidden, heads)
    "small": (4, 256, 4),
    "medium": (8, 512, 8),
    "large": (8, 768, 12),
}
QUICK_SIZES = {"tiny": (1, 32, 2)}
FORMATS = ("torch", "torch_dist")
VOCAB = 4096


def _argv(layers: int, hidden: int, heads: int, fmt: str, save: str) -> list[str]:
    return ["--squared-relu",
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "100000", "--lr", "1e-4", "--lr-decay-style", "constant",
            "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1000000", "--eval-interval", "0",
            "--eval-iters", "0", "--device", "cpu", "--num-workers", "0", "--no-exit-signal-handler",
            "--position-embedding-type", "rope", "--ckpt-format", fmt, "--save", save]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


class Session:
    """One Trainer; saves sync or async at successive iterations and times them."""

    def __init__(self, argv: list[str], save: str) -> None:
        from harness.training import build_trainer

        from megatron_cai.training.checkpoint import AsyncCheckpointSaver

        self.trainer = build_trainer(argv)
        self.save_root = save
        self.saver = AsyncCheckpointSaver(self.trainer.device)
        self.params = sum(p.numel() for m in self.trainer.model for p in m.module.parameters())
        self.step()
        self.base_step = statistics.median(self.step() for _ in range(3))

    def step(self) -> float:
        t = time.perf_counter()
        self.trainer.train_step()
        self.trainer.state.iteration += 1
        return time.perf_counter() - t

    def _clear_old(self, keep: int) -> None:
        for d in os.listdir(self.save_root):
            if d.startswith("iter_") and d != f"iter_{keep:07d}":
                shutil.rmtree(os.path.join(self.save_root, d))

    def save_sync(self, hashing: bool = True) -> dict:
        self.trainer.checkpointer.async_saver = None
        self.step()
        with _hashes(hashing):
            t = time.perf_counter()
            self.trainer.save()
            save_s = time.perf_counter() - t
        return {"save_s": save_s, "stall_s": save_s, **self._after_save(self.trainer.state.iteration, hashing)}

    def save_async(self) -> dict:
        tr = self.trainer
        tr.checkpointer.async_saver = self.saver
        self.step()
        t0 = time.perf_counter()
        tr.save()
        stall = time.perf_counter() - t0
        job = self.saver.in_flight
        steps = []
        while self.saver.in_flight is not None:
            steps.append(self.step())
            t = time.perf_counter()
            tr.finalize_async_save(blocking=False)
            stall += time.perf_counter() - t
        done_at = time.perf_counter()
        finalize_s = done_at - t  # the last finalize: agreement, rename, tracker
        save_s = (job.finished - t0) + finalize_s
        slow = statistics.mean(steps) / self.base_step if steps else None
        return {"save_s": save_s, "stall_s": stall, "steps_during_write": len(steps), "step_slowdown": slow,
                **self._after_save(job.iteration)}

    def _after_save(self, it: int, hashing: bool = True) -> dict:
        from megatron_cai.training.checkpoint import iteration_dir, read_tracker, verify_checkpoint

        tr = self.trainer
        assert read_tracker(self.save_root) == it
        nbytes = _dir_bytes(iteration_dir(self.save_root, it))
        out = {"bytes": nbytes, "load_s": None, "verify_s": None}
        if hashing:  # a save without hashes records placeholder ones: it is neither loaded nor verified
            t = time.perf_counter()
            verify_checkpoint(self.save_root, it)
            out["verify_s"] = time.perf_counter() - t
            t = time.perf_counter()
            tr.checkpointer.load([m.reducer for m in tr.model], root=self.save_root, step=it)
            out["load_s"] = time.perf_counter() - t
        self._clear_old(it)
        return out


class _NoHash:
    """A hasher that computes nothing: what a save costs without content hashes."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0"


@contextlib.contextmanager
def _hashes(on: bool):
    """Content hashing as it is (``on``), or its computation replaced by :class:`_NoHash`."""
    from megatron_cai.training.checkpoint import ALGORITHMS, DEFAULT_ALGORITHM

    real = ALGORITHMS[DEFAULT_ALGORITHM]
    if not on:
        ALGORITHMS[DEFAULT_ALGORITHM] = _NoHash
    try:
        yield
    finally:
        ALGORITHMS[DEFAULT_ALGORITHM] = real


def _summary(values: list[float]) -> dict:
    return {k: v for k, v in H.spread(values).items() if k != "spread"}


def _format_available(fmt: str, work: str) -> str | None:
    import pretrain_gpt

    try:
        pretrain_gpt.build_run(_argv(1, 32, 2, fmt, os.path.join(work, "probe")), world_size=1)
    except Exception as e:  # noqa: BLE001 - the refusal says why
        return str(e).splitlines()[0]
    return None


def measure_format(name: str, size: tuple[int, int, int], fmt: str, repeats: int, work: str) -> dict:
    """One size and format: sync and async saves alternating (mirrored order), after a warm-up of each."""
    save = os.path.join(work, name, fmt)
    shutil.rmtree(save, ignore_errors=True)
    s = Session(_argv(*size, fmt, save), save)
    s.save_sync(), s.save_async(), s.save_sync(False)  # warm-up: allocations, staging buffers, page cache
    runs = H.alternate({"sync": s.save_sync, "sync-nohash": lambda: s.save_sync(False), "async": s.save_async},
                       repeats, mirror=True)
    for mode, rs in runs.items():
        for r, run in enumerate(rs):
            print(f"{name} {fmt} {mode} repeat {r}: {run}", flush=True)
    shutil.rmtree(save, ignore_errors=True)
    modes = {mode: {"runs": rs, **{k: _summary([x.get(k) for x in rs])
                                   for k in ("save_s", "stall_s", "load_s", "bytes", "step_slowdown", "verify_s")}}
             for mode, rs in runs.items()}
    pairs = zip(runs["sync"], runs["sync-nohash"])  # repeat by repeat, as they alternated
    modes["hash_cost"] = _summary([a["save_s"] / b["save_s"] - 1 for a, b in pairs])
    modes["verify_over_save"] = _summary([a["verify_s"] / a["save_s"] for a in runs["sync"]])
    return {"params": s.params, "base_step_s": s.base_step, "modes": modes}


def measure(sizes: dict, repeats: int, out: H.Results, work: str) -> dict:
    results = {"repeats": repeats, "sizes": {}, "unavailable": {}, "cpus": os.cpu_count(),
               "load_average_start": os.getloadavg()}
    for fmt in FORMATS:
        why = _format_available(fmt, work)
        if why:
            results["unavailable"][fmt] = why
    for name, (layers, hidden, heads) in sizes.items():
        entry = results["sizes"][name] = {"layers": layers, "hidden": hidden, "heads": heads, "formats": {}}
        for fmt in FORMATS:
            if fmt in results["unavailable"]:
                continue
            row = out.row(f"{name}|{fmt}", lambda name=name, fmt=fmt, size=(layers, hidden, heads):
                          measure_format(name, size, fmt, repeats, work))
            entry["params"], entry["base_step_s"] = row["params"], row["base_step_s"]
            entry["formats"][fmt] = row["modes"]
    results["load_average_end"] = os.getloadavg()
    return results


def _fmt(summary: dict, scale: float = 1.0, unit: str = "s", digits: int = 3) -> str:
    if summary["median"] is None:
        return "-"
    return (f"{summary['median'] * scale:.{digits}f} {unit} ({summary['min'] * scale:.{digits}f}-"
            f"{summary['max'] * scale:.{digits}f})")


def markdown(results: dict) -> str:
    lines = ["# Checkpoint save / load: sync vs --async-save, torch vs torch_dist", "",
             "Generated by `bench/checkpoint.py`. One CPU process (fp32 GPT, Adam), median over "
             f"{results['repeats']} repeats (min-max), sync and async alternating, after one warm-up save of each. "
             f"{results['cpus']} CPUs, shared: load average {results['load_average_start'][0]:.1f} at the start, "
             f"{results['load_average_end'][0]:.1f} at the end (1-minute).",
             "Stall: the time the training loop is blocked per save. Save time: from `save()` to the "
             "checkpoint being current (tracker moved). Step slowdown: mean iteration time while the async "
             "write is in flight / without a save. Load: into the same model, page cache warm.", ""]
    for fmt, why in results["unavailable"].items():
        lines.append(f"- `{fmt}`: not available in this build ({why})")
    lines += ["", "| size | params | format | mode | save time | stall | stall / sync save | load | bytes "
              "| step slowdown |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results["sizes"].items():
        for fmt in FORMATS:
            if fmt not in e["formats"]:
                lines.append(f"| {name} | {e.get('params', 0) / 1e6:.1f} M | {fmt} | - | not available | | | | | |")
                continue
            sync_save = e["formats"][fmt]["sync"]["save_s"]["median"]
            for mode in ("sync", "async"):
                m = e["formats"][fmt][mode]  # sync-nohash: in the content-hash table below
                ratio = m["stall_s"]["median"] / sync_save
                slow = "-" if mode == "sync" else f"{m['step_slowdown']['median']:.2f}x"
                lines.append(f"| {name} | {e['params'] / 1e6:.1f} M | {fmt} | {mode} | {_fmt(m['save_s'])} | "
                             f"{_fmt(m['stall_s'])} | {ratio:.1%} | {_fmt(m['load_s'])} | "
                             f"{m['bytes']['median'] / 1e6:.1f} MB | {slow} |")
    lines += ["", "## Content hashes (issue 28: at most 5% of the save time at the largest size)", "",
              "| size | format | sync save | sync save, hash computation off | hash cost | verify | verify / save |",
              "|---|---|---|---|---|---|---|"]
    for name, e in results["sizes"].items():
        for fmt, f in e["formats"].items():
            if "hash_cost" not in f:
                continue
            lines.append(f"| {name} | {fmt} | {_fmt(f['sync']['save_s'])} | {_fmt(f['sync-nohash']['save_s'])} | "
                         f"{_fmt(f['hash_cost'], 100, '%', 1)} | {_fmt(f['sync']['verify_s'])} | "
                         f"{_fmt(f['verify_over_save'], 100, '%', 1)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = H.parser(__doc__, "checkpoint")
    H.add(ap, repeats=3)
    args = H.parse(ap, argv, quick=dict(repeats=1))
    out = H.Results(args.out, {"repeats": args.repeats, "quick": args.quick})
    if args.from_json:
        out.rewrite(markdown)
        return
    work = os.path.join(args.cache_dir, "saves")
    os.makedirs(work, exist_ok=True)
    out.write(measure(QUICK_SIZES if args.quick else SIZES, args.repeats, out, work), markdown,
              record_machine=False)  # the load average at the start and the end is in the payload


if __name__ == "__main__":
    main()

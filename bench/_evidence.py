"""Shared machinery of the seed-repeated benches (clamp_drift, zreg_bf16, distill_seeds).

- ``build_trainer``: the one place these benches touch the training configuration: Megatron flags ->
  ``pretrain_gpt.build_run`` (TrainConfig + tokenizer) -> its datasets and forward step -> ``Trainer``;
- ``small_gpt_argv``: the flags of the small GPT they all train (demo corpus, bf16 autocast, CPU);
- ``fixed_valid_loss``: the validation loss over the same first batches of the valid split every time;
- ``seed_summary`` / ``paired_gap``: mean +- standard deviation over seeds and the per-seed gap to a baseline;
- ``RunCache``: one JSON per finished (configuration, seed), so that an interrupted bench resumes;
- ``write_outputs``: ``PREFIX.{json,md,png}``.

Every run happens in this process, one after another (``parallel_state`` is re-initialised per Trainer).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

DEFAULT_CACHE = "/tmp/megatron_cai_bench/evidence"


def demo_data(cache: str, vocab: int) -> tuple[str, str]:
    """(data prefix, tokenizer model) of the demo corpus, built once in ``cache`` (qat_training's builder)."""
    from qat_training import prepare_data

    return prepare_data(cache, vocab)


def small_gpt_argv(*, layers: int, hidden: int, heads: int, seq: int, batch: int, iters: int, lr: float,
                   seed: int, data: str, tok: str, cache: str, weight_decay: float = 0.1,
                   warmup: int | None = None, bf16: bool = True, valid_batches: int = 8) -> list[str]:
    """Megatron flags of one small-GPT run on the demo corpus (CPU, no dropout, cosine LR).

    ``valid_batches``: the most validation batches any evaluation of the run reads (sizes the valid split).
    """
    argv = ["--squared-relu",
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(batch),
            "--global-batch-size", str(batch), "--train-iters", str(iters), "--lr", str(lr),
            "--min-lr", str(lr / 10), "--lr-warmup-iters", str(max(1, iters // 10) if warmup is None else warmup),
            "--lr-decay-style", "cosine", "--weight-decay", str(weight_decay), "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(seed), "--data-path", data,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok, "--split", "949,50,1",
            "--data-cache-path", os.path.join(cache, "index"), "--eval-interval", str(iters),
            "--eval-iters", str(valid_batches),
            "--log-interval", str(max(1, iters)), "--device", "cpu", "--make-vocab-size-divisible-by", "128",
            "--no-exit-signal-handler",
            "--position-embedding-type", "rope", "--num-workers", "0"]
    return argv + (["--bf16"] if bf16 else [])


def build_trainer(argv: list[str]):
    """A ``Trainer`` for these Megatron flags, through ``pretrain_gpt``'s public pieces (world size 1)."""
    import pretrain_gpt
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.training.training import Trainer

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    return Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)


def core_model(trainer):
    """The GPT module of a single-chunk Trainer (under its DDP wrapper)."""
    return trainer.model[0].module


def fixed_valid_loss(trainer, batches: int) -> float:
    """Validation ``lm loss`` over the first ``batches`` batches of the valid split (the same every call)."""
    log = trainer.config.logging
    saved = log.eval_iters, trainer.state.consumed_valid_samples
    log.eval_iters = batches
    trainer.valid_iter = trainer._loader(trainer.valid_ds, 0)
    try:
        return float(trainer.evaluate()["lm loss"])
    finally:
        log.eval_iters, trainer.state.consumed_valid_samples = saved


def train_chunk(trainer, iters: int) -> list[dict]:
    """Train ``iters`` more iterations (``--train-iters`` is the schedule's end); return their history."""
    trainer.config.training.train_iters = trainer.state.iteration + iters
    trainer.config.checkpoint.save = None  # the benches save and evaluate between chunks themselves
    trainer.config.logging.eval_interval = 0
    return list(trainer.train().extra["history"])


# ------------------------------------------------------------------------------------------ statistics
def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    v = [float(x) for x in values]
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def seed_summary(per_seed: dict, key: str) -> dict:
    """{'mean', 'std', 'values'} of ``per_seed[seed][key]`` over the seeds."""
    vals = [per_seed[s][key] for s in sorted(per_seed, key=int)]
    m, sd = mean_std(vals)
    return {"mean": m, "std": sd, "values": vals}


def paired_gap(per_seed: dict, baseline: dict, key: str) -> dict:
    """Per-seed gap of ``key`` to the baseline run of the same seed: absolute and relative (%)."""
    seeds = sorted(set(per_seed) & set(baseline), key=int)
    diff = [per_seed[s][key] - baseline[s][key] for s in seeds]
    rel = [100.0 * (per_seed[s][key] / baseline[s][key] - 1.0) for s in seeds]
    (dm, ds), (rm, rs) = mean_std(diff), mean_std(rel)
    return {"diff_mean": dm, "diff_std": ds, "rel_pct_mean": rm, "rel_pct_std": rs, "diff": diff, "rel_pct": rel}


def fmt_pm(mean: float, std: float, digits: int = 4) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


# ------------------------------------------------------------------------------------------ caching / output
class RunCache:
    """One JSON file per finished (configuration, seed) under ``root``; ``key`` names the settings.

    Several processes may share one cache (e.g. one per seed, to use more cores): a run being computed holds
    ``NAME.lock`` (its process id); ``try_run`` skips it (returns None), ``run_all`` comes back to it later.
    """

    def __init__(self, root: str, key: str) -> None:
        self.dir = os.path.join(root, key)
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, name: str, seed: int) -> str:
        slug = "".join(ch if ch.isalnum() else "_" for ch in name)
        return os.path.join(self.dir, f"{slug}__seed{seed}.json")

    def try_run(self, name: str, seed: int, fn: Callable[[], dict]) -> dict | None:
        """The cached result, else ``fn()`` (then cached); None while another live process computes it."""
        path = self._path(name, seed)
        while True:
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            try:
                fd = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if _lock_alive(path + ".lock"):
                    return None
                _remove(path + ".lock")  # its process died: take it over
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            try:
                out = fn()
                with open(path + f".tmp{os.getpid()}", "w") as f:
                    json.dump(out, f)
                os.replace(path + f".tmp{os.getpid()}", path)
                return out
            finally:
                _remove(path + ".lock")

    def get_or_run(self, name: str, seed: int, fn: Callable[[], dict]) -> dict:
        """The cached result, else ``fn()``; waits while another process computes it."""
        while (out := self.try_run(name, seed, fn)) is None:
            time.sleep(5)
        return out

    def run_all(self, items: list[tuple[str, int, Callable[[], dict]]],
                report: Callable[[str, int, dict], None] | None = None) -> dict[str, dict[str, dict]]:
        """{name: {str(seed): result}} of every (name, seed, fn); runs held by other processes come last."""
        out: dict[str, dict[str, dict]] = {}
        pending = list(items)
        while pending:
            later = []
            for name, seed, fn in pending:
                res = self.try_run(name, seed, fn)
                if res is None:
                    later.append((name, seed, fn))
                    continue
                out.setdefault(name, {})[str(seed)] = res
                if report:
                    report(name, seed, res)
            if later and len(later) == len(pending):
                time.sleep(5)
            pending = later
        return {name: out[name] for name in dict.fromkeys(n for n, _, _ in items)}


def _lock_alive(lock: str) -> bool:
    try:
        with open(lock) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return True  # being written right now
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def settings_key(settings: dict) -> str:
    import hashlib

    return hashlib.md5(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]


def write_outputs(prefix: str, payload: dict, md: str, plot: Callable[[dict, str], None]) -> None:
    """Write PREFIX.json (payload), PREFIX.md and PREFIX.png; create the folder."""
    folder = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(folder, exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=_finite)
    with open(prefix + ".md", "w") as f:
        f.write(md)
    import matplotlib

    matplotlib.use("Agg")
    plot(payload, prefix + ".png")
    print(md)
    print(f"wrote {prefix}.json, {prefix}.md, {prefix}.png")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def count_spikes(losses: list[float], window: int = 10, jump: float = 0.5) -> int:
    """Iterations whose loss is non-finite or exceeds the median of the previous ``window`` by > ``jump``."""
    spikes = 0
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            spikes += 1
        elif i >= 2 and v - statistics.median(losses[max(0, i - window):i]) > jump:
            spikes += 1
    return spikes

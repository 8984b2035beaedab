"""Distillation at three seeds: no KD, full-distribution KD, truncated top-k and Gumbel top-k at k = 8 and 32.

    python bench/distill_seeds.py [--seeds 1 2 3] [--quick] [--measure-stores] [--out bench/results/distill_seeds]

One teacher (``--teacher`` layers,hidden,heads; at least 4x the student's parameters, checked) trains on the
demo corpus until its validation loss flattens (cosine schedule; the curve and the last interval's
improvement are reported), and is shared by every seed. Per seed the student trains with

- ``no KD``;
- ``full KD``: the whole teacher distribution (``--distill-estimator full``);
- ``top-k k``: the k most likely teacher ids (``--distill-estimator topk``), a truncated store's content;
- ``Gumbel k``: k ids drawn by Gumbel top-k (``--distill-estimator priority``), a Gumbel store's content;

all reading the teacher online (``--distill-teacher-load``): the estimators draw what
``tools/dump_teacher_samples.py`` would store, without writing the stores (the dumps cost more CPU than
the students here). Stored bytes per token: the store format (k uint16 ids + k fp16 logits + fp32 lse +
fp32 kappa); ``--measure-stores`` (on in ``--quick``) also writes the four stores with the tool and
measures them on disk. Loss: (1 - alpha) CE + alpha KD (``--alpha``). The seed sets the student's
initialisation; the data order is shared by all seeds. Reported: the student's validation loss and
KL(teacher || student) on fixed held-out batches (mean ± std over seeds, paired gap to no KD and to full
KD) and the bytes per token. Writes ``--out``.{json,md,png}.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import harness as H
from harness import training as T
from harness.data import QUICK, demo_corpus
from harness.runcache import RunCache, settings_key

DATA_SEED = 1234
KS = (8, 32)


def student_configs(teacher_dir: str, alpha: float) -> dict[str, list[str]]:
    """Every KD variant reads the teacher online (``--distill-teacher-load``): the estimators draw the same
    samples a store would hold (``topk``: the k largest; ``priority``: Gumbel top-k), without the dump."""
    kd = ["--distill-teacher-load", teacher_dir, "--distill-alpha", str(alpha)]
    out = {"no KD": [], "full KD": [*kd, "--distill-estimator", "full"]}
    for k in KS:
        out[f"top-k k={k}"] = [*kd, "--distill-estimator", "topk", "--distill-k", str(k)]
        out[f"Gumbel k={k}"] = [*kd, "--distill-estimator", "priority", "--distill-k", str(k)]
    return out


def store_bytes_per_token(k: int, vocab: int) -> int:
    """Bytes per position of a store of tools/dump_teacher_samples.py (either sampler): k ids (uint16 up to
    V = 65536, else int32), k fp16 logits, fp32 lse and fp32 kappa."""
    return k * ((2 if vocab <= 1 << 16 else 4) + 2) + 8


def argv_for(o, shape: str, iters: int, lr: float, batch: int) -> list[str]:
    layers, hidden, heads = map(int, shape.split(","))
    return T.small_gpt_argv(layers=layers, hidden=hidden, heads=heads, seq=o.seq, batch=batch, iters=iters,
                            lr=lr, seed=DATA_SEED, data=o._data, tok=o._tok, cache=o.cache_dir,
                            valid_batches=o.eval_batches)


def n_params(trainer) -> int:
    return sum(p.numel() for p in T.core_model(trainer).parameters())


# ------------------------------------------------------------------------------------------ teacher
def train_teacher(o, folder: str) -> dict:
    """Train (once) and save the teacher; its validation curve, parameters and the flattening check."""
    import json

    meta = os.path.join(folder, "teacher.json")
    if os.path.exists(meta):
        with open(meta) as f:
            return json.load(f)
    tr = T.build_trainer(argv_for(o, o.teacher, o.teacher_iters, o.teacher_lr, o.batch)
                         + ["--no-save-optim"])
    curve = [(0, T.fixed_valid_loss(tr, o.eval_batches))]
    while tr.state.iteration < o.teacher_iters:
        T.train_chunk(tr, min(o.teacher_eval_interval, o.teacher_iters - tr.state.iteration))
        curve.append((tr.state.iteration, T.fixed_valid_loss(tr, o.eval_batches)))
    tr.config.checkpoint.save = os.path.join(folder, "teacher")
    tr.save()
    last_gain = (curve[-2][1] - curve[-1][1]) / curve[-2][1]
    out = {"dir": tr.config.checkpoint.save, "params": n_params(tr), "curve": curve, "valid_loss": curve[-1][1],
           "last_interval_rel_gain": last_gain, "flattened": last_gain < o.flat_tol}
    with open(meta, "w") as f:
        json.dump(out, f)
    return out


def dump_store(o, teacher_dir: str, sampler: str, k: int, folder: str) -> dict:
    """tools/dump_teacher_samples.py over the student's train split; bytes per token on disk (--measure-stores)."""
    store = os.path.join(folder, f"store_{sampler}_k{k}")
    done = os.path.join(store, ".bench_done")
    if not os.path.exists(done):
        cmd = [sys.executable, "tools/dump_teacher_samples.py", "--load", teacher_dir, "--output", store,
               "--k", str(k), "--sampler", sampler, "--data-path", o._data, "--split", "949,50,1",
               "--seq-length", str(o.seq), "--seed", str(DATA_SEED), "--train-iters", str(o.student_iters),
               "--global-batch-size", str(o.batch), "--tokenizer-model", o._tok, "--data-cache-path",
               os.path.join(o.cache_dir, "index"), "--micro-batch-size", "16", "--no-progress", "--device", "cpu",
               "--shard-size", "512"]
        proc = subprocess.run(cmd, cwd=H.ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"dump_teacher_samples ({sampler}, k={k}) failed:\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-3000:]}")
        open(done, "w").close()
    size = sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store) if f.endswith(".bin"))
    return {"path": store, "bytes_per_token": size / (o.student_iters * o.batch * o.seq)}


# ------------------------------------------------------------------------------------------ students
def heldout_kl(o, student, teacher_dir: str) -> float:
    """KL(teacher || student) over the full vocabulary on the first eval samples of the valid split."""
    import torch
    from distill import eval_tokens, log_probs

    tokens, _ = eval_tokens(o._data, o._tok, "949,50,1", o.seq, o.eval_batches * o.batch)
    log_p = log_probs(teacher_dir, None, tokens)
    student.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        logits = torch.cat([student(tokens[i:i + 8], pos[i:i + 8]) for i in range(0, tokens.shape[0], 8)])
        log_q = torch.log_softmax(logits[..., : log_p.shape[-1]].float(), -1)
    student.train()
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def train_student(o, name: str, flags: list[str], seed: int, teacher_dir: str) -> dict:
    t0 = time.time()
    tr = T.build_trainer(argv_for(o, o.student, o.student_iters, o.student_lr, o.batch) + flags)
    T.core_model(tr).initialize(seed)  # the seed sets the initialisation only (the stores fix the data order)
    curve = []
    train_loss = []
    while tr.state.iteration < o.student_iters:
        hist = T.train_chunk(tr, min(o.eval_interval, o.student_iters - tr.state.iteration))
        train_loss += [h["lm loss"] for h in hist]
        curve.append((tr.state.iteration, T.fixed_valid_loss(tr, o.eval_batches)))
    return {"final_valid_loss": curve[-1][1], "curve": curve, "train_loss": train_loss,
            "kl_teacher_student": heldout_kl(o, T.core_model(tr), teacher_dir), "params": n_params(tr),
            "seconds": time.time() - t0}


# ------------------------------------------------------------------------------------------ report
def summarise(per: dict) -> dict:
    out = {}
    for name, per_seed in per.items():
        row = {"valid_loss": H.seed_summary(per_seed, "final_valid_loss"),
               "kl": H.seed_summary(per_seed, "kl_teacher_student")}
        if name != "no KD":
            row["gap_to_no_kd"] = H.paired_gap(per_seed, per["no KD"], "final_valid_loss")
        if name != "full KD":
            row["gap_to_full_kd"] = H.paired_gap(per_seed, per["full KD"], "final_valid_loss")
        out[name] = row
    return out


def bytes_row(name: str, res: dict) -> str:
    v = res["settings"]["vocab"]
    if name == "no KD":
        return "0"
    if name == "full KD":
        return f"{2 * v:,} (dense bf16)"
    sampler, k = ("topk" if name.startswith("top-k") else "gumbel"), int(name.split("=")[1])
    st = res["stores"][f"{sampler} k={k}"]
    measured = f" ({st['bytes_per_token']:.1f} on disk)" if "bytes_per_token" in st else ""
    return f"{st['format_bytes_per_token']}{measured}"


def findings(res: dict) -> list[str]:
    s, out = res["summary"], []
    sd = max(r["valid_loss"]["std"] for r in s.values())
    for name, r in s.items():
        if name == "no KD":
            continue
        g = r["gap_to_no_kd"]
        verdict = ("helps" if g["diff_mean"] < -3 * max(g["diff_std"], 1e-9) else
                   "hurts" if g["diff_mean"] > 3 * max(g["diff_std"], 1e-9) else "no clear effect")
        out.append(f"{name}: valid loss {g['diff_mean']:+.4f} ± {g['diff_std']:.4f} vs no KD ({verdict}, paired over "
                   f"seeds); KL(teacher‖student) {r['kl']['mean']:.4f}.")
    out.append(f"Largest seed std of the validation loss: {sd:.4f}.")
    return out


def markdown(res: dict) -> str:
    o, t = res["settings"], res["teacher"]
    lines = ["# Distillation at three seeds: no KD, full KD, truncated top-k and Gumbel top-k", "",
             f"`python bench/distill_seeds.py{' --quick' if o['quick'] else ''}` — demo corpus (vocab {o['vocab']}), "
             f"seq {o['seq']}, batch {o['batch']}. Teacher ({o['teacher']}: layers, hidden, heads) "
             f"{t['params']:,} parameters, {o['teacher_iters']} iterations (lr {o['teacher_lr']:g} cosine), validation "
             f"loss {t['valid_loss']:.4f}; last {o['teacher_eval_interval']} iterations improved it by "
             f"{100 * t['last_interval_rel_gain']:.2f}% ({'flattened' if t['flattened'] else 'NOT yet flat'}: "
             f"threshold {100 * o['flat_tol']:g}%). Student ({o['student']}) {res['student_params']:,} parameters "
             f"(teacher / student = {t['params'] / res['student_params']:.1f}x), {o['student_iters']} iterations "
             f"(lr {o['student_lr']:g} cosine), alpha {o['alpha']} in (1 - alpha) CE + alpha KD, seeds "
             f"{res['seeds']} (the student's initialisation; data order and Gumbel noise shared).", "",
             f"Validation loss and KL(teacher‖student) (exact, full vocabulary) on {o['eval_batches']} fixed held-out "
             "batches, mean ± std over seeds; paired gaps: minus the no-KD / full-KD student of the same seed. "
             "Every KD student reads the teacher online; bytes per token: what a store of "
             "`tools/dump_teacher_samples.py` holds per training token (k uint16 ids, k fp16 logits, fp32 lse, "
             "fp32 kappa; on disk too when measured), and dense bf16 logits for full KD.", "",
             "| student | valid loss | vs no KD | vs full KD | KL(teacher‖student) | bytes / token |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in res["summary"].items():
        a, b = r.get("gap_to_no_kd"), r.get("gap_to_full_kd")
        lines.append(f"| {name} | {H.fmt_pm(r['valid_loss']['mean'], r['valid_loss']['std'])} | "
                     + (f"{a['diff_mean']:+.4f} ± {a['diff_std']:.4f}" if a else "-") + " | "
                     + (f"{b['diff_mean']:+.4f} ± {b['diff_std']:.4f}" if b else "-") + " | "
                     + f"{H.fmt_pm(r['kl']['mean'], r['kl']['std'])} | {bytes_row(name, res)} |")
    lines += ["", "## Finding", "", *[f"- {f}" for f in res["findings"]], ""]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5))
    it, loss = zip(*res["teacher"]["curve"])
    a.plot(it, loss, marker="o", color="black")
    a.set(title="teacher validation loss", xlabel="iteration")
    names = list(res["per_seed"])
    colors = {n: plt.cm.tab10(i) for i, n in enumerate(names)}
    for name in names:
        for i, seed in enumerate(sorted(res["per_seed"][name], key=int)):
            x, y = zip(*res["per_seed"][name][seed]["curve"])
            b.plot(x, y, color=colors[name], label=name if i == 0 else None, alpha=0.8)
    b.set(title="student validation loss (every seed)", xlabel="iteration")
    s = res["summary"]
    xs = range(len(names))
    c.bar(xs, [s[n]["valid_loss"]["mean"] for n in names], yerr=[s[n]["valid_loss"]["std"] for n in names],
          color=[colors[n] for n in names], capsize=4)
    lo = min(s[n]["valid_loss"]["mean"] for n in names)
    hi = max(s[n]["valid_loss"]["mean"] for n in names)
    c.set_ylim(lo - 0.5 * (hi - lo) - 0.01, hi + 0.5 * (hi - lo) + 0.01)
    c.set_xticks(list(xs), names, rotation=30, fontsize=8)
    c.set(title="final student validation loss (mean ± std)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def _quick(o: argparse.Namespace) -> None:
    o.teacher, o.student, o.seq, o.batch = "2,64,2", "1,16,2", 32, 2
    o.teacher_iters, o.teacher_eval_interval, o.student_iters, o.eval_interval, o.eval_batches = 8, 4, 6, 3, 1
    o.vocab, o.corpus_mb = QUICK["vocab"], QUICK["corpus_mb"]
    o.seeds = o.seeds[:2]
    o.measure_stores = True


def parse(argv=None) -> argparse.Namespace:
    p = H.parser(__doc__, "distill_seeds")
    H.add(p, seeds=[1, 2, 3], teacher="4,64,4", student="2,24,2", seq=32, batch=8, vocab=2048, corpus_mb=3.0,
          teacher_iters=300)
    p.add_argument("--teacher-lr", type=float, default=2e-3)
    p.add_argument("--teacher-eval-interval", type=int, default=50)
    p.add_argument("--flat-tol", type=float, default=0.01, help="flattened: last interval improved < this")
    H.add(p, student_iters=60)
    p.add_argument("--student-lr", type=float, default=3e-3)
    H.add(p, eval_interval=20)
    p.add_argument("--eval-batches", type=int, default=6)
    H.add(p, alpha=0.5)
    p.add_argument("--train-only", action="store_true", help="train (into the cache) and write no results")
    p.add_argument("--measure-stores", action="store_true",
                   help="also write the four stores with tools/dump_teacher_samples.py and measure them on disk")
    return H.parse(p, argv, quick=_quick)


def main(argv=None) -> dict:
    import torch

    o = parse(argv)
    if o.from_json:
        H.Results(o.out).rewrite(markdown, plot)
        return {}
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    t0 = time.time()
    o._data, o._tok = demo_corpus(o.cache_dir, o.vocab, o.corpus_mb)
    settings = {k: v for k, v in vars(o).items()
                if not k.startswith("_")
                and k not in ("out", "seeds", "train_only", "measure_stores", "bench", "from_json")}
    teacher_key = settings_key({k: settings[k] for k in ("teacher", "seq", "batch", "vocab", "corpus_mb",
                                                         "teacher_iters", "teacher_lr", "teacher_eval_interval",
                                                         "eval_batches")})
    folder = os.path.join(o.cache_dir, "distill_seeds", teacher_key)
    os.makedirs(folder, exist_ok=True)
    # Concurrent processes (same flags) share the teacher, the stores and the students through locks.
    teacher = RunCache(folder, "teacher_lock").get_or_run("teacher", 0, lambda: train_teacher(o, folder))
    print(f"teacher: {teacher['params']:,} params, valid loss {teacher['valid_loss']:.4f}", flush=True)
    stores = {f"{s} k={k}": {"format_bytes_per_token": store_bytes_per_token(k, o.vocab)}
              for s in ("topk", "gumbel") for k in KS}
    if o.measure_stores:  # write the stores and measure them on disk (--quick: those of the smallest k)
        store_cache = RunCache(folder, f"stores_{o.student_iters}")
        dumped = store_cache.run_all([(f"{s} k={k}", 0, lambda s=s, k=k: dump_store(o, teacher["dir"], s, k,
                                                                                      store_cache.dir))
                                      for s in ("topk", "gumbel") for k in (KS[:1] if o.quick else KS)])
        for name, runs in dumped.items():
            stores[name].update(runs["0"])
    print("stores: " + ", ".join(f"{n} {v.get('bytes_per_token', v['format_bytes_per_token']):.1f} B/token"
                                 for n, v in stores.items()), flush=True)
    o._cache = RunCache(os.path.join(folder, "students"), settings_key(settings))
    cfgs = student_configs(teacher["dir"], o.alpha)
    items = [(name, seed, lambda n=name, f=flags, s=seed: train_student(o, n, f, s, teacher["dir"]))
             for seed in o.seeds for name, flags in cfgs.items()]

    def report(name: str, seed: int, run: dict) -> None:
        if teacher["params"] < 4 * run["params"]:
            raise SystemExit(f"--teacher {o.teacher} has {teacher['params']:,} parameters, under 4x the "
                             f"student's {run['params']:,} (--student {o.student})")
        print(f"seed {seed} {name}: valid loss {run['final_valid_loss']:.4f}, KL {run['kl_teacher_student']:.4f} "
              f"({run['seconds']:.0f} s)", flush=True)

    per = o._cache.run_all(items, report)
    if o.train_only:
        return {}
    student_params = next(iter(per["no KD"].values()))["params"]
    res = {"seeds": o.seeds, "settings": settings, "teacher": teacher, "student_params": student_params,
           "stores": stores, "per_seed": per}
    res["summary"] = summarise(per)
    res["findings"] = findings(res)
    res["seconds"] = time.time() - t0
    H.Results(o.out).write(res, markdown, plot, record_machine=False)
    return res


if __name__ == "__main__":
    main()

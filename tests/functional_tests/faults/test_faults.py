"""Fault injection as real processes: every fault fails loudly and no case loses or changes a checkpoint.

A base run (tiny model, mock data, constant LR, a checkpoint at every iteration 1..6) is the reference.
Each case works on a copy of its checkpoints, injects one fault into a real ``pretrain_gpt.py`` (or
converter) process, checks what the user sees (one ``error:`` line naming the file, exit status 2, no
traceback), then checks that the files saved before the fault are byte-identical and that the last
good checkpoint resumes bit-exactly: resuming it to iteration 6 gives the base run's iteration-6 model
and Adam state exactly.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from testlib import ROOT

from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

INJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_inject.py")
FINAL = 6
MODEL = ["--squared-relu",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
         "--eval-interval", "0", "--make-vocab-size-divisible-by", "8", "--position-embedding-type", "rope",
         "--num-workers", "0"]
BASE = ["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", str(FINAL)]


# ------------------------------------------------------------------------------------------ helpers
def run(argv: list[str], script: str = INJECT, env: dict | None = None, timeout: float = 180):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, script, *argv], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def assert_one_error(proc, *needles: str) -> str:
    """Exit status 2, exactly one ``error:`` line holding every needle, and no traceback."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(root: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def assert_kept(before: dict[str, str], root: str, *, allow_new: bool = True) -> None:
    """Every file saved before the fault is still there, byte for byte."""
    after = snapshot(root)
    changed = [k for k, v in before.items() if after.get(k) != v]
    assert not changed, f"changed or lost: {changed}"
    if not allow_new:
        assert set(after) == set(before), f"new files: {sorted(set(after) - set(before))}"


def tracker(root: str) -> int | None:
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def rank_file(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")


def assert_same_state(a: str, b: str) -> None:
    pa, pb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    for k, t in pa["model"]["model0"].items():
        assert torch.equal(t, pb["model"]["model0"][k]), k
    for name, st in pa["optimizer"]["param_state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], pb["optimizer"]["param_state"][name][key]), (name, key)
    assert pa["iteration"] == pb["iteration"] and pa["optimizer"]["step"] == pb["optimizer"]["step"]


def assert_resumes_bit_exactly(root: str, iteration: int, base: str, tmp_path) -> None:
    """Resume ``root`` at ``iteration`` to FINAL in a real process: equal to the base run's FINAL state."""
    out = str(tmp_path / f"resumed_from_{iteration}")
    proc = run([*BASE, "--load", root, "--ckpt-step", str(iteration), "--save", out], timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"loaded checkpoint from {root} at iteration {iteration}" in proc.stdout
    assert_same_state(rank_file(out, FINAL), rank_file(base, FINAL))


def copy_run(base: str, tmp_path, upto: int) -> str:
    """A copy of the base run's checkpoints 1..upto, tracker on ``upto``."""
    dst = str(tmp_path / "run")
    os.makedirs(dst)
    for i in range(1, upto + 1):
        shutil.copytree(os.path.join(base, f"iter_{i:07d}"), os.path.join(dst, f"iter_{i:07d}"))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(upto))
    return dst


def write_corpus(prefix: str, docs: list[list[int]], dtype=np.uint16) -> str:
    with IndexedDatasetBuilder(get_bin_path(prefix), dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize(get_idx_path(prefix))
    return prefix


def data_flags(prefix: str, vocab: int) -> list[str]:
    return ["--data-path", prefix, "--split", "1,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(vocab), *MODEL, "--train-iters", "2"]


# ------------------------------------------------------------------------------- 1. divergence
def test_nan_run_stops_and_keeps_the_last_good_checkpoint(base, tmp_path):
    run_dir = copy_run(base, tmp_path, 4)
    before = snapshot(run_dir)
    proc = run([*BASE, "--train-iters", "100", "--load", run_dir, "--save", run_dir, "--save-interval", "1"],
               env={"FAULT_NAN_LOSS_FROM": "5"})
    line = assert_one_error(proc, "training diverged at iteration 14", "10 consecutive",
                            "last good checkpoint: " + os.path.join(run_dir, "iter_0000004"))
    assert "last finite lm loss" in line and "at iteration 4" in line
    assert tracker(run_dir) == 4  # never moved onto a broken state
    assert_kept(before, run_dir, allow_new=False)  # no checkpoint of the NaN iterations
    assert_resumes_bit_exactly(run_dir, 4, base, tmp_path)


def test_huge_lr_exits_within_ten_skips_tracker_on_last_finite(base, tmp_path):
    save = str(tmp_path / "lr")
    proc = run(["--mock-data", "--vocab-size", "64", *MODEL, "--lr", "1e6", "--train-iters", "50", "--save", save,
                "--save-interval", "1"])
    line = assert_one_error(proc, "training diverged", "last good checkpoint")
    skipped = proc.stdout.count("skipped the optimizer step")
    assert skipped == 10, proc.stdout[-2000:]
    good = tracker(save)
    assert good is not None and f"iter_{good:07d}" in line
    assert sorted(os.listdir(save)) == sorted([f"iter_{i:07d}" for i in range(1, good + 1)]
                                              + ["latest_checkpointed_iteration.txt"])
    payload = torch.load(rank_file(save, good), weights_only=False)
    assert all(torch.isfinite(t).all() for t in payload["model"]["model0"].values())
    # the last finite checkpoint resumes (and, at this LR, diverges again: no save, tracker unchanged)
    before = snapshot(save)
    again = run(["--mock-data", "--vocab-size", "64", *MODEL, "--lr", "1e6", "--train-iters", "50", "--load", save,
                 "--save", save, "--save-interval", "1"])
    assert f"loaded checkpoint from {save} at iteration {good}" in again.stdout
    assert again.returncode == 2 and tracker(save) == good
    assert_kept(before, save, allow_new=False)


def test_nan_on_one_rank_once_is_skipped_everywhere(base, tmp_path):
    """A NaN loss on one rank at one iteration skips that step on both DP ranks; the run goes on."""
    save = str(tmp_path / "dp2")
    procs = launch_ranks(["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", "4", "--save", save],
                         2, env={"FAULT_NAN_LOSS_FROM": "2", "FAULT_NAN_ONCE": "1", "FAULT_NAN_RANK": "1"})
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "number of skipped iterations:   1" in outs[1][0]  # the last rank logs
    assert tracker(save) == 4


# --------------------------------------------------------------------------- 2. converter overwrites
def test_converter_refuses_non_empty_target_and_in_place(base, tmp_path):
    src = copy_run(base, tmp_path, 2)
    other = str(tmp_path / "other")
    shutil.copytree(base, other)
    before_src, before_other = snapshot(src), snapshot(other)
    conv = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    proc = run(["--load", src, "--save", other, "--target-tensor-parallel-size", "1"], script=conv)
    assert_one_error(proc, other, "--overwrite", "not empty")
    proc = run(["--load", src, "--save", src + "/"], script=conv)
    assert_one_error(proc, "--load directory", "replace the source")
    proc = run(["--load", src, "--save", str(tmp_path / "new"), "--target-tensor-parallel-size", "0"], script=conv)
    assert_one_error(proc, "--target-tensor-parallel-size must be >= 1")
    assert not os.path.exists(tmp_path / "new")
    assert_kept(before_src, src, allow_new=False)
    assert_kept(before_other, other, allow_new=False)
    assert tracker(other) == FINAL
    assert_resumes_bit_exactly(src, 2, base, tmp_path)


# ------------------------------------------------------------------------ 3. missing tracker, bad --load
def test_missing_tracker_refuses_to_start_fresh(base, tmp_path):
    run_dir = copy_run(base, tmp_path, 4)
    os.remove(os.path.join(run_dir, "latest_checkpointed_iteration.txt"))
    before = snapshot(run_dir)
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--save-interval", "1"])
    assert_one_error(proc, "iter_0000002", "iter_0000004", "--ckpt-step 4", "latest_checkpointed_iteration.txt")
    proc = run([*BASE, "--save", run_dir, "--save-interval", "1"])  # no --load at all
    assert_one_error(proc, "already holds checkpoints", "overwrite")
    proc = run([*BASE, "--load", str(tmp_path / "typo"), "--save", run_dir])
    assert_one_error(proc, "--load " + str(tmp_path / "typo"), "no such directory")
    assert_kept(before, run_dir, allow_new=False)
    assert_resumes_bit_exactly(run_dir, 4, base, tmp_path)


# ----------------------------------------------------------------------------------- 4. vocabulary
@pytest.mark.parametrize("bad_id, why", [(101, "between the vocabulary and its padded size"),
                                         (150, "beyond the padded size")])
def test_out_of_vocabulary_ids_are_one_error(tmp_path, bad_id, why):
    # NullTokenizer --vocab-size 100: ids 0..100 (100 = EOD), padded to 104 rows
    docs = [[(7 * i + j) % 100 for j in range(40)] for i in range(20)]
    docs[13][5] = bad_id
    prefix = write_corpus(str(tmp_path / "c_text_document"), docs)
    proc = run(data_flags(prefix, 100))
    assert_one_error(proc, prefix + ".bin", "document 13", f"token id {bad_id}", "101 ids")
    cache = os.path.join(tmp_path, "cache", "GPTDataset_indices")
    assert any(f.endswith("token_range.json") for f in os.listdir(cache))


# --------------------------------------------------------------------------------- 5. I/O errors
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_checkpoint_names_the_file(base, tmp_path, damage):
    """A checkpoint without content hashes (no checksums.json) loaded with --allow-unverified-checkpoint: it says so
    in one line, and the reader itself names the damaged file (with hashes, test_integrity_faults finds it first)."""
    run_dir = copy_run(base, tmp_path, 4)
    os.remove(os.path.join(run_dir, "iter_0000004", "checksums.json"))
    path = rank_file(run_dir, 4)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"this is not a checkpoint\n" * 10)
    before = snapshot(run_dir)
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--allow-unverified-checkpoint"])
    expected = "truncated or corrupt torch file" if damage == "truncate" else "not a torch file"
    assert_one_error(proc, path, expected, "rank 0")
    assert "iter_0000004 has no content hashes (checksums.json): its files cannot be verified" in proc.stdout, \
        proc.stdout[-2000:]
    assert_kept(before, run_dir, allow_new=False)
    assert_resumes_bit_exactly(run_dir, 2, base, tmp_path)  # the previous checkpoint is intact


def test_bad_metadata_json_names_the_file(base, tmp_path):
    """Without content hashes (--allow-unverified-checkpoint) the JSON reader names the file; with them the hash
    does."""
    run_dir = copy_run(base, tmp_path, 4)
    os.remove(os.path.join(run_dir, "iter_0000004", "checksums.json"))
    meta = os.path.join(run_dir, "iter_0000004", "metadata.json")
    with open(meta, "w") as f:
        f.write('{"iteration": 4, "tensor_model')
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--allow-unverified-checkpoint"])
    assert_one_error(proc, meta, "corrupt", "invalid JSON")
    assert_resumes_bit_exactly(run_dir, 3, base, tmp_path)


def test_disk_full_during_save_keeps_the_previous_checkpoint(base, tmp_path):
    run_dir = copy_run(base, tmp_path, 4)
    before = snapshot(run_dir)
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--save-interval", "1"],
               env={"FAULT_ENOSPC": "iter_0000006"})
    line = assert_one_error(proc, os.path.join("iter_0000006.tmp", "mp_rank_00", "model_optim_rng.pt"),
                            "ENOSPC", "bytes")
    assert "needs about" in line
    assert tracker(run_dir) == 5 and not os.path.exists(os.path.join(run_dir, "iter_0000006"))
    before.pop("latest_checkpointed_iteration.txt")  # moved 4 -> 5 by the good save before the full disk
    assert_kept(before, run_dir)
    assert_same_state(rank_file(run_dir, 5), rank_file(base, 5))
    assert_resumes_bit_exactly(run_dir, 5, base, tmp_path)


def test_kill_during_save_keeps_the_previous_checkpoint(base, tmp_path):
    run_dir = copy_run(base, tmp_path, 4)
    before = snapshot(run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_HANG_SAVE": "iter_0000005"}
    proc = subprocess.Popen([sys.executable, INJECT, *BASE, "--load", run_dir, "--save", run_dir,
                             "--save-interval", "1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("FAULT: saving"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert tracker(run_dir) == 4
    assert_kept(before, run_dir)
    assert_resumes_bit_exactly(run_dir, 4, base, tmp_path)


# ------------------------------------------------------------------------------- 6. smaller cases
def test_empty_corpus_and_empty_train_split(tmp_path):
    prefix = write_corpus(str(tmp_path / "empty_text_document"), [])
    assert_one_error(run(data_flags(prefix, 100)), "train split is empty")
    prefix = write_corpus(str(tmp_path / "small_text_document"), [[1, 2, 3, 4] * 10] * 4)
    flags = data_flags(prefix, 100)
    flags[flags.index("--split") + 1] = "0,1,0"
    assert_one_error(run(flags), "train split is empty", "--split 0,1,0")


@pytest.mark.parametrize("pos", ["learned_absolute", "rope"])
def test_seq_length_above_max_position_embeddings(pos):
    argv = [*BASE, "--position-embedding-type", pos]
    argv[argv.index("--seq-length") + 1] = "32"
    assert_one_error(run(argv), "--seq-length 32 is larger than --max-position-embeddings 16")


def test_generate_validates_and_warns(base, tmp_path):
    gen = os.path.join(ROOT, "tools", "generate.py")
    common = ["--load", base, "--tokenizer-type", "NullTokenizer", "--prompt", "1 2 3", "--seed", "1"]
    proc = run([*common, "--max-new-tokens", "-1"], script=gen)
    assert_one_error(proc, "--max-new-tokens must be >= 0")
    proc = run([*common, "--max-new-tokens", "20"], script=gen)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the prompt (3 tokens) + --max-new-tokens 20 = 23 tokens goes past the trained context of 16" \
        in proc.stderr
    proc = run([*common, "--max-new-tokens", "10"], script=gen)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(argv: list[str], world: int, env: dict | None = None, ranks=None) -> list[subprocess.Popen]:
    """``world`` ranks of a gloo job as separate processes (as srun/torchrun would start them)."""
    port = str(_free_port())
    procs = []
    for r in ranks if ranks is not None else range(world):
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
             "LOCAL_WORLD_SIZE": str(world), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, INJECT, *argv, "--device", "cpu"], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_waiting_rank_logs_what_it_waits_for():
    (proc,) = launch_ranks([*BASE], 2, env={"MEGATRON_CAI_WAIT_LOG_SECONDS": "1"}, ranks=[0])
    try:
        t0 = time.time()
        for line in proc.stderr:
            if "waiting for the other ranks" in line:
                break
            assert time.time() - t0 < 120
        assert "world size 2, rank 0, master address 127.0.0.1:" in line
    finally:
        proc.kill()
        proc.communicate()


def test_corrupt_idx_under_dp2_is_one_error_line(tmp_path):
    docs = [[(3 * i + j) % 100 for j in range(40)] for i in range(20)]
    prefix = write_corpus(str(tmp_path / "c_text_document"), docs)
    idx = get_idx_path(prefix)
    data = open(idx, "rb").read()
    with open(idx, "wb") as f:
        f.write(data[:60])
    procs = launch_ranks(data_flags(prefix, 100), 2)
    outs = [p.communicate(timeout=240) for p in procs]
    text = "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [2, 2], text
    lines = error_lines("".join(e for _, e in outs))
    assert len(lines) == 1 and idx in lines[0], text
    assert "Traceback" not in text


def test_killed_rank_stops_the_job_without_a_hang(base, tmp_path):
    save = str(tmp_path / "killed")
    procs = launch_ranks(["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", "1000", "--save", save,
                          "--save-interval", "2"], 2, env={"FAULT_ITER_SLEEP": "0.05"})
    t0 = time.time()
    while tracker(save) is None and time.time() - t0 < 180:
        time.sleep(0.2)
    kept = tracker(save)
    assert kept is not None
    procs[1].kill()
    out0, err0 = procs[0].communicate(timeout=120)  # rank 0 notices and exits: no hang
    procs[1].communicate()
    assert procs[0].returncode not in (0, None)
    assert "Traceback" not in err0 and "a peer rank exited" in err0, err0[-2000:]
    assert tracker(save) >= kept


def test_sigterm_with_a_closed_stdout_still_saves(base, tmp_path):
    """The preemption save comes before its log line, and a broken pipe never aborts the save."""
    save = str(tmp_path / "pre")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_ITER_SLEEP": "0.2"}
    proc = subprocess.Popen([sys.executable, INJECT, *BASE, "--train-iters", str(FINAL), "--save", save], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "iteration        2/" in line:
            break
    proc.stdout.close()  # the reader goes away: every later print hits a broken pipe
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = tracker(save)
    assert saved is not None and 2 <= saved <= FINAL, err[-2000:]
    assert_same_state(rank_file(save, saved), rank_file(base, saved))
    if saved < FINAL:
        assert_resumes_bit_exactly(save, saved, base, tmp_path)


def test_enospc_message_unit(tmp_path):
    """The writer's ENOSPC message: file, rank, bytes needed and free (no real full disk needed)."""
    from megatron_cai.training.checkpoint import CheckpointIOError, save_torch

    path = str(tmp_path / "x.pt")
    real = torch.save

    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.save = full
    try:
        with pytest.raises(CheckpointIOError) as e:
            save_torch({"w": torch.zeros(1000)}, path)
    finally:
        torch.save = real
    assert path in str(e.value) and "ENOSPC" in str(e.value) and "4000 bytes" in str(e.value)
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")

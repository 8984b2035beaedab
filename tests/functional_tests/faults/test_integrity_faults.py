"""Issue 28's faults as real processes: corrupted files, runs that would overwrite other runs, two jobs on one
run directory, unusable paths, a rank that stops answering, bad numbers. Each ends with one ``error:`` line
and exit status 2, or runs correctly; the checkpoints saved before it are unchanged (sha256) and resume
bit-exactly (the base run's iteration-6 model and Adam state).

Full disks and read-only file systems are real: a small tmpfs mounted for the test (the tests are skipped
where mounting is not allowed; ``test_faults.py`` keeps an injected-ENOSPC case that runs everywhere).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from testlib import ROOT
from testlib.damage import each_byte_flipped

from .test_faults import (
    BASE,
    FINAL,
    INJECT,
    MODEL,
    assert_kept,
    assert_one_error,
    assert_resumes_bit_exactly,
    assert_same_state,
    copy_run,
    launch_ranks,
    rank_file,
    run,
    snapshot,
    tracker,
    write_corpus,
)

LOCK = ".megatron_cai.lock"


@pytest.fixture
def tmpfs(tmp_path):
    """``make(size)``: a fresh tmpfs of that size (a real full disk / read-only file system), unmounted after."""
    mounts = []

    def make(size: str) -> str:
        d = tmp_path / f"tmpfs{len(mounts)}"
        d.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                              text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(d)
        return str(d)

    yield make
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def flip(path: str, nbytes: int = 64) -> None:
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid:mid + nbytes] = bytes(b ^ 0xFF for b in data[mid:mid + nbytes])
    open(path, "wb").write(bytes(data))


def canonical_equal(a: str, b: str, iteration: int) -> None:
    from megatron_cai.training.checkpoint import load_any_canonical

    ca, cb = (load_any_canonical(r, iteration) for r in (a, b))
    assert ca.model.keys() == cb.model.keys()
    for k in ca.model:
        assert torch.equal(ca.model[k], cb.model[k]), k
    for n, st in ca.optimizer["param_state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], cb.optimizer["param_state"][n][key]), (n, key)


# ------------------------------------------------------------------------------------- integrity
def test_flipped_bytes_in_a_torch_checkpoint_are_one_error(base, tmp_path):
    run_dir = copy_run(base, tmp_path, 4)
    flip(rank_file(run_dir, 4))
    before = snapshot(run_dir)
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--save-interval", "1"])
    assert_one_error(proc, rank_file(run_dir, 4), "hash mismatch", "rank 0", "expected hash", "found",
                     "iter_0000003", "--ckpt-step 3")
    assert_kept(before, run_dir, allow_new=False)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "verify_checkpoint.py"), run_dir, "--all"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.count(": ok (") == 3 and "iter_0000004: FAILED" in proc.stdout
    assert_resumes_bit_exactly(run_dir, 3, base, tmp_path)


@pytest.fixture(scope="module")
def dist_base(tmp_path_factory) -> str:
    """The base run's first three iterations as torch_dist checkpoints written by --async-save, two ranks."""
    root = str(tmp_path_factory.mktemp("dist") / "ckpt")
    procs = launch_ranks([*BASE[:-1], "3", "--global-batch-size", "4", "--save", root, "--save-interval", "1",
                          "--ckpt-format", "torch_dist", "--async-save"], 2)
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return root


@pytest.mark.parametrize("damage", ["flip_distcp", "flip_metadata", "truncate_distcp"])
def test_damaged_async_torch_dist_checkpoint_is_one_error(dist_base, tmp_path, damage):
    run_dir = str(tmp_path / "run")
    shutil.copytree(dist_base, run_dir)
    it3 = os.path.join(run_dir, "iter_0000003")
    target = os.path.join(it3, "__1_0.distcp" if damage != "flip_metadata" else ".metadata")
    if damage == "truncate_distcp":
        data = open(target, "rb").read()
        open(target, "wb").write(data[: len(data) - 100])
    else:
        flip(target, 16)
    before = snapshot(run_dir)
    flags = [*BASE[:-1], "4", "--global-batch-size", "4", "--load", run_dir, "--save", run_dir,
             "--ckpt-format", "torch_dist"]
    procs = launch_ranks(flags, 2)
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    lines = [ln for _, e in outs for ln in e.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and target in lines[0] and "iter_0000002" in lines[0], outs
    assert ("truncated" if damage == "truncate_distcp" else "hash mismatch") in lines[0]
    assert "Traceback" not in "".join(o + e for o, e in outs)
    assert_kept(before, run_dir)
    canonical_equal(run_dir, dist_base, 2)  # the last good iteration is intact


def test_a_flip_anywhere_in_any_format_is_one_error_naming_the_file(base, dist_base, dist_sync, tmp_path):
    """Every file of a checkpoint is in its manifest, in both formats, saved synchronously or by --async-save;
    one flipped byte anywhere in any of them (the manifest too) makes loading raise one error naming it."""
    from megatron_cai.training.checkpoint import CheckpointError, verify_checkpoint

    torch_async = str(tmp_path / "torch_async")
    proc = run([*BASE[:-1], "2", "--save", torch_async, "--save-interval", "1", "--async-save"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {"torch sync": (base, 2), "torch async": (torch_async, 2), "torch_dist sync": (dist_sync, 2),
             "torch_dist async": (dist_base, 3)}
    for case, (root, it) in cases.items():
        d = os.path.join(root, f"iter_{it:07d}")
        on_disk = sorted(os.path.relpath(os.path.join(w, f), d) for w, _, fs in os.walk(d) for f in fs)
        listed = sorted(json.load(open(os.path.join(d, "checksums.json")))["files"])
        assert [f for f in on_disk if f != "checksums.json"] == listed and len(listed) >= 2, (case, on_disk)
        verify_checkpoint(root, it)  # intact: verifies
        for rel in on_disk:
            path = os.path.join(d, rel)
            for offset in each_byte_flipped(path):
                with pytest.raises(CheckpointError) as e:
                    verify_checkpoint(root, it)
                assert path in str(e.value) and "hash mismatch" in str(e.value), (case, rel, offset, str(e.value))


# ----------------------------------------------------------------------------------- overwrites
@pytest.mark.parametrize("where", ["other_run", "same_run"])
def test_resuming_an_earlier_step_never_replaces_later_iterations(base, tmp_path, where):
    """--load A --ckpt-step 3 --save B (B holds another run's 4-6), and --save A itself (the README's advice
    after a divergence): refused; with --overwrite-checkpoints the later iterations are moved aside intact."""
    src = copy_run(base, tmp_path, 3)
    if where == "same_run":
        dst = copy_run(base, tmp_path / "s", FINAL)
        src = dst
    else:
        dst = str(tmp_path / "B")
        os.makedirs(dst)
        for i in (4, 5, 6):
            shutil.copytree(os.path.join(base, f"iter_{i:07d}"), os.path.join(dst, f"iter_{i:07d}"))
        open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w").write("6")
    before_src, before_dst = snapshot(src), snapshot(dst)
    argv = [*BASE, "--load", src, "--ckpt-step", "3", "--save", dst, "--save-interval", "1"]
    assert_one_error(run(argv), dst, "iter_0000004, iter_0000005, iter_0000006", "--overwrite-checkpoints")
    assert_kept(before_src, src, allow_new=False)
    assert_kept(before_dst, dst, allow_new=False)
    proc = run([*argv, "--overwrite-checkpoints"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert tracker(dst) == FINAL
    aside = sorted(n for n in os.listdir(dst) if ".superseded-" in n)
    assert [n[:12] for n in aside] == ["iter_0000004", "iter_0000005", "iter_0000006"]
    moved = {f"iter_{n[5:12]}" + k[len(n):]: v for n in aside for k, v in snapshot(dst).items() if k.startswith(n)}
    assert moved == {k: v for k, v in before_dst.items() if k.startswith(("iter_0000004", "iter_0000005",
                                                                        "iter_0000006"))}
    assert_same_state(rank_file(dst, FINAL), rank_file(base, FINAL))


def test_a_save_iteration_reached_twice_saves_once(base, tmp_path):
    """--exit-interval on a save iteration: one save, never a replacement of the published directory."""
    run_dir = copy_run(base, tmp_path, 2)
    before = snapshot(run_dir)
    proc = run([*BASE, "--load", run_dir, "--save", run_dir, "--save-interval", "2", "--exit-interval", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("saved checkpoint at iteration       4") == 1, proc.stdout[-3000:]
    assert "moved" not in proc.stdout and tracker(run_dir) == 4
    before.pop("latest_checkpointed_iteration.txt")
    assert_kept(before, run_dir)
    assert_same_state(rank_file(run_dir, 4), rank_file(base, 4))


def test_two_jobs_on_one_save_directory(base, tmp_path):
    """A second job on the same --save (a requeue overlapping its predecessor) is refused, naming the holder;
    the first goes on unaffected."""
    save, go_on = str(tmp_path / "run"), str(tmp_path / "go_on")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_PAUSE_AT": "4",
           "FAULT_PAUSE_UNTIL": go_on}
    first = subprocess.Popen([sys.executable, INJECT, *BASE, "--save", save, "--save-interval", "1"], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while tracker(save) != 3 and time.time() - t0 < 180:  # the first job waits before iteration 4
            time.sleep(0.1)
        before = snapshot(save)
        second = run([*BASE, "--load", save, "--save", save, "--save-interval", "1"])
        assert_one_error(second, f"--save {save} is in use by another job", f"process {first.pid} on host")
        assert_kept(before, save, allow_new=False)
        open(go_on, "w").close()
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert tracker(save) == FINAL and not os.path.exists(os.path.join(save, LOCK))
    assert_same_state(rank_file(save, FINAL), rank_file(base, FINAL))


# ------------------------------------------------------------------------------------------ paths
def test_save_that_is_a_file_or_read_only_fails_at_start(tmp_path, tmpfs):
    afile = str(tmp_path / "afile")
    open(afile, "w").write("x")
    proc = run([*BASE, "--save", afile, "--save-interval", "1"])
    assert_one_error(proc, f"--save {afile} exists and is not a directory")
    assert "iteration        1/" not in proc.stdout  # refused before training, not after a save interval
    ro = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
    proc = run([*BASE, "--save", os.path.join(ro, "ckpt"), "--save-interval", "1"])
    assert_one_error(proc, f"--save {os.path.join(ro, 'ckpt')} is not writable", "read-only file system")


def test_read_only_file_system_mid_run_keeps_the_last_checkpoint(base, tmp_path, tmpfs):
    save = os.path.join(tmpfs("4m"), "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_ITER_SLEEP": "0.5"}
    proc = subprocess.Popen([sys.executable, INJECT, *BASE, "--save", save, "--save-interval", "2"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while tracker(save) != 2 and time.time() - t0 < 180:
        time.sleep(0.05)
    subprocess.run(["mount", "-o", "remount,ro", os.path.dirname(save)], check=True)
    before = snapshot(save)
    proc.wait(timeout=300)
    proc_result = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.read(), proc.stderr.read())
    assert_one_error(proc_result, "iter_0000004", "read-only file system")
    assert tracker(save) == 2
    assert_kept(before, save, allow_new=False)
    assert_resumes_bit_exactly(save, 2, base, tmp_path)


def test_torch_dist_on_a_full_disk_names_the_file_and_the_cause(base, tmp_path, tmpfs):
    save = os.path.join(tmpfs("700k"), "run")
    proc = run([*BASE, "--save", save, "--save-interval", "1", "--ckpt-format", "torch_dist"])
    line = assert_one_error(proc, "no space left on device", save, "the previous checkpoint stays current")
    good = tracker(save)
    assert good is not None and f"iter_{good + 1:07d}.tmp" in line
    copy = str(tmp_path / "copy")
    shutil.copytree(save, copy, ignore=shutil.ignore_patterns("*.tmp", LOCK))
    ref = str(tmp_path / "ref")
    assert run([*BASE[:-1], str(good), "--save", ref, "--ckpt-format", "torch_dist"]).returncode == 0
    canonical_equal(copy, ref, good)  # what was published before the disk filled is the run's state


# ------------------------------------------------------------------------------------- tokenizer
def _tokenizer(path: str, seed: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(62)]
    g = torch.Generator().manual_seed(seed)
    order = [words[i] for i in torch.randperm(62, generator=g).tolist()]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(order)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)
    return path


def test_a_replaced_tokenizer_is_noticed_on_resume(tmp_path):
    pytest.importorskip("tokenizers")
    tok = _tokenizer(str(tmp_path / "tokenizer.json"), 0)
    flags = ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, *MODEL]
    save = str(tmp_path / "run")
    assert run([*flags, "--train-iters", "2", "--save", save]).returncode == 0
    _tokenizer(tok, 1)  # same path, same vocabulary size, other ids
    before = snapshot(save)
    proc = run([*flags, "--train-iters", "3", "--load", save, "--save", save])
    assert_one_error(proc, tok, "not the one checkpoint", "--allow-tokenizer-change")
    assert_kept(before, save, allow_new=False)
    proc = run([*flags, "--train-iters", "3", "--load", save, "--save", save, "--allow-tokenizer-change"])
    assert proc.returncode == 0 and "WARNING: the tokenizer" in proc.stdout, proc.stderr[-2000:]
    # a fine-tune may change it too (iteration 2 was saved with the first tokenizer, 3 with this one)
    proc = run([*flags, "--train-iters", "1", "--load", save, "--ckpt-step", "2", "--finetune"])
    assert proc.returncode == 0 and "WARNING: the tokenizer" in proc.stdout, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------ bad numbers
@pytest.mark.parametrize("flag, value, needle", [
    ("--seq-length", "0", "--seq-length 0: out of range"),
    ("--micro-batch-size", "0", "--micro-batch-size 0: out of range"),
    ("--vocab-size", "0", "--vocab-size 0: out of range"),
    ("--hidden-dropout", "2", "--hidden-dropout 2.0: out of range, must be finite and >= 0 and < 1"),
])
def test_out_of_range_flags_are_one_error(flag, value, needle):
    argv = list(BASE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    assert_one_error(run(argv), needle)


@pytest.mark.parametrize("data", [["SPLIT", "0,0,0"], ["-1", "P", "1", "P"], ["nan", "P", "1", "P"]])
def test_bad_split_and_data_weights_are_one_error(tmp_path, data):
    prefix = write_corpus(str(tmp_path / "c_text_document"), [[1, 2, 3, 4] * 10] * 8)
    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *MODEL, "--train-iters", "2"]
    if data[0] == "SPLIT":
        argv += ["--data-path", prefix, "--split", data[1]]
    else:
        argv += ["--data-path", *[prefix if x == "P" else x for x in data], "--split", "1,0,0"]
    assert_one_error(run(argv), "--split '0,0,0'" if data[0] == "SPLIT" else "--data-path weights must be finite")


def test_a_malformed_tree_sidecar_is_one_error(tmp_path):
    prefix = write_corpus(str(tmp_path / "t_text_document"), [[1, 2, 3, 4] * 10] * 8)
    open(prefix + ".tree", "wb").write(b"not a sidecar at all" * 4)
    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *MODEL, "--train-iters", "2",
            "--data-path", prefix, "--split", "1,0,0"]
    assert_one_error(run(argv), prefix + ".tree", "not a tree sidecar")


# -------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("minutes", [0.1, pytest.param(1, marks=pytest.mark.slow)])  # 1: the case
def test_a_stopped_rank_makes_the_others_exit_naming_it(tmp_path, minutes):
    """--distributed-timeout-minutes 0.1 (6 s; 1 minute in the slow case) and rank 1 SIGSTOPped mid-run: rank 0
    exits within the timeout plus 60 s with one error line naming rank 1."""
    timeout = minutes * 60
    procs = launch_ranks(["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", "1000",
                          "--distributed-timeout-minutes", str(minutes)], 2, env={"FAULT_ITER_SLEEP": "0.05"})
    try:
        for line in procs[1].stdout:
            if "iteration        3/" in line:
                break
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        out, err = procs[0].communicate(timeout=timeout + 60 + 30)
        waited = time.time() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 2 and waited < timeout + 60, (waited, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "rank(s) 1 stopped answering" in lines[0], err[-3000:]
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------- small things
def test_generate_reads_torch_dist(dist_sync):
    save = dist_sync
    gen = os.path.join(ROOT, "tools", "generate.py")
    proc = run(["--load", save, "--tokenizer-type", "NullTokenizer", "--prompt", "1 2 3", "--max-new-tokens", "4",
                "--seed", "1"], script=gen)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.split()) >= 7  # the prompt and four new tokens


def test_fsdp2_under_torchrun_with_one_process(tmp_path):
    save = str(tmp_path / "fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           "--master-port", "0", os.path.join(ROOT, "pretrain_gpt.py"), *BASE[:-1], "2",
                           "--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--save", save, "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert tracker(save) == 2
    assert json.load(open(os.path.join(save, "iter_0000002", "metadata.json")))["data_parallel_kind"] == "fsdp2"

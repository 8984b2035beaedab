"""Issue 39's checkpoint attacks as real processes: loading never runs code from a checkpoint, the manifest cannot be
downgraded or steered outside the iteration directory, the run lock is no write primitive, and a load from a
directory another job is saving into reads a published iteration.

Every pickle payload is planted the way an attacker would: the file is rewritten and ``checksums.json``
recomputed (an unkeyed hash proves nothing about who wrote it). A payload that runs creates a marker file; each
entry point must leave no marker and exit with one ``error:`` line (status 2).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch
from testlib import ROOT

from .test_faults import BASE, INJECT, assert_kept, assert_one_error, copy_run, rank_file, run, snapshot, tracker

TOOLS = os.path.join(ROOT, "tools")
CONVERT = os.path.join(TOOLS, "convert_checkpoint.py")
MANIFEST = "checksums.json"


class Payload:
    """Unpickling it runs ``exec``, which creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _hash(data: bytes) -> str:
    from megatron_cai.training.checkpoint import ALGORITHMS, DEFAULT_ALGORITHM

    h = ALGORITHMS[DEFAULT_ALGORITHM]()
    h.update(data)
    return h.hexdigest()


def manifest_hash(algorithm: str, files: dict) -> str:
    return _hash(json.dumps({"algorithm": algorithm, "files": files}, sort_keys=True, separators=(",", ":")).encode())


def recompute_manifest(iteration_dir: str) -> None:
    """Rewrite ``checksums.json`` for the files as they are now (what anyone with write access can do)."""
    from megatron_cai.training.checkpoint import DEFAULT_ALGORITHM

    files = {}
    for d, _, names in os.walk(iteration_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), iteration_dir)
            if rel != MANIFEST:
                data = open(os.path.join(d, n), "rb").read()
                files[rel] = {"hash": _hash(data), "bytes": len(data), "rank": 0}
    manifest = {"format": 1, "algorithm": DEFAULT_ALGORITHM, "files": files,
                "manifest_hash": manifest_hash(DEFAULT_ALGORITHM, files)}
    with open(os.path.join(iteration_dir, MANIFEST), "w") as f:
        json.dump(manifest, f)


def plant_in_torch_file(path: str, marker: str) -> None:
    payload = torch.load(path, weights_only=False)  # our own file: trusted here
    payload["opt_param_scheduler"] = {"state": payload["opt_param_scheduler"], "extra": Payload(marker)}
    torch.save(payload, path)
    recompute_manifest(os.path.dirname(os.path.dirname(path)))


def plant_in_dcp_metadata(iteration_dir: str, marker: str) -> None:
    path = os.path.join(iteration_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - our own file
    md.planner_data = Payload(marker)  # a field DCP keeps as it is
    with open(path, "wb") as f:
        pickle.dump(md, f)
    recompute_manifest(iteration_dir)


def plant_in_dcp_object(iteration_dir: str, marker: str) -> None:
    """The ``common`` byte object inside the ``.distcp`` file (a torch.save pickle DCP writes for non-tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(os.path.join(iteration_dir, ".metadata"), "rb") as f:
        saved = pickle.load(f).state_dict_metadata  # noqa: S301 - our own file
    sd = {k: None if isinstance(v, BytesStorageMetadata) else torch.empty(v.size, dtype=v.properties.dtype)
          for k, v in saved.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(iteration_dir),
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    sd["common"] = {**sd["common"], "extra": Payload(marker)}
    for name in os.listdir(iteration_dir):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(os.path.join(iteration_dir, name))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(iteration_dir),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    recompute_manifest(iteration_dir)


def _copy(src: str, tmp_path, name: str = "src") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _assert_refused(proc, marker: str, *needles: str) -> None:
    assert not os.path.exists(marker), "the payload ran"
    assert_one_error(proc, *needles)


# ----------------------------------------------------------------------------- 1. safe loading
@pytest.mark.parametrize("where", ["torch_rank_file", "dcp_metadata", "dcp_object"])
def test_pretrain_load_never_runs_a_payload(base, dist_sync, tmp_path, where):
    marker = str(tmp_path / "marker")
    if where == "torch_rank_file":
        root = copy_run(base, tmp_path, 4)
        target = rank_file(root, 4)
        plant_in_torch_file(target, marker)
        flags = [*BASE, "--load", root, "--save", root]
    else:
        root = _copy(dist_sync, tmp_path)
        d = os.path.join(root, "iter_0000002")
        (plant_in_dcp_metadata if where == "dcp_metadata" else plant_in_dcp_object)(d, marker)
        target = os.path.join(d, ".metadata") if where == "dcp_metadata" else d
        flags = [*BASE[:-1], "3", "--load", root, "--save", root, "--ckpt-format", "torch_dist"]
    before = snapshot(root)
    _assert_refused(run(flags), marker, target, "not plain", "--trust-checkpoint-code")
    assert_kept(before, root, allow_new=False)


@pytest.mark.slow  # the opt-in's behaviour is unit-tested (test_safe_load.py); this is the whole process
def test_trust_checkpoint_code_is_explicit_and_says_what_it_allows(base, tmp_path):
    """The opt-in runs the old, pickled path, and says so first (here: a payload, to show what it allows)."""
    marker = str(tmp_path / "marker")
    root = copy_run(base, tmp_path, 4)
    plant_in_torch_file(rank_file(root, 4), marker)
    proc = run([*BASE[:-1], "5", "--load", root, "--trust-checkpoint-code", "--no-load-optim"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--trust-checkpoint-code: checkpoint files that are not plain data are unpickled" in proc.stdout
    assert os.path.exists(marker)  # what the flag allows, by design


@pytest.mark.parametrize("tool", ["generate", "reshard", "to_torch_dist", "to_hf", "to_megatron", "verify"])
def test_tools_never_run_a_payload_in_a_torch_file(base, tmp_path, tool):
    marker = str(tmp_path / "marker")
    root = copy_run(base, tmp_path, 2)
    plant_in_torch_file(rank_file(root, 2), marker)
    out = str(tmp_path / "out")
    argv, script = {
        "generate": (["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu"], "generate.py"),
        "reshard": (["--load", root, "--save", out, "--target-tensor-parallel-size", "1",
                     "--target-pipeline-model-parallel-size", "1"], "convert_checkpoint.py"),
        "to_torch_dist": (["--load", root, "--save", out, "--target-ckpt-format", "torch_dist"],
                          "convert_checkpoint.py"),
        "to_hf": (["--load", root, "--save", out, "--to", "hf"], "convert_checkpoint.py"),
        "to_megatron": (["--load", root, "--save", out, "--to-megatron"], "convert_checkpoint.py"),
        "verify": ([root], "verify_checkpoint.py"),
    }[tool]
    _assert_refused(run(argv, script=os.path.join(TOOLS, script)), marker, rank_file(root, 2), "not plain")


def test_converting_torch_dist_never_runs_a_payload_in_its_metadata(dist_sync, tmp_path):
    marker = str(tmp_path / "marker")
    root = _copy(dist_sync, tmp_path)
    plant_in_dcp_metadata(os.path.join(root, "iter_0000002"), marker)
    proc = run(["--load", root, "--save", str(tmp_path / "out")], script=CONVERT)
    _assert_refused(proc, marker, os.path.join(root, "iter_0000002", ".metadata"), "not plain")


def test_megatron_torch_dist_import_never_runs_a_payload_in_its_metadata(base, tmp_path):
    from megatron_cai.interop.megatron import export_to_megatron

    marker = str(tmp_path / "marker")
    mlm = str(tmp_path / "megatron")
    export_to_megatron(base, mlm, step=2, ckpt_format="torch_dist", log=lambda *a: None)
    it_dir = os.path.join(mlm, "iter_0000002")
    path = os.path.join(it_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - written just above
    md.planner_data = Payload(marker)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    proc = run(["--from-megatron", "--load", mlm, "--save", str(tmp_path / "out")], script=CONVERT)
    _assert_refused(proc, marker, path, "not plain")
    proc = run(["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", mlm, "--save-dir",
                str(tmp_path / "out2")], script=os.path.join(TOOLS, "checkpoint", "convert.py"))  # Megatron's tool
    _assert_refused(proc, marker, path, "not plain")


def test_hf_import_of_a_pickled_bin_is_one_error_line(base, tmp_path):
    from safetensors.torch import load_file

    from megatron_cai.interop.hf import export_to_hf

    marker = str(tmp_path / "marker")
    hf = str(tmp_path / "hf")
    export_to_hf(base, hf, step=2, log=lambda *a: None)
    weights = dict(load_file(os.path.join(hf, "model.safetensors")))
    os.remove(os.path.join(hf, "model.safetensors"))
    torch.save({**weights, "extra": Payload(marker)}, os.path.join(hf, "pytorch_model.bin"))
    proc = run(["--from", "hf", "--load", hf, "--save", str(tmp_path / "out")], script=CONVERT)
    _assert_refused(proc, marker, os.path.join(hf, "pytorch_model.bin"), "not plain")


# ------------------------------------------------------------------------------ 2. the manifest
def _tamper(root: str, case: str, tmp_path) -> str:
    """Damage iteration 4's manifest as ``case`` says; the text the error must hold."""
    d = os.path.join(root, "iter_0000004")
    path = os.path.join(d, MANIFEST)
    if case == "missing":
        os.remove(path)
        return "has no content hashes"
    if case == "symlink":  # the rank file becomes a link to an identical copy outside: same bytes, same hash
        outside = str(tmp_path / "outside.pt")
        shutil.move(rank_file(root, 4), outside)
        os.symlink(outside, rank_file(root, 4))
        return "symbolic link"
    m = json.load(open(path))
    if case == "unknown_algorithm":  # the downgrade: an algorithm the installation lacks (no xxhash)
        from megatron_cai.training.checkpoint import ALGORITHMS

        m["algorithm"] = "xxh3_64" if "xxh3_64" not in ALGORITHMS else "xxh128"
        open(path, "w").write(json.dumps(m))
        return f"{m['algorithm']!r}"
    name, expect = {"dotdot": ("../../outside.txt", "(..)"), "absolute": ("/etc/hostname", "an absolute path"),
                    "dev_zero": ("/dev/zero", "an absolute path")}[case]
    target = os.path.normpath(os.path.join(d, name))
    if case == "dotdot":
        open(target, "w").write("outside the checkpoint")
    data = open(target, "rb").read() if case != "dev_zero" else None  # an older loader read /dev/zero forever
    m["files"][name] = {"hash": _hash(data) if data is not None else "0" * 16,
                        "bytes": len(data) if data is not None else 1 << 40, "rank": 0}
    m["manifest_hash"] = manifest_hash(m["algorithm"], m["files"])
    open(path, "w").write(json.dumps(m))
    return expect


@pytest.mark.parametrize("case", ["unknown_algorithm", "missing", "dotdot", "absolute", "dev_zero", "symlink"])
def test_a_downgraded_or_steered_manifest_is_one_error_within_seconds(base, tmp_path, case):
    root = copy_run(base, tmp_path, 4)
    needle = _tamper(root, case, tmp_path)
    before = snapshot(root)
    t0 = time.time()
    proc = run([*BASE, "--load", root, "--save", root], timeout=120)  # /dev/zero hung main forever
    assert_one_error(proc, os.path.join(root, "iter_0000004"), needle)
    assert time.time() - t0 < 60  # start-up included; the check itself takes milliseconds (test_safe_load.py)
    assert_kept(before, root, allow_new=False)


def test_the_verifier_refuses_a_downgraded_manifest(base, tmp_path):
    root = copy_run(base, tmp_path, 4)
    needle = _tamper(root, "unknown_algorithm", tmp_path)
    proc = run([root], script=os.path.join(TOOLS, "verify_checkpoint.py"))
    assert_one_error(proc, needle)


# ------------------------------------------------------------------------------------ 3. the lock
def test_a_symlinked_lock_file_leaves_its_target_untouched(tmp_path):
    save = str(tmp_path / "run")
    os.makedirs(save)
    victim = str(tmp_path / "victim.txt")
    open(victim, "w").write("precious\n" * 100)
    os.symlink(victim, os.path.join(save, ".megatron_cai.lock"))
    proc = run([*BASE[:-1], "1", "--save", save])
    assert_one_error(proc, os.path.join(save, ".megatron_cai.lock"), "symbolic link", victim)
    assert open(victim).read() == "precious\n" * 100
    assert tracker(save) is None


def _unshare_available() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_job_in_another_pid_namespace_never_trains_on_a_live_jobs_save(tmp_path):
    if not _unshare_available():
        pytest.skip("cannot create a PID namespace here (unshare --pid needs privileges)")
    save, go_on = str(tmp_path / "run"), str(tmp_path / "go_on")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_PAUSE_AT": "3",
           "FAULT_PAUSE_UNTIL": go_on}
    first = subprocess.Popen([sys.executable, INJECT, *BASE[:-1], "4", "--save", save, "--save-interval", "1"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while tracker(save) != 2 and time.time() - t0 < 180:  # the first job waits before iteration 3
            time.sleep(0.1)
        before = snapshot(save)
        second = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, INJECT, *BASE,
                                 "--load", save, "--save", save, "--save-interval", "1"], cwd=ROOT,
                                env={**env, "FAULT_PAUSE_AT": ""}, capture_output=True, text=True, timeout=180)
        assert_one_error(second, f"--save {save} is in use by another job", f"process {first.pid} on host",
                         "another PID namespace")
        assert "iteration        3/" not in second.stdout
        assert_kept(before, save, allow_new=False)
        open(go_on, "w").close()
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert tracker(save) == 4


# --------------------------------------------------------------------------- 8. readers and writers
def test_a_load_while_another_job_saves_and_prunes_reads_a_published_iteration(tmp_path):
    """A reader chooses iteration 2 of a directory another job saves into; before it reads, the writer publishes
    3 and 4 and removes 2 (--save-retain-interval). The reader loads the newest published one and says so."""
    save, go_on, pause = str(tmp_path / "run"), str(tmp_path / "go_on"), str(tmp_path / "reader")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_PAUSE_AT": "3",
           "FAULT_PAUSE_UNTIL": go_on}
    writer = subprocess.Popen([sys.executable, INJECT, *BASE[:-1], "4", "--save", save, "--save-interval", "1",
                               "--save-retain-interval", "100"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    reader = None
    try:
        t0 = time.time()
        while tracker(save) != 2 and time.time() - t0 < 180:
            time.sleep(0.1)
        reader = subprocess.Popen([sys.executable, INJECT, *BASE[:-1], "5", "--load", save, "--save",
                                   str(tmp_path / "reader_run")], cwd=ROOT,
                                  env={**env, "FAULT_PAUSE_AT": "", "FAULT_PAUSE_CHOSEN": pause},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not os.path.exists(pause + ".paused") and time.time() - t0 < 180:
            time.sleep(0.1)
        open(go_on, "w").close()  # the writer publishes 3 and 4, removing 2 and 3
        _, werr = writer.communicate(timeout=300)
        assert writer.returncode == 0 and tracker(save) == 4, werr[-3000:]
        assert not os.path.exists(os.path.join(save, "iter_0000002"))
        open(pause + ".go", "w").close()
        out, err = reader.communicate(timeout=300)
    finally:
        for p in (writer, reader):
            if p is not None:
                p.kill()
    assert reader.returncode == 0, (out + err)[-3000:]
    assert "went away while this job chose it" in out and f"loaded checkpoint from {save} at iteration 4" in out


def test_a_recomputed_manifest_fails_its_signature(tmp_path):
    """The issue's bypass (rewrite a file, recompute checksums.json) against a run saved with
    --checkpoint-signing-key: the verifier and --load refuse it; an untouched signed checkpoint resumes."""
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    root = str(tmp_path / "run")
    signed = ["--checkpoint-signing-key", str(key)]
    proc = run([*BASE[:-1], "2", "--save", root, "--save-interval", "1", *signed])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hmac_sha256" in json.load(open(os.path.join(root, "iter_0000002", MANIFEST)))
    verify = os.path.join(TOOLS, "verify_checkpoint.py")
    assert run([root, "--all", *signed], script=verify).returncode == 0
    marker = str(tmp_path / "marker")
    plant_in_torch_file(rank_file(root, 2), marker)  # and the manifest recomputed, unsigned
    m = json.load(open(os.path.join(root, "iter_0000002", MANIFEST)))
    old = json.load(open(os.path.join(root, "iter_0000001", MANIFEST)))["hmac_sha256"]
    open(os.path.join(root, "iter_0000002", MANIFEST), "w").write(json.dumps({**m, "hmac_sha256": old}))
    assert_one_error(run([root, *signed], script=verify), "do not match their signature")
    assert_one_error(run([*BASE[:-1], "3", "--load", root, *signed]), "do not match their signature")
    assert not os.path.exists(marker)
    proc = run([*BASE[:-1], "2", "--load", root, "--ckpt-step", "1", *signed])
    assert proc.returncode == 0 and f"loaded checkpoint from {root} at iteration 1" in proc.stdout, proc.stderr

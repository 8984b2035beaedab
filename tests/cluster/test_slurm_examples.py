"""examples/slurm/*.sbatch under a real Slurm 22.05 (one node, this machine), submitted as a user would.

Each script is submitted with ``sbatch`` from a fresh copy of the repository, at CPU scale. What changes:

- a test copy of the script with the bodies of its four flag arrays (``DATA_ARGS``, ``PARALLEL_ARGS``,
  ``MODEL_ARGS``, ``TRAINING_ARGS``) replaced by a tiny model on mock data; every other line runs as
  shipped (the ``#SBATCH`` lines, the output path, the trap, the rendezvous, the launch line);
- sbatch options on the command line for the node's size (``--nodes=1 --ntasks-per-node ...
  --cpus-per-task ... --gpus-per-node=0``) and, where a case needs it, ``--time`` / ``--signal``;
- the environment variables the scripts read: ``CKPT`` (and ``GPUS_PER_NODE`` for torchrun).

Every job's end is read back from ``sacct`` (state and exit code), and each case checks it against what
examples/slurm/README.md promises. The table of every job is printed at the end of the module
(``pytest -s``) and written to ``sacct_table.md`` in the session's temporary directory.
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch

from .slurm_cluster import TERMINAL_STATES, JobEnd, SlurmCluster

pytestmark = pytest.mark.cluster
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
TINY = {
    "DATA_ARGS": "--mock-data --vocab-size 64",
    "MODEL_ARGS": "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                  "--max-position-embeddings 16 --position-embedding-type rope --squared-relu",
}
SRUN_PARALLEL = "--use-distributed-optimizer --overlap-grad-reduce --squinch"
TORCHRUN_PARALLEL = "--use-distributed-optimizer --overlap-grad-reduce --squinch --squinch-hierarchical"
NODE_ARGS = {"srun": ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"],
             "torchrun": ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=0"]}
SCRIPTS = {"srun": "pretrain_gpt_srun.sbatch", "torchrun": "pretrain_gpt_torchrun.sbatch"}
JOB_NAMES = {"srun": "megatron-cai-srun", "torchrun": "megatron-cai"}
TABLE: list[tuple[str, JobEnd]] = []


def training_args(train_iters: int, save_interval: int, extra: str = "") -> str:
    return (f"--micro-batch-size 2 --global-batch-size 4 --train-iters {train_iters} --lr 3e-4 --min-lr 3e-5 "
            f"--lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1 --eval-interval 0 --num-workers 0 "
            f"--save-interval {save_interval} {extra}")


def cpu_scale_copy(checkout: str, kind: str, out_dir: str, train_iters: int, save_interval: int) -> str:
    """The test copy of the example script: its four flag arrays at CPU scale, every other line as shipped."""
    with open(os.path.join(checkout, "examples", "slurm", SCRIPTS[kind])) as f:
        text = f.read()
    bodies = {**TINY, "PARALLEL_ARGS": SRUN_PARALLEL if kind == "srun" else TORCHRUN_PARALLEL,
              "TRAINING_ARGS": training_args(train_iters, save_interval,
                                             '--tensorboard-dir "$CKPT/tensorboard"' if kind == "torchrun" else "")}
    for name, body in bodies.items():
        text, n = re.subn(rf"^{name}=\(.*?\)\n", f"{name}=({body})\n", text, flags=re.S | re.M)
        assert n == 1, f"{SCRIPTS[kind]}: no single {name}=(...) array"
    path = os.path.join(out_dir, f"{kind}-{train_iters}-{save_interval}.sbatch")
    with open(path, "w") as f:
        f.write(text)
    return path


class Jobs:
    """Submits the test copies from the checkout and reads their logs, checkpoints and sacct records."""

    def __init__(self, cluster: SlurmCluster, checkout: str, env: dict, tmp: str) -> None:
        self.cluster, self.checkout, self.env, self.tmp = cluster, checkout, env, tmp

    def submit(self, kind: str, ckpt: str, train_iters: int, save_interval: int, *sbatch_args: str) -> str:
        script = cpu_scale_copy(self.checkout, kind, self.tmp, train_iters, save_interval)
        env = {**self.env, "CKPT": ckpt, "GPUS_PER_NODE": "2"}
        return self.cluster.sbatch([*NODE_ARGS[kind], *sbatch_args, script], cwd=self.checkout, env=env)

    def log_path(self, kind: str, job: str) -> str:
        return os.path.join(self.checkout, f"{JOB_NAMES[kind]}-{job}.out")  # #SBATCH --output=%x-%j.out

    def log(self, kind: str, job: str) -> str:
        path = self.log_path(kind, job)
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def wait_log(self, kind: str, job: str, pattern: str, timeout: float = 180) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.log(kind, job)
            if re.search(pattern, text):
                return text
            if self.cluster.scontrol_state(job) in TERMINAL_STATES:  # not UNKNOWN: scontrol can time out under load
                break
            time.sleep(0.1)
        raise AssertionError(f"job {job}: no {pattern!r} in its log (state {self.cluster.scontrol_state(job)}):\n"
                             f"{self.log(kind, job)[-4000:]}\n{self.cluster.logs()}")

    def usr1_mid_training(self, case: str, kind: str, job: str, ckpt: str) -> tuple[str, int]:
        """``scancel --signal=USR1`` once the job logs iteration 5: it saves and ends COMPLETED 0:0. Its log and the
        saved iteration."""
        self.wait_log(kind, job, r"iteration\s+5/")
        self.cluster.scancel("--signal=USR1", job)
        end = self.end(case, kind, job)
        text = self.log(kind, job)
        assert end.row == "COMPLETED 0:0", text[-3000:]
        saved = exit_iteration(text)
        assert saved >= 5 and tracker(ckpt) == saved
        return text, saved

    def end(self, case: str, kind: str, job: str, timeout: float = 300) -> JobEnd:
        """The job's sacct record once it ends; a job that does not end in time fails the test with its own log (the
        daemons' logs alone do not say where a job stands)."""
        try:
            end = self.cluster.wait_end(job, timeout)
        except TimeoutError as e:
            raise AssertionError(f"{case}: job {job} did not end in {timeout} s; its log:\n"
                                 f"{self.log(kind, job)[-4000:]}\n{e}") from None
        TABLE.append((case, end))
        return end


def losses(text: str) -> dict[int, tuple[str, str]]:
    """Each logged iteration's (lm loss, grad norm), as printed."""
    return {int(m.group(1)): (m.group(3), m.group(4)) for m in ITERATION.finditer(text)}


def tracker(ckpt: str) -> int | None:
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def assert_same_tensors(a, b, where: str = "") -> None:
    """Every tensor of two checkpoint objects is bit-identical (other leaves are not compared)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        for k in a:
            if isinstance(a[k], (dict, list, tuple, torch.Tensor)):
                assert k in b, f"{where}/{k}"
                assert_same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")


def assert_same_checkpoint(a: str, b: str) -> None:
    files = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs if f.endswith(".pt"))
    assert files, f"no .pt files in {a}"
    for rel in files:
        assert_same_tensors(torch.load(os.path.join(a, rel), weights_only=False),
                            torch.load(os.path.join(b, rel), weights_only=False), rel)


@pytest.fixture(scope="module")
def jobs(cluster, checkout, job_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    yield Jobs(cluster, checkout, job_env, str(out))
    rows = ["| case | job | State | ExitCode |", "|---|---|---|---|"]
    rows += [f"| {case} | {end.job_id} | {end.state} | {end.exit_code} |" for case, end in TABLE]
    with open(out / "sacct_table.md", "w") as f:
        f.write("\n".join(rows) + "\n")
    print("\n" + "\n".join(rows))


def launch_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(" > launch:")]
    assert len(lines) == 1, f"one world, launched once per job start: {lines}"
    return lines[0]


def exit_iteration(text: str) -> int:
    m = re.search(r"exit signal received at iteration (\d+): saved and exiting", text)
    assert m, text[-3000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def time_limited(jobs, tmp_path_factory) -> tuple[str, str, str]:
    """An srun job that would train for ever, with a 3-minute limit and SIGUSR1 60 s before it (Slurm checks time
    limits every 30 s and may signal up to 60 s early: 60-120 s in); once it trains, a second job on its CKPT.
    Submitted by the first test, so that their minutes overlap the others. (job, its CKPT, the second job)"""
    ckpt = str(tmp_path_factory.mktemp("time_limited") / "ckpt")
    job = jobs.submit("srun", ckpt, 1_000_000, 1_000_000, "--time=3", "--signal=USR1@60")
    jobs.wait_log("srun", job, r"iteration\s+1/")
    return job, ckpt, jobs.submit("srun", ckpt, 1_000_000, 1_000_000)


# ------------------------------------------------------------------------------------------------ srun script
def test_srun_preempted_and_resubmitted_equals_an_uninterrupted_run(jobs, time_limited, tmp_path):
    """One world of 2 ranks; checkpoints; scancel --signal=USR1 mid-training saves and ends COMPLETED 0:0; the
    resubmitted job resumes at that iteration and ends bit-identical to an uninterrupted job (losses and state)."""
    iters, interval = 300, 100
    ref_ckpt, cut_ckpt = str(tmp_path / "reference"), str(tmp_path / "preempted")
    ref = jobs.submit("srun", ref_ckpt, iters, interval)
    cut = jobs.submit("srun", cut_ckpt, iters, interval)
    text, saved = jobs.usr1_mid_training("srun: scancel --signal=USR1 mid-training", "srun", cut, cut_ckpt)
    assert saved < iters
    assert launch_line(text).startswith(f" > launch: slurm, 2 rank(s) = 1 node(s) x 2 rank(s) per node, "
                                        f"rendezvous {jobs.cluster.node}:{20000 + int(cut) % 20000};")
    assert os.path.exists(jobs.log_path("srun", cut)), "the log sits in the submission directory"

    again = jobs.submit("srun", cut_ckpt, iters, interval)
    resumed = jobs.end("srun: resubmitted after the preemption", "srun", again)
    text2 = jobs.log("srun", again)
    assert resumed.row == "COMPLETED 0:0", text2[-3000:]
    assert f"loaded checkpoint from {cut_ckpt} at iteration {saved}" in text2
    assert min(losses(text2)) == saved + 1
    assert re.search(rf"iteration\s+{saved + 1}/\s*{iters} \| consumed samples:\s+{4 * (saved + 1)} \|", text2)

    reference = jobs.end("srun: uninterrupted reference", "srun", ref)
    ref_text = jobs.log("srun", ref)
    assert reference.row == "COMPLETED 0:0", ref_text[-3000:]
    assert tracker(ref_ckpt) == iters == tracker(cut_ckpt)
    combined, straight = {**losses(text), **losses(text2)}, losses(ref_text)
    assert sorted(combined) == sorted(straight) == list(range(1, iters + 1))
    # As Megatron-LM, a job's first log line does not reset its loss window: the resumed job's second line
    # averages its two iterations (the grad norm is the iteration's own).
    second = saved + 2
    assert float(combined[second][0]) == pytest.approx(
        (float(straight[second - 1][0]) + float(straight[second][0])) / 2, rel=2e-6)
    assert {i: v for i, v in combined.items() if i != second} == {i: v for i, v in straight.items() if i != second}
    assert combined[second][1] == straight[second][1]
    assert_same_checkpoint(os.path.join(cut_ckpt, f"iter_{iters:07d}"), os.path.join(ref_ckpt, f"iter_{iters:07d}"))


def test_srun_time_limit_saves_before_the_limit(jobs, time_limited):
    """--time=3 --signal=USR1@60: the job saves and ends COMPLETED 0:0 before its limit, not TIMEOUT. A second job
    on its CKPT while it trained was refused with one error line (FAILED 2:0) and did not disturb it."""
    job, ckpt, intruder = time_limited
    refused = jobs.end("srun: a second job on a running job's CKPT", "srun", intruder)
    errors = [line for line in jobs.log("srun", intruder).splitlines() if line.startswith("error:")]
    assert refused.row == "FAILED 2:0" and len(errors) == 1 and ckpt in errors[0], jobs.log("srun", intruder)[-3000:]
    end = jobs.end("srun: --time=3 --signal=USR1@60 (time limit)", "srun", job, timeout=240)
    text = jobs.log("srun", job)
    assert end.row == "COMPLETED 0:0", text[-3000:]
    saved = exit_iteration(text)
    assert saved > 0 and tracker(ckpt) == saved
    assert f"saved checkpoint at iteration {saved:7d}" in text
    assert jobs.cluster.elapsed_seconds(job) < 180


def test_an_output_directory_that_does_not_exist_fails_the_job_before_it_runs(jobs, tmp_path):
    """Why the scripts log to the submission directory: Slurm opens --output before the script runs."""
    missing = tmp_path / "logs"
    job = jobs.cluster.sbatch([f"--output={missing}/%x-%j.out", "--wrap", "echo ran"], cwd=str(tmp_path))
    end = jobs.end("--output in a directory that does not exist", "srun", job, timeout=60)
    assert end.row == "FAILED 0:53" and not missing.exists()


def test_scancel_signal_before_the_step_starts_is_lost(jobs, tmp_path):
    """Why a preemption test waits for the step (``wait_step``), and the README's warning: ``scancel --signal=USR1``
    while the batch script has not started its step yet reaches no process; sent once the step runs, it does."""
    step = ("sleep 6; srun bash -c 'trap \"echo step got USR1; exit 0\" USR1; "
            "for i in $(seq 20); do sleep 0.5; done; echo step ran out'")
    early, late = (jobs.cluster.sbatch([f"--output={tmp_path}/{name}.out", "--wrap", step], cwd=str(tmp_path))
                   for name in ("early", "late"))
    jobs.cluster.wait_state(early, ("RUNNING",), 60)
    jobs.cluster.scancel("--signal=USR1", early)
    jobs.cluster.wait_step(late, 60)
    time.sleep(1)  # bash -c has set its trap
    jobs.cluster.scancel("--signal=USR1", late)
    assert jobs.end("scancel --signal=USR1 before the step starts", "srun", early).row == "COMPLETED 0:0"
    assert jobs.end("scancel --signal=USR1 once the step runs", "srun", late).row == "COMPLETED 0:0"
    assert (tmp_path / "early.out").read_text() == "step ran out\n"
    late_lines = (tmp_path / "late.out").read_text().splitlines()  # and bash's note on its sleep, killed by USR1
    assert "step got USR1" in late_lines and "step ran out" not in late_lines


# -------------------------------------------------------------------------------------------- torchrun script
def test_two_torchrun_jobs_on_one_node_never_meet(jobs, tmp_path):
    """Two torchrun jobs share the node, each with its own rendezvous; cancelling one leaves the other training
    to the end, COMPLETED 0:0."""
    stays, goes = str(tmp_path / "stays"), str(tmp_path / "goes")
    kept = jobs.submit("torchrun", stays, 600, 300)
    cancelled = jobs.submit("torchrun", goes, 1_000_000, 1_000_000)
    kept_text = jobs.wait_log("torchrun", kept, r"iteration\s+3/")
    gone_text = jobs.wait_log("torchrun", cancelled, r"iteration\s+3/")
    assert "iteration      600/" not in jobs.log("torchrun", kept), "the kept job must still train at the cancel"
    jobs.cluster.scancel(cancelled)
    gone = jobs.end("torchrun: scancel of one of two jobs on the node", "torchrun", cancelled)
    end = jobs.end("torchrun: the other job on the node", "torchrun", kept)
    text = jobs.log("torchrun", kept)
    assert gone.state == "CANCELLED"
    assert end.row == "COMPLETED 0:0", text[-3000:]
    assert tracker(stays) == 600 and "Broken pipe" not in text and "RendezvousConnectionError" not in text
    ports = {re.search(r"rendezvous \S+?:(\d+);", launch_line(t)).group(1) for t in (kept_text, gone_text)}
    assert len(ports) == 2, ports
    assert os.listdir(os.path.join(stays, "tensorboard")), "--tensorboard-dir wrote its events"


def test_torchrun_usr1_five_seconds_after_start(jobs, tmp_path):
    """SIGUSR1 5 s after the job's step starts (start-up: imports, rendezvous, model build): no signal death, exit 0.
    Counted from the step, not from the job's RUNNING: Slurm loses a ``scancel --signal`` sent before the batch
    script has started its step (examples/slurm/README.md)."""
    ckpt = str(tmp_path / "ckpt")
    job = jobs.submit("torchrun", ckpt, 1_000_000, 1_000_000)
    jobs.cluster.wait_step(job, 120)
    time.sleep(5)
    jobs.cluster.scancel("--signal=USR1", job)
    end = jobs.end("torchrun: scancel --signal=USR1 5 s after start", "torchrun", job)
    text = jobs.log("torchrun", job)
    assert end.row == "COMPLETED 0:0", text[-3000:]
    assert "User defined signal" not in text and "SignalException" not in text
    during = "during start-up: exiting before the first iteration, nothing saved" in text
    assert during or exit_iteration(text) == tracker(ckpt), text[-3000:]
    if during:
        assert tracker(ckpt) is None and not ITERATION.search(text)


def test_torchrun_usr1_mid_training_then_scontrol_requeue(jobs, tmp_path):
    """Start 1: SIGUSR1 mid-training; torchrun survives it, every rank saves, COMPLETED 0:0. `scontrol requeue`
    starts the same job ID again with no flag changed: start 2 resumes from that checkpoint and is requeued while
    it trains, after its next save; start 3 resumes from that one and trains to the end. One log holds all three."""
    ckpt, iters, interval = str(tmp_path / "ckpt"), 300, 20
    job = jobs.submit("torchrun", ckpt, iters, interval)
    _, saved = jobs.usr1_mid_training("torchrun: scancel --signal=USR1 mid-training", "torchrun", job, ckpt)
    assert saved < iters

    jobs.cluster.requeue(job)  # a finished job
    resume_at = (saved // interval + 1) * interval
    jobs.wait_log("torchrun", job, rf"saved checkpoint at iteration\s+{resume_at} ", timeout=300)
    jobs.cluster.requeue(job)  # a running job: Slurm sends SIGTERM, the ranks save, then it starts again
    jobs.wait_log("torchrun", job, r"=== job \d+, start 3,", timeout=300)
    last = jobs.end("torchrun: after two scontrol requeue", "torchrun", job)
    text = jobs.log("torchrun", job)
    assert last.row == "COMPLETED 0:0", text[-3000:]
    starts = [text.index(f"=== job {job}, start {n},") for n in (1, 2, 3)]  # --open-mode=append
    assert starts == sorted(starts)
    second, third = text[starts[1]:starts[2]], text[starts[2]:]
    assert f"loaded checkpoint from {ckpt} at iteration {saved}" in second
    resumed = int(re.search(rf"loaded checkpoint from {re.escape(ckpt)} at iteration (\d+)", third).group(1))
    assert resumed >= resume_at
    assert tracker(ckpt) == iters and re.search(rf"iteration\s+{iters}/\s*{iters} \|", third)
    rows = jobs.cluster.sacct_all_starts(job)
    TABLE.append(("torchrun: every start of the requeued job (sacct -D)", JobEnd(job, " / ".join(rows), "")))

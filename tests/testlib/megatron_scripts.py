"""Run Megatron-LM's example launch scripts (tests/fixtures/megatron_scripts) with a stand-in torchrun.

The stand-in records the argument list the script passes to ``pretrain_gpt.py`` (record mode), or replaces
the values of the size flags named in ``overrides`` and starts this repository's ``pretrain_gpt.py``
(run mode: one process, or ``nproc`` ranks through torch.distributed.run). Nothing else in the script's
command line changes.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_scripts"
GPT3 = "train_gpt3_175b_distributed.sh"
LLAMA = "train_llama3_8b_h100_fp8.sh"

_TORCHRUN = r'''#!{python}
import json, os, sys
argv = sys.argv[1:]
at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
args = argv[at + 1:]
if os.environ.get("STANDIN_RECORD"):
    with open(os.environ["STANDIN_RECORD"], "w") as f:
        json.dump(args, f)
    sys.exit(0)
for flag, values in json.loads(os.environ["STANDIN_OVERRIDES"]).items():
    if flag in args:
        i = args.index(flag)
        args[i + 1:i + 1 + len(values)] = values
launch = []
if os.environ.get("STANDIN_NPROC"):  # several ranks on this machine: the real torchrun, standalone
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", os.environ["STANDIN_NPROC"]]
os.execv(sys.executable, [sys.executable, *launch, os.environ["STANDIN_PRETRAIN"], *args])
'''


def _standin(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "standin_bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "torchrun"
    exe.write_text(_TORCHRUN.replace("{python}", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (tmp / "pretrain_gpt.py").touch()  # the Llama script checks that it runs from a Megatron-LM checkout
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["STANDIN_PRETRAIN"] = str(ROOT / "pretrain_gpt.py")
    return env


def script_argv(name: str, script_args: list[str], tmp: Path) -> list[str]:
    """The arguments the script passes to pretrain_gpt.py (after the shell's own expansion)."""
    env = _standin(tmp)
    record = tmp / f"{name}.argv.json"
    env["STANDIN_RECORD"] = str(record)
    proc = subprocess.run(["bash", str(FIXTURES / name), *script_args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(record.read_text())


def run_script(name: str, script_args: list[str], tmp: Path, overrides: dict[str, list[str]],
               timeout: int = 600, nproc: int | None = None) -> subprocess.CompletedProcess:
    """Run the script unchanged; the stand-in torchrun replaces only the values of ``overrides``' flags and
    starts one process, or ``nproc`` ranks through torch.distributed.run."""
    env = _standin(tmp)
    env["STANDIN_OVERRIDES"] = json.dumps(overrides)
    if nproc is not None:
        env["STANDIN_NPROC"] = str(nproc)
    return subprocess.run(["bash", str(FIXTURES / name), *script_args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)


def flags_of(argv: list[str]) -> list[str]:
    """The flags (``--name`` tokens) of an argument list, in order, without repeats."""
    seen: list[str] = []
    for a in argv:
        if a.startswith("--") and a not in seen:
            seen.append(a)
    return seen

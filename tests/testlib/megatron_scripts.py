"""Megatron-LM's own flag sets (tests/fixtures/megatron_scripts): launch scripts, per-model flag files,
release configurations and a documented flag list, as the argument lists they hand ``pretrain_gpt.py``.

Launch scripts run under bash with a stand-in ``torchrun`` (and ``uv`` / ``python -m torch.distributed.run``,
which the Megatron-FSDP script uses) that records the argument list the script passes to ``pretrain_gpt.py``
(record mode), or replaces the values of the size flags named in ``overrides`` and starts this repository's
``pretrain_gpt.py`` (run mode: one process, or ``nproc`` ranks through torch.distributed.run). Nothing else
in the script's command line changes. Per-model flag files are sourced by bash and their ``MODEL_ARGS``
read; release configurations are the ``MODEL_ARGS`` of Megatron-LM's functional-test YAML, turned into
flags as its launcher does (``true``: the switch; ``false``: left out).
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
GPT3_STEP = "train_gpt3_175b_step_schedule.sh"
LLAMA_FSDP = "train_llama3_8b_fsdp_h100_fp8.sh"
MIXTRAL = "train_mixtral_8x7b_distributed.sh"
MODEL_FLAG_FILES = sorted(p.name for p in (FIXTURES / "model_flags").glob("*.sh"))
RELEASE_CONFIGS = sorted(p.name for p in FIXTURES.glob("*.yaml"))
MISTRAL_DOC = "mistral_7b_launch_flags.txt"
# Megatron-LM's GPT functional-test configurations (tests/functional_tests/test_cases/gpt/<name>/model_config.yaml)
FUNCTIONAL_CONFIGS = sorted(p.stem for p in (FIXTURES / "functional_tests").glob("*.yaml"))
# their ${VAR} paths, as Megatron-LM's CI environment names them
FUNCTIONAL_DATA = "text/common_pile/v01_filtered_data"


def functional_env(root: Path) -> dict[str, str]:
    """The launcher's variables of a functional-test configuration, pointing under ``root``."""
    return {"DATA_PATH": str(root), "CHECKPOINT_SAVE_PATH": str(root / "ckpt"),
            "CHECKPOINT_LOAD_PATH": str(root / "ckpt"), "TENSORBOARD_PATH": str(root / "tb"),
            "DATA_CACHE_PATH": str(root / "cache")}


def functional_argv(name: str, env: dict[str, str]) -> list[str]:
    """A functional-test configuration's ``MODEL_ARGS`` as flags, as Megatron-LM's launcher expands them."""
    return release_argv(f"functional_tests/{name}.yaml", env)

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
# `uv run CMD...` runs CMD; `python -m torch.distributed.run ...` is torchrun; any other python call is python
_UV = '#!/bin/sh\n[ "$1" = run ] && shift\nexec "$@"\n'
_PYTHON = '#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then shift 2; exec torchrun "$@"; fi\n' \
          'exec {python} "$@"\n'


def _standin(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "standin_bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("torchrun", _TORCHRUN), ("uv", _UV), ("python", _PYTHON)):
        exe = bin_dir / name
        exe.write_text(text.replace("{python}", sys.executable))
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


def model_flags_argv(name: str) -> list[str]:
    """``MODEL_ARGS`` of a per-model flag file (sourced by bash, as Megatron-LM's scripts source it)."""
    proc = subprocess.run(["bash", "-c", 'source "$1" >/dev/null; printf "%s\\n" $MODEL_ARGS', "_",
                           str(FIXTURES / "model_flags" / name)], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "HF_MODEL_CKPT"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def release_argv(name: str, env: dict[str, str]) -> list[str]:
    """A release configuration's ``MODEL_ARGS`` as flags (``${VAR}`` / ``$VAR`` from ``env``)."""
    import yaml

    out: list[str] = []
    for flag, value in yaml.safe_load((FIXTURES / name).read_text())["MODEL_ARGS"].items():
        if value is False:
            continue
        out.append(flag)
        if value is not True:
            out.append(os.path.expandvars(str(value)) if not env else _expand(str(value), env))
    return out


def flags_file_argv(name: str, env: dict[str, str]) -> list[str]:
    """A documented flag list (shell line continuations), its ``${VAR}`` from ``env``."""
    return [_expand(t, env) for t in (FIXTURES / name).read_text().split() if t != "\\"]


def _expand(text: str, env: dict[str, str]) -> str:
    for key, value in env.items():
        text = text.replace("${" + key + "}", value).replace("$" + key, value)
    return text


# ------------------------------------------------------------------------------------ the demo corpus
def tool(name: str, *args) -> str:
    """Run tools/<name> (this repository's); its stdout."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def demo_corpus(tmp: Path, max_mb: float = 0.15) -> dict:
    """The demo corpus as JSONL and a byte-level BPE trained on it (GPT-2's vocab.json / merges.txt and a
    tokenizer.json)."""
    import tokenizers

    jsonl = tmp / "demo.jsonl"
    tool("make_demo_corpus.py", "--output", jsonl, "--max-mb", max_mb)
    texts = [json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(tmp))  # vocab.json, merges.txt (GPT-2's files)
    bpe.save(str(tmp / "tokenizer.json"))
    return {"dir": tmp, "jsonl": jsonl}


def preprocess(corpus: dict, name: str, *tokenizer_flags) -> str:
    """tools/preprocess_data.py on the demo corpus; the dataset prefix."""
    prefix = corpus["dir"] / name
    tool("preprocess_data.py", "--input", corpus["jsonl"], "--output-prefix", prefix, "--append-eod", "--workers", 1,
         *tokenizer_flags)
    return f"{prefix}_text_document"


def resize(argv: list[str], sizes: dict[str, list[str]]) -> list[str]:
    """``argv`` with the values of the flags in ``sizes`` replaced (flags not in ``argv`` are left out)."""
    out = list(argv)
    for flag, values in sizes.items():
        if flag in out:
            i = out.index(flag)
            j = i + 1
            while j < len(out) and not out[j].startswith("--"):
                j += 1
            out[i + 1:j] = values
    return out


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without these flags and their values."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a in flags
        if not skip:
            out.append(a)
    return out

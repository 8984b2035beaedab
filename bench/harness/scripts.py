"""Running the repository's own command-line scripts from a bench, as a user runs them.

``run_script("pretrain_gpt.py", argv)`` starts ``python pretrain_gpt.py ARGV`` (``tools/NAME.py`` alike) and
returns its output, also written to ``log``; a failure raises with the end of that output. With
``in_process`` (the ``--quick`` modes) the script's ``main(argv)`` runs in this process instead, its output
captured the same way, which saves an interpreter start per call.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

from harness.flags import BENCH

ROOT = os.path.dirname(BENCH)
_MODULES: dict[str, object] = {}


def load_module(script: str):
    """``script`` (a path relative to the repository root) imported under a name of its own, once: a bench's
    sibling module cannot be shadowed by a same-named module that another folder put on ``sys.path``."""
    if script not in _MODULES:
        name = "_script_" + os.path.splitext(os.path.basename(script))[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, script))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look a module up by its name
        spec.loader.exec_module(module)
        _MODULES[script] = module
    return _MODULES[script]


def run_script(script: str, argv: list[str], log: str | None = None, in_process: bool = False) -> str:
    """Run ``script`` (relative to the repository root) with ``argv``; its output (see the module docstring)."""
    t0 = time.time()
    if log is None:
        fd, log = tempfile.mkstemp(prefix="bench_", suffix=".log")
        os.close(fd)
    with open(log, "w") as f:
        if in_process:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                rc = load_module(script).main(list(argv))
        else:
            rc = subprocess.run([sys.executable, script, *argv], stdout=f, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT).returncode
    with open(log) as f:
        out = f.read()
    if rc not in (0, None):
        raise RuntimeError(f"{script} {' '.join(argv[:2])} failed ({rc}):\n{out[-4000:]}")
    print(f"   {os.path.basename(script)} {argv[0] if argv else ''}... done in {time.time() - t0:.0f} s", flush=True)
    return out

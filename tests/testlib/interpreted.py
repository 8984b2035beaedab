"""Run a test file as a script under the Triton interpreter (``TRITON_INTERPRET=1`` must be set before
Triton is imported, and would leak into every other module of the pytest process) and read back the one
JSON result line it prints as ``RESULT {...}``."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(path: str, timeout: float) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, os.path.abspath(path)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])

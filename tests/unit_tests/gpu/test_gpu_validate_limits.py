"""bench/gpu/validate.sh's step limits, read from the script itself: every step it runs has one, and on
the GPU (scale 1) they add up to at most 420 s (issue 26: the validation machine gives one command 10
minutes, start-up, transfers and the summary included). Fast: no step runs."""
from __future__ import annotations

import os
import re
import subprocess

from testlib import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu", "validate.sh")


def _script_limits() -> dict[str, int]:
    """Each step's limit as the script's own ``limit_of`` computes it on the GPU (SCALE=1)."""
    text = open(SCRIPT).read()
    limits_line = re.search(r"^LIMITS=\(.*\)$", text, re.M).group(0)
    limit_of = re.search(r"^limit_of\(\) \{.*\}$", text, re.M).group(0)
    steps = re.findall(r"^step (\w+) ", text, re.M) + re.findall(r"^\s*run (\w+) ", text, re.M)
    out = subprocess.run(["bash", "-c", f'SCALE=1\n{limits_line}\n{limit_of}\n'
                          f'for s in {" ".join(steps)}; do echo "$s=$(limit_of $s)"; done'],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {name: int(value) if value else 0 for name, value in (line.split("=") for line in out.split())}


def test_every_step_has_a_limit_and_they_add_up_to_at_most_420_s() -> None:
    limits = _script_limits()
    assert set(limits) == {"env", "codec", "attention", "training", "qat", "pytest"}, limits
    assert all(v > 0 for v in limits.values()), limits  # a step without a limit would run `timeout ""`
    assert sum(limits.values()) <= 420, limits

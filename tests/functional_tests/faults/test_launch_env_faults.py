"""Bad launcher variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK): one ``error:`` line naming the
variable, exit 2, no traceback and no wait for a rendezvous that cannot happen."""
from __future__ import annotations

import os

import pytest
from testlib import ROOT

from .test_faults import BASE, assert_one_error, run

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
GOOD = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "WORLD_SIZE": "2", "RANK": "0",
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("name, value, needle", [
    ("MASTER_ADDR", "no-such-host.invalid", "does not resolve"),
    ("MASTER_PORT", "99999", "integer in [1, 65536)"),
    ("WORLD_SIZE", "two", "integer >= 1"),
])
def test_bad_launcher_variable_is_one_error_line(name, value, needle):
    proc = run([*BASE, "--device", "cpu"], script=PRETRAIN, env={**GOOD, name: value}, timeout=60)
    assert_one_error(proc, f"environment variable {name}={value!r}", needle)


@pytest.mark.parametrize("name, value", [("RANK", "5"), ("RANK", "-1"), ("LOCAL_RANK", "x"), ("WORLD_SIZE", "0")])
def test_bad_rank_variables_name_the_variable(name, value):
    from megatron_cai.training.initialize import LaunchEnvError, discover_env

    with pytest.raises(LaunchEnvError, match=f"environment variable {name}={value!r}"):
        discover_env({**GOOD, name: value})
    assert discover_env(dict(GOOD)).rank == 0  # the good environment itself passes

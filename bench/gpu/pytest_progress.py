"""pytest plugin of the GPU validation's pytest step (``-p pytest_progress`` with bench/gpu on the path).

- ``MEGATRON_CAI_PYTEST_JSON=FILE``: FILE is rewritten after every test report and collection error
  (counts, every non-passing test with its first error line, the passing test ids), so a run stopped by
  its time limit still says what ran.
- ``MEGATRON_CAI_TEST_TIMEOUT_S=N``: a test running longer than N seconds fails with a TimeoutError (SIGALRM
  in the main thread; no plugin to install) and the run goes on with the next test.
- Tests whose id mentions ``flex`` run last: they compile FlexAttention, the slowest thing in the step.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

_STATE = {"status": "running", "counts": {}, "problems": [], "passed": [], "collection_errors": [],
          "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _write() -> None:
    path = os.environ.get("MEGATRON_CAI_PYTEST_JSON")
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(_STATE, f, indent=1)
    os.replace(path + ".tmp", path)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: "flex" in item.nodeid)  # stable: otherwise collection order


def pytest_collectreport(report):
    if report.failed:
        _STATE["collection_errors"].append({"nodeid": report.nodeid, "message": str(report.longrepr)[-300:]})
        _write()


def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.failed or report.skipped):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    _STATE["counts"][outcome] = _STATE["counts"].get(outcome, 0) + 1
    if outcome == "passed":
        _STATE["passed"].append(report.nodeid)
    else:
        text = str(report.longrepr) if report.longrepr else ""
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
        _STATE["problems"].append({"nodeid": report.nodeid, "outcome": outcome, "when": report.when,
                                   "seconds": round(report.duration, 2), "message": " / ".join(lines[:3])[:400]})
    _write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get("MEGATRON_CAI_TEST_TIMEOUT_S", "0") or 0)
    if limit <= 0:
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"test exceeded MEGATRON_CAI_TEST_TIMEOUT_S={limit} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_sessionfinish(session, exitstatus):
    _STATE["status"] = "finished"
    _STATE["exitstatus"] = int(exitstatus)
    _write()

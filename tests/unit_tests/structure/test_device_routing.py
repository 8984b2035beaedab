"""`torch.cuda.*` is called only from core/device.py (and GPU-only benchmarks): everything else asks the
device module, so CPU and CUDA share one code path and the CUDA calls live in one reviewed place."""
from __future__ import annotations

import ast
import os

import torch
from testlib import ROOT

from megatron_cai.core import device as dev

# Files allowed to call torch.cuda directly: the device module itself, and GPU-only benchmarks/checks.
ALLOWED = {"megatron_cai/core/device.py"}
ALLOWED_DIRS = ("bench/", "tests/", "docs/", "examples/")


def _python_files() -> list[str]:
    out = []
    for top in ("megatron_cai", "tools", "bench", "examples"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
            out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    out += [os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")]
    return out


def _cuda_calls(path: str) -> list[int]:
    """Line numbers of every `torch.cuda` attribute access (imports of torch.cuda included)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "torch.cuda" or n.startswith("torch.cuda.") for n in names):
                lines.append(node.lineno)
    return sorted(lines)


def test_torch_cuda_only_in_device_module() -> None:
    offenders = []
    for path in _python_files():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel in ALLOWED or rel.startswith(ALLOWED_DIRS):
            continue
        offenders += [f"{rel}:{ln}" for ln in _cuda_calls(path)]
    assert not offenders, "torch.cuda used outside core/device.py: " + ", ".join(offenders)


def test_scanner_finds_a_direct_call(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.cuda.is_available()\nfrom torch.cuda import Event\n")
    assert _cuda_calls(str(bad)) == [2, 3]


def test_device_helpers_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert dev.device_capability(cpu) == 0
    assert dev.device_name(cpu) == "cpu"
    assert dev.default_device_name() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dev.new_timing_event(cpu) is None
    torch.manual_seed(0)
    dev.seed_device(cpu, 1234)
    a = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(3))


def test_rng_tracker_streams_are_seeded_through_device_module() -> None:
    from megatron_cai.core.tensor_parallel.random import RNGStatesTracker

    tracker = RNGStatesTracker()
    tracker.reset(torch.device("cpu"))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    tracker.add("s", 99)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork("s"):
        got = torch.rand(4)
    torch.manual_seed(99)
    assert torch.equal(got, torch.rand(4))

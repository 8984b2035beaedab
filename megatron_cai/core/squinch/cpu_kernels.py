"""CPU fast path of the Squinch v1 codec: a small C kernel built with the system C compiler on first use.

The C source (cpu_source.py) is compiled once per machine (``gcc -O3 -march=native -ffp-contract=off``, no
fast-math, so division, products and sums round exactly like the torch reference) into
``~/.cache/megatron_cai/squinch/<hash>/libsquinch.so`` and called through ctypes on tensor data
pointers. ctypes releases the GIL, so large tensors are split into block ranges and run on a small
thread pool (``torch.get_num_threads()`` workers). The tables are pasted in from ``format.py``.

No compiler (or ``MEGATRON_CAI_SQUINCH_CPU=0``): ``load()`` returns None after logging one warning
and callers use the vectorized torch reference instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import format as fmt
from .cpu_source import c_source

log = logging.getLogger(__name__)

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_RES_CODE = {None: -1, torch.float32: 0, torch.bfloat16: 1}
_PARALLEL_MIN_BLOCKS = 1 << 14  # below this (128K elements) one thread is faster than a handoff


def _cpu_signature() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        pass
    return platform.machine() + flags


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megatron_cai", "squinch")


def _compile(src: str, so_path: str, defines: list[str]) -> str | None:
    """Compile `src` into `so_path` atomically; returns an error message or None."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        return "no C compiler found (gcc/cc/clang; set CC)"
    os.makedirs(os.path.dirname(so_path), exist_ok=True)
    base = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
    err = ""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(so_path)) as tmp:
        c_path = os.path.join(tmp, "squinch.c")
        with open(c_path, "w") as f:
            f.write(src)
        tmp_so = os.path.join(tmp, "libsquinch.so")
        for arch in (["-march=native"], []):
            cmd = [cc, *base, *arch, *defines, c_path, "-o", tmp_so]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                if err:
                    log.warning("squinch: C kernel built without -march=native (slower): %s", err)
                os.replace(tmp_so, so_path)
                return None
            err = proc.stderr.strip()[-2000:]
    return f"{cc} failed: {err}"


_lock = threading.Lock()
_state: dict = {}


VARIANTS = {"native": [], "generic": ["-DSQUINCH_GENERIC"]}


def load(variant: str = "native") -> ctypes.CDLL | None:
    """Build (once, cached on disk) and load the C kernel; None (one warning) if that is impossible.

    variant "native" uses the AVX-512 path where the CPU has it; "generic" forces the portable path
    (used by the tests to check both).
    """
    key_state = "lib" if variant == "native" else f"lib_{variant}"
    with _lock:
        if key_state in _state:
            return _state[key_state]
        lib = None
        if os.environ.get("MEGATRON_CAI_SQUINCH_CPU", "1") == "0":
            log.warning("squinch: CPU fast path disabled by MEGATRON_CAI_SQUINCH_CPU=0; using the torch path")
        else:
            src = c_source()
            defines = VARIANTS[variant]
            key = hashlib.sha256((src + _cpu_signature() + " ".join(defines)).encode()).hexdigest()[:16]
            so_path = os.path.join(_cache_dir(), key, "libsquinch.so")
            err = None
            if not os.path.exists(so_path):
                try:
                    err = _compile(src, so_path, defines)
                except OSError as e:  # unwritable cache, missing binaries, ...
                    err = str(e)
            if err is None:
                try:
                    lib = ctypes.CDLL(so_path)
                except OSError as e:
                    err = str(e)
            if lib is not None:
                i64, vp = ctypes.c_int64, ctypes.c_void_p
                lib.sq_encode.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, i64, i64, i64, vp,
                                          ctypes.c_int, ctypes.c_uint64]
                lib.sq_encode.restype = ctypes.c_uint32
                lib.sq_decode.argtypes = [vp, i64, i64, i64, i64, i64, vp, ctypes.c_int]
                lib.sq_decode.restype = None
                lib.sq_variant.restype = ctypes.c_int
            else:
                log.warning("squinch: CPU fast path unavailable (%s); using the torch reference", err)
        _state[key_state] = lib
        return lib


def available() -> bool:
    """True if the compiled CPU kernel can be used."""
    return load() is not None


def _pool() -> ThreadPoolExecutor:
    n = max(1, torch.get_num_threads())
    pool = _state.get("pool")
    if pool is None or _state.get("pool_n") != n:
        pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="squinch")
        _state["pool"], _state["pool_n"] = pool, n
    return pool


def _ranges(nb: int) -> list[tuple[int, int]]:
    if nb == 0:
        return [(0, 0)]
    nt = min(max(1, torch.get_num_threads()), max(1, nb // _PARALLEL_MIN_BLOCKS))
    step = -(-nb // nt)
    step = -(-step // 64) * 64  # keep chunk starts cache-line friendly
    return [(b, min(nb, b + step)) for b in range(0, nb, step)]


def _run(fn, ranges: list[tuple[int, int]]) -> list:
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    return list(_pool().map(lambda r: fn(*r), ranges))


def encode_into(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    stochastic: bool,
    seed: int,
    variant: str = "native",
) -> bool:
    """Encode x (+ residual, updated in place) into `out` (uint8); returns whether y held NaN/Inf.

    x, residual and out must be contiguous CPU tensors (x fp32/bf16/fp16, residual fp32/bf16).
    """
    lib = load(variant)
    assert lib is not None
    n = x.numel()
    nb = fmt.n_blocks(n)
    gp, rp, op = x.data_ptr(), (residual.data_ptr() if residual is not None else None), out.data_ptr()
    gd, rd = _DTYPE_CODE[x.dtype], _RES_CODE[None if residual is None else residual.dtype]
    st, sd = int(stochastic), seed & 0xFFFFFFFFFFFFFFFF

    def job(b0: int, b1: int) -> int:
        return lib.sq_encode(gp, gd, rp, rd, n, b0, b1, op, st, sd)

    res = _run(job, _ranges(nb))
    return max(res) >= 0x7F800000


def decode_into(
    payloads: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool, variant: str = "native"
) -> None:
    """Decode [W, nbytes] (or [nbytes]) uint8 payloads into the contiguous fp32 CPU tensor `out`.

    out = (out +) ((d_0 + d_1) + ... + d_{W-1}).
    """
    lib = load(variant)
    assert lib is not None
    p2 = payloads.reshape(-1, payloads.shape[-1]) if payloads.dim() > 1 else payloads.view(1, -1)
    W, stride = p2.shape[0], p2.stride(0)
    if W == 0:
        return
    pp, op, acc = p2.data_ptr(), out.data_ptr(), int(accumulate)

    def job(b0: int, b1: int) -> None:
        lib.sq_decode(pp, W, stride, n, b0, b1, op, acc)

    _run(job, _ranges(fmt.n_blocks(n)))

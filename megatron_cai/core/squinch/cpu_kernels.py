"""CPU fast path of the Squinch v1 codec: a small C kernel built with the system C compiler on first use.

The C source below is compiled once per machine (``gcc -O3 -march=native -ffp-contract=off``, no
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

log = logging.getLogger(__name__)

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_RES_CODE = {None: -1, torch.float32: 0, torch.bfloat16: 1}
_PARALLEL_MIN_BLOCKS = 1 << 14  # below this (128K elements) one thread is faster than a handoff

_C_TEMPLATE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static const uint16_t QTAB[4096] = {@QTAB@};
static const uint32_t SBITS[257] = {@SBITS@};
static const float S_F[256] = {@S@};
static const float B_F[16] = {@B@};
static const float L_F[16] = {@L@};

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define BCASTF(x) ((v8f){x, x, x, x, x, x, x, x})
#define BCASTU(x) ((v8u){x, x, x, x, x, x, x, x})

ALWAYS_INLINE v8u sel(v8i m, v8u a, v8u b) { return ((v8u)m & a) | (~(v8u)m & b); }

ALWAYS_INLINE uint32_t hmax_u(v8u v) {
    v8u t = __builtin_shuffle(v, (v8u){4, 5, 6, 7, 0, 1, 2, 3}); v = sel((v8i)(t > v), t, v);
    t = __builtin_shuffle(v, (v8u){2, 3, 0, 1, 6, 7, 4, 5}); v = sel((v8i)(t > v), t, v);
    t = __builtin_shuffle(v, (v8u){1, 0, 3, 2, 5, 4, 7, 6}); v = sel((v8i)(t > v), t, v);
    return v[0];
}

ALWAYS_INLINE uint32_t hor_u(v8u v) {
    v |= __builtin_shuffle(v, (v8u){4, 5, 6, 7, 0, 1, 2, 3});
    v |= __builtin_shuffle(v, (v8u){2, 3, 0, 1, 6, 7, 4, 5});
    v |= __builtin_shuffle(v, (v8u){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

ALWAYS_INLINE v8f half_to_float(v8u h) {  /* exact IEEE binary16 -> binary32 */
    v8u sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    v8u normal = sign | ((e + 112u) << 23) | (mant << 13);
    v8u infnan = sign | 0x7f800000u | (mant << 13);
    v8f subf = __builtin_convertvector((v8i)mant, v8f) * BCASTF(0x1p-24f);
    v8u sub = sign | (v8u)subf;
    return (v8f)sel((v8i)(e == 0u), sub, sel((v8i)(e == 31u), infnan, normal));
}

ALWAYS_INLINE v8f load8(const void *src, const int dt, int64_t e0, int cnt) {
    if (dt == 0) {
        float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(t, (const float *)src + e0, (size_t)cnt * 4);
        v8f v; memcpy(&v, t, 32); return v;
    }
    uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(h, (const uint16_t *)src + e0, (size_t)cnt * 2);
    v8h hv; memcpy(&hv, h, 16);
    v8u w = __builtin_convertvector(hv, v8u);
    if (dt == 1) return (v8f)(w << 16);
    return half_to_float(w);
}

ALWAYS_INLINE void store8(void *dst, const int dt, int64_t e0, int cnt, v8f v) {
    if (dt == 0) {
        float t[8]; memcpy(t, &v, 32);
        memcpy((float *)dst + e0, t, (size_t)cnt * 4);
        return;
    }
    /* bf16, round to nearest even; NaN stays a (quiet) NaN with its sign */
    v8u b = (v8u)v;
    v8u r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    r = sel((v8i)((b & 0x7fffffffu) > 0x7f800000u), (b >> 16) | 0x40u, r);
    v8h h = __builtin_convertvector(r, v8h);
    uint16_t t[8]; memcpy(t, &h, 16);
    memcpy((uint16_t *)dst + e0, t, (size_t)cnt * 2);
}

ALWAYS_INLINE v8u mix32(v8u x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16; return x;
}

ALWAYS_INLINE v8f uniform8(uint64_t seed, int64_t e0) {  /* counter-based uniforms in [0, 1) */
    v8u idx = BCASTU((uint32_t)e0) + (v8u){0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t hi = (uint32_t)((uint64_t)e0 >> 32) * 0x9e3779b9u;
    v8u h = mix32(idx ^ BCASTU((uint32_t)seed));
    h = mix32(h + BCASTU(((uint32_t)(seed >> 32)) ^ hi));
    return __builtin_convertvector((v8i)(h >> 8), v8f) * BCASTF(0x1p-24f);
}

/* Encode one block y (fp32, padded). Writes 6 bytes to out; returns the decoded block in *dec
   (when want_dec) and the max |y| bit pattern. */
ALWAYS_INLINE uint32_t enc_block(v8f y, uint8_t *out, const int stoch, uint64_t seed, int64_t e0,
                                 const int want_dec, v8f *dec) {
    const v8f LLO = {L_F[0], L_F[1], L_F[2], L_F[3], L_F[4], L_F[5], L_F[6], L_F[7]};
    const v8f LHI = {L_F[8], L_F[9], L_F[10], L_F[11], L_F[12], L_F[13], L_F[14], L_F[15]};
    v8u bits = (v8u)y & 0x7fffffffu;
    uint32_t mb = hmax_u(bits);
    uint32_t qm = QTAB[mb >> 19];
    qm += SBITS[qm] <= mb;
    if (qm > 255) qm = 255;
    float M = S_F[qm];
    v8f u = (v8f)bits / BCASTF(M);
    v8i q = {0, 0, 0, 0, 0, 0, 0, 0};
    if (!stoch) {
        for (int k = 1; k < 16; k++) q -= (v8i)(u >= BCASTF(B_F[k]));
    } else {
        v8i a = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 1; k < 16; k++) a -= (v8i)(u >= BCASTF(L_F[k]));
        v8i a1 = a + 1;
        a1 = (v8i)sel(a1 > 15, BCASTU(15u), (v8u)a1);
        v8f lo = __builtin_shuffle(LLO, LHI, a), hi = __builtin_shuffle(LLO, LHI, a1);
        v8f p = (u - lo) / (hi - lo);
        v8f r = uniform8(seed, e0);
        q = a - ((v8i)(r < p) & (v8i)(a < 15));
    }
    v8u neg = (v8u)(v8i)(y < BCASTF(0.0f));
    uint32_t sb = hor_u(neg & (v8u){1, 2, 4, 8, 16, 32, 64, 128});
    uint32_t word = hor_u((v8u)q << (v8u){0, 4, 8, 12, 16, 20, 24, 28});
    out[0] = (uint8_t)qm; out[1] = (uint8_t)sb;
    out[2] = (uint8_t)word; out[3] = (uint8_t)(word >> 8);
    out[4] = (uint8_t)(word >> 16); out[5] = (uint8_t)(word >> 24);
    if (want_dec) {
        v8f mag = BCASTF(M) * __builtin_shuffle(LLO, LHI, q);
        *dec = (v8f)((v8u)mag | (neg & BCASTU(0x80000000u)));
    }
    return mb;
}

ALWAYS_INLINE v8f dec_block(const uint8_t *p) {
    const v8f LLO = {L_F[0], L_F[1], L_F[2], L_F[3], L_F[4], L_F[5], L_F[6], L_F[7]};
    const v8f LHI = {L_F[8], L_F[9], L_F[10], L_F[11], L_F[12], L_F[13], L_F[14], L_F[15]};
    float M = S_F[p[0]];
    uint32_t sb = p[1];
    uint32_t word = (uint32_t)p[2] | ((uint32_t)p[3] << 8) | ((uint32_t)p[4] << 16) | ((uint32_t)p[5] << 24);
    v8i q = (v8i)((BCASTU(word) >> (v8u){0, 4, 8, 12, 16, 20, 24, 28}) & 15u);
    v8f mag = BCASTF(M) * __builtin_shuffle(LLO, LHI, q);
    v8u sgn = ((BCASTU(sb) >> (v8u){0, 1, 2, 3, 4, 5, 6, 7}) & 1u) << 31;
    return (v8f)((v8u)mag | sgn);
}

ALWAYS_INLINE uint32_t encode_impl(const void *g, const int gdt, void *res, const int rdt, int64_t n,
                                   int64_t b0, int64_t b1, uint8_t *out, const int stoch, uint64_t seed) {
    uint32_t mbmax = 0;
    for (int64_t b = b0; b < b1; b++) {
        int64_t e0 = b * 8;
        int cnt = (n - e0) < 8 ? (int)(n - e0) : 8;
        v8f y = load8(g, gdt, e0, cnt);
        if (rdt >= 0) y = y + load8(res, rdt, e0, cnt);
        v8f dec;
        uint32_t mb = enc_block(y, out + 6 * b, stoch, seed, e0, rdt >= 0, &dec);
        mbmax = mb > mbmax ? mb : mbmax;
        if (rdt >= 0) store8(res, rdt, e0, cnt, y - dec);
    }
    return mbmax;
}

#define ENC_CASE(G, R, ST) \
    if (gdt == G && rdt == R && stoch == ST) return encode_impl(g, G, res, R, n, b0, b1, out, ST, seed);
#define ENC_CASES_R(G, R) ENC_CASE(G, R, 0) ENC_CASE(G, R, 1)
#define ENC_CASES_G(G) ENC_CASES_R(G, -1) ENC_CASES_R(G, 0) ENC_CASES_R(G, 1)

/* Returns the max |y| bit pattern over the range (>= 0x7f800000 means NaN/Inf),
   0xffffffff for an unsupported dtype combination. */
uint32_t sq_encode(const void *g, int gdt, void *res, int rdt, int64_t n, int64_t b0, int64_t b1,
                   uint8_t *out, int stoch, uint64_t seed) {
    ENC_CASES_G(0) ENC_CASES_G(1) ENC_CASES_G(2)
    return 0xffffffffu;
}

ALWAYS_INLINE void decode_impl(const uint8_t *p, int64_t W, int64_t stride, int64_t n, int64_t b0,
                               int64_t b1, float *out, const int acc_out, const int single) {
    for (int64_t b = b0; b < b1; b++) {
        int64_t e0 = b * 8;
        int cnt = (n - e0) < 8 ? (int)(n - e0) : 8;
        v8f s;
        if (single) {
            s = dec_block(p + 6 * b);
        } else {
            s = BCASTF(-0.0f);  /* -0.0 is the exact additive identity: s = ((d0 + d1) + ...) */
            for (int64_t w = 0; w < W; w++) s = s + dec_block(p + w * stride + 6 * b);
        }
        if (acc_out) s = load8(out, 0, e0, cnt) + s;
        store8(out, 0, e0, cnt, s);
    }
}

void sq_decode(const uint8_t *p, int64_t W, int64_t stride, int64_t n, int64_t b0, int64_t b1,
               float *out, int accumulate) {
    if (W == 1 && !accumulate) decode_impl(p, 1, stride, n, b0, b1, out, 0, 1);
    else if (W == 1) decode_impl(p, 1, stride, n, b0, b1, out, 1, 1);
    else if (accumulate) decode_impl(p, W, stride, n, b0, b1, out, 1, 0);
    else decode_impl(p, W, stride, n, b0, b1, out, 0, 0);
}
"""


def c_source() -> str:
    """The C source with the format tables filled in (hex float literals, exact)."""

    def floats(vals: tuple[float, ...]) -> str:
        return ", ".join(float(v).hex() + "f" for v in vals)

    return (
        _C_TEMPLATE.replace("@QTAB@", ", ".join(str(v) for v in fmt.QMAX_BUCKET))
        .replace("@SBITS@", ", ".join(f"0x{v:08x}u" for v in fmt.S_BITS_EXT))
        .replace("@S@", floats(fmt.S))
        .replace("@B@", floats(fmt.B))
        .replace("@L@", floats(fmt.L))
    )


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


def _compile(src: str, so_path: str) -> str | None:
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
            proc = subprocess.run([cc, *base, *arch, c_path, "-o", tmp_so], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp_so, so_path)
                return None
            err = proc.stderr.strip()[-2000:]
    return f"{cc} failed: {err}"


_lock = threading.Lock()
_state: dict = {}


def load() -> ctypes.CDLL | None:
    """Build (once, cached on disk) and load the C kernel; None (one warning) if that is impossible."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib = None
        if os.environ.get("MEGATRON_CAI_SQUINCH_CPU", "1") == "0":
            log.warning("squinch: CPU fast path disabled by MEGATRON_CAI_SQUINCH_CPU=0; using the torch path")
        else:
            src = c_source()
            key = hashlib.sha256((src + _cpu_signature()).encode()).hexdigest()[:16]
            so_path = os.path.join(_cache_dir(), key, "libsquinch.so")
            err = None
            if not os.path.exists(so_path):
                try:
                    err = _compile(src, so_path)
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
            else:
                log.warning("squinch: CPU fast path unavailable (%s); using the torch reference", err)
        _state["lib"] = lib
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
) -> bool:
    """Encode x (+ residual, updated in place) into `out` (uint8); returns whether y held NaN/Inf.

    x, residual and out must be contiguous CPU tensors (x fp32/bf16/fp16, residual fp32/bf16).
    """
    lib = load()
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


def decode_into(payloads: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool) -> None:
    """Decode [W, nbytes] (or [nbytes]) uint8 payloads into the contiguous fp32 CPU tensor `out`.

    out = (out +) ((d_0 + d_1) + ... + d_{W-1}).
    """
    lib = load()
    assert lib is not None
    p2 = payloads.reshape(-1, payloads.shape[-1]) if payloads.dim() > 1 else payloads.view(1, -1)
    W, stride = p2.shape[0], p2.stride(0)
    if W == 0:
        return
    pp, op, acc = p2.data_ptr(), out.data_ptr(), int(accumulate)

    def job(b0: int, b1: int) -> None:
        lib.sq_decode(pp, W, stride, n, b0, b1, op, acc)

    _run(job, _ranges(fmt.n_blocks(n)))

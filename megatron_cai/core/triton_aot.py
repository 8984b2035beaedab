"""Ahead-of-time check of every Triton kernel in the package, with the real compiler and no GPU.

The real launchers (``triton_attention`` forward and backward, the Squinch ``encode_into`` /
``decode_into``) run on small CPU tensors while Triton is given a stand-in driver that reports a CUDA
target and every launch is turned into a warm-up: each kernel is compiled (ttir -> ttgir -> llir -> ptx
-> cubin with the bundled ptxas) exactly as the launcher would launch it on that GPU, and never run.
Launchers take their tiles from :mod:`kernel_configs` for the target's shared memory, so what is
compiled here is what runs there.

Per compiled kernel: registers and spill bytes from ``ptxas -v`` on the kernel's PTX (same flags as
Triton), shared memory from the compiled metadata. A kernel fails the check when it does not compile,
when it spills at head dim <= 128 (every Squinch kernel counts as such), when its shared memory exceeds
the target's per-block opt-in limit, or when it uses more than its table row declares.

Integer sizes are not specialised by the launchers (``do_not_specialize``), so one small shape per case
covers every sequence length and bucket size; pointer alignment is covered by an aligned and a
misaligned variant of the Squinch launches (the attention launcher aligns its tensors itself).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from megatron_cai.core import kernel_configs as kc

SPILL_HEAD_DIM_LIMIT = 128  # spills are failures at head dim <= this (and in every Squinch kernel)


@dataclass
class KernelRecord:
    """One compiled kernel (unique per target and compiled source) and the launches that use it."""

    kernel: str
    config: str
    target: str
    head_dim: int | None
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    smem_limit: int = 0
    declared_smem: int | None = None
    compile_s: float = 0.0
    wide_loads: int | None = None  # 16-byte global loads / stores in the PTX (vectorised accesses)
    wide_stores: int | None = None
    variants: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = list(self.errors)
        if self.spill_bytes and (self.head_dim is None or self.head_dim <= SPILL_HEAD_DIM_LIMIT):
            out.append(f"spills {self.spill_bytes} B")
        if self.shared_bytes is not None and self.shared_bytes > self.smem_limit:
            out.append(f"shared {self.shared_bytes} B > {self.target} limit {self.smem_limit} B")
        if self.declared_smem is not None and self.shared_bytes is not None and self.shared_bytes > self.declared_smem:
            out.append(f"shared {self.shared_bytes} B > table's declared {self.declared_smem} B")
        return out


# ------------------------------------------------------------------------------------ stand-in driver
def known_targets() -> dict[str, int]:
    """The AOT targets the installed Triton can compile for (sm_100 needs a Blackwell-aware Triton)."""
    from triton.backends.nvidia import compiler as nv

    out = {}
    for name, cap in kc.AOT_TARGETS.items():
        if cap >= 100 and not os.path.exists(nv.get_ptxas(cap).path):
            continue
        out[name] = cap
    return out


def _stand_in_driver(capability: int):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandInDriver(DriverBase):
        """Reports a CUDA target; never loads or launches anything (every launch is a warm-up)."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:  # pragma: no cover - launch path only
            raise RuntimeError("stand-in driver: no launches")

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):  # pragma: no cover
            raise RuntimeError("stand-in driver: no benchmarking")

        def get_current_device(self) -> str:
            return f"aot-sm_{capability}"

        def get_current_stream(self, device=None) -> int:
            return 0

    return StandInDriver()


@contextlib.contextmanager
def compile_only(target: kc.Target, on_compile: Callable[[object, float], None]) -> Iterator[None]:
    """Within: Triton compiles for `target` and launches nothing; launchers choose `target`'s tiles.

    ``on_compile(compiled_kernel, seconds)`` is called after every launch (cache hits included)."""
    from triton.runtime import jit
    from triton.runtime.driver import driver

    original_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        on_compile(kernel, time.perf_counter() - t0)
        return kernel

    saved = driver._active
    driver.set_active(_stand_in_driver(target.capability))
    jit.JITFunction.run = run
    try:
        with kc.override_target(target):
            yield
    finally:
        jit.JITFunction.run = original_run
        driver._active = saved


# ------------------------------------------------------------------------------------------- ptxas
_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_cache_path() -> str:
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.path.join(root, "megatron_cai_ptxas_stats.json")


def ptxas_stats(ptx: str, capability: int, fp_fusion: bool) -> tuple[int, int]:
    """(registers, spill bytes) of `ptx` from ``ptxas -v`` with Triton's flags; cached by PTX hash."""
    from triton.backends.nvidia import compiler as nv

    key = hashlib.sha256(f"{capability}|{fp_fusion}|".encode() + ptx.encode()).hexdigest()
    path = _ptxas_cache_path()
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return tuple(cache[key])
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [nv.get_ptxas(capability).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={nv.sm_arch_from_capability(capability)}", src,
               "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs = int(_PTXAS_RE["registers"].search(log).group(1))
    spills = sum(int(m) for name in ("spill_stores", "spill_loads") for m in _PTXAS_RE[name].findall(log))
    cache[key] = [regs, spills]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp_path = f"{path}.{os.getpid()}"
    with open(tmp_path, "w") as f:
        json.dump(cache, f)
    os.replace(tmp_path, path)
    return regs, spills


_WIDE_RE = re.compile(r"\b(ld|st)\.global[\w.:]*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b")


def wide_accesses(ptx: str) -> tuple[int, int]:
    """(16-byte global loads, 16-byte global stores) in a kernel's PTX."""
    ops = [m.group(1) for m in _WIDE_RE.finditer(ptx)]
    return ops.count("ld"), ops.count("st")


# --------------------------------------------------------------------------------- launcher cases
def _intervals(layout: str, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, seq] start/limit of a plain causal row, a packed-document row, or a tree row."""
    start = torch.arange(seq)
    if layout == "plain":
        limit = torch.full((seq,), seq)
    elif layout == "packed":  # documents of seq // 4 tokens
        limit = (start // (seq // 4) + 1) * (seq // 4)
    else:  # tree: a trunk, then two sibling branches that cannot see each other
        half = seq // 2
        limit = torch.where(start < half, seq, torch.where(start < half + seq // 4, half + seq // 4, seq))
    return start[None], limit[None]


def attention_cases(dtypes=kc.ATTENTION_DTYPES, head_dims=kc.ATTENTION_HEAD_DIMS,
                    layouts=("plain", "packed", "tree"), windows=(None, 16),
                    zregs=(0.0, 1e-4)) -> Iterator[tuple[str, int, Callable[[], None]]]:
    """(variant label, head dim, run) for forward + backward of every table row and variant."""
    from megatron_cai.core.transformer.triton_attention import triton_attention

    seq = 64
    for dtype in dtypes:
        for dim in head_dims:
            for layout in layouts:
                for window in windows:
                    for zreg in zregs:
                        if layout != "plain" and zreg:
                            continue
                        extras = (" window" if window else "") + (" zreg" if zreg else "")
                        label = f"{str(dtype)[6:]} d{dim} {layout}{extras}"

                        def run(dtype=dtype, dim=dim, layout=layout, window=window, zreg=zreg):
                            q = torch.zeros(1, 4, seq, dim, dtype=dtype, requires_grad=True)
                            k = torch.zeros(1, 2, seq, dim, dtype=dtype, requires_grad=True)
                            v = torch.zeros(1, 2, seq, dim, dtype=dtype, requires_grad=True)
                            start, limit = _intervals(layout, seq)
                            out, lse = triton_attention(q, k, v, start, limit, zreg_coeff=zreg, window=window)
                            torch.autograd.backward([out, lse], [torch.zeros_like(out), torch.zeros_like(lse)])

                        yield label, dim, run


def squinch_cases(dtypes=kc.SQUINCH_INPUT_DTYPES, residuals=kc.SQUINCH_RESIDUALS, stochastic=(False, True),
                  misaligned=(0, 1), wire_rows=(False, True)) -> Iterator[tuple[str, int | None, Callable[[], None]]]:
    """Encode (input dtype x residual x stochastic) and decode (accumulate), aligned and misaligned; the
    collectives' wire-row variants (encode writing every row's flag byte, decode reading them) for the
    fp32 / bf16 gradients and fp32 / no residual that the reducers use."""
    from megatron_cai.core.squinch import format as fmt
    from megatron_cai.core.squinch import triton_kernels as tk

    n = 4096
    for misalign in misaligned:
        for dtype in dtypes:
            for res in residuals:
                for stoch in stochastic:
                    for rows in wire_rows:
                        if rows and (dtype == torch.float16 or res == torch.bfloat16 or misalign):
                            continue
                        label = f"encode {str(dtype)[6:]} res={str(res)[6:] if res else 'none'}" \
                                f"{' stochastic' if stoch else ''}{' rows' if rows else ''}" \
                                f"{' misaligned' if misalign else ''}"

                        def run(dtype=dtype, res=res, stoch=stoch, o=misalign, rows=rows):
                            x = torch.zeros(n + o, dtype=dtype)[o:]
                            r = None if res is None else torch.zeros(n + o, dtype=res)[o:]
                            seed = torch.zeros(1, dtype=torch.int64) if stoch else None
                            if rows:  # two wire rows of n / 2 elements: payload | flag | padding
                                p = fmt.payload_nbytes(n // 2)
                                wire = torch.zeros(2, p + 16, dtype=torch.uint8)
                                tk.encode_rows_into(x, r, wire[:, :p], stoch, seed, wire[:, p:])
                            else:
                                out = torch.zeros(fmt.payload_nbytes(n) + o, dtype=torch.uint8)[o:]
                                tk.encode_into(x, r, out, stoch, seed)

                        yield label, None, run
        for acc, flags in ((False, False), (True, False), (False, True)):
            if flags and (misalign or not any(wire_rows)):
                continue

            def run(acc=acc, o=misalign, flags=flags):
                nbytes = fmt.payload_nbytes(n)
                payloads = torch.zeros(3 * (nbytes + 16) + o, dtype=torch.uint8)[o:].view(3, nbytes + 16)
                tk.decode_into(payloads[:, :nbytes], n, torch.zeros(n + o)[o:], acc,
                               payloads[:, nbytes] if flags else None)

            yield (f"decode{' accumulate' if acc else ''}{' rows' if flags else ''}"
                   f"{' misaligned' if misalign else ''}"), None, run


# ------------------------------------------------------------------------------------------- driver
def _config_of(kernel) -> tuple[str, str, int | None, int | None]:
    """(kernel name, config text, head dim or None, declared shared bytes or None)."""
    src, meta = kernel.src, kernel.metadata
    names = src.fn.arg_names
    consts = {names[path[0]]: val for path, val in src.constants.items() if len(path) == 1}
    sig = {k: v for k, v in src.signature.items() if v != "constexpr"}
    name = meta.name
    if name == "_bwd_delta_kernel":  # the backward's preprocess: rows per program, no table row
        dtype = sig["O"].lstrip("*")
        return name, f"{dtype} d{consts['HEAD_DIM']} {consts['BLOCK_M']} rows w{meta.num_warps}", \
            consts["HEAD_DIM"], None
    if "HEAD_DIM" in consts:
        dtype = sig["Q"].lstrip("*")
        tiles = kc.Tiles(consts["BLOCK_M"], consts["BLOCK_N"], meta.num_warps, meta.num_stages)
        role = {"_fwd_kernel": "fwd", "_bwd_dq_kernel": "bwd_dq", "_bwd_dkdv_kernel": "bwd_dkdv"}[name]
        kind = "fp32" if dtype == "fp32" else "16bit"
        row = kc.ATTENTION_TABLE.get((kc.ATTENTION_ROLES[role], kind, consts["BLOCK_D"]), ())
        declared = next((c[0] for c in row if c[1] == tiles), None)
        window = " window" if consts["HAS_WINDOW"] else ""
        return name, f"{dtype} d{consts['HEAD_DIM']} {tiles}{window}", consts["HEAD_DIM"], declared
    flags = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(consts.items()))
    ptrs = ",".join(f"{k}:{v.lstrip('*')}" for k, v in sig.items() if k in ("g_ptr", "r_ptr") and v.startswith("*"))
    align = "" if all(kernel.src.attrs.get((names.index(p),)) for p in ("out_ptr",)) else " misaligned"
    return name, f"{ptrs} {flags} w{meta.num_warps} s{meta.num_stages}{align}".strip(), None, None


def check_target(target: kc.Target, cases, log: Callable[[str], None] = print,
                 progress: str | None = None) -> list[KernelRecord]:
    """Compile every case for `target`; one record per distinct compiled kernel. ``progress``: a JSON
    file rewritten after every case with the records so far (survives an interrupted run)."""
    records: dict[tuple[str, str], KernelRecord] = {}
    current: dict[str, object] = {}

    def on_compile(kernel, seconds: float) -> None:
        name, config, head_dim, declared = _config_of(kernel)
        key = (name, kernel.hash)
        rec = records.get(key)
        if rec is None:
            rec = records[key] = KernelRecord(name, config, target.name, head_dim, smem_limit=target.smem_limit,
                                              declared_smem=declared, compile_s=round(seconds, 2))
            rec.shared_bytes = int(kernel.metadata.shared)
            rec.wide_loads, rec.wide_stores = wide_accesses(kernel.asm["ptx"])
            try:
                rec.registers, rec.spill_bytes = ptxas_stats(kernel.asm["ptx"], target.capability,
                                                             bool(kernel.metadata.enable_fp_fusion))
            except (subprocess.CalledProcessError, AttributeError) as e:
                rec.errors.append(f"ptxas -v failed: {e}")
        rec.variants.append(str(current["label"]))

    with compile_only(target, on_compile):
        for label, head_dim, run in cases:
            current["label"] = label
            try:
                run()
            except Exception as e:  # a compile failure is a result of the check, reported per case
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                rec = KernelRecord("(launch)", label, target.name, head_dim, smem_limit=target.smem_limit)
                rec.errors.append(msg)
                records[("(launch)", label)] = rec
                log(f"  FAIL {target.name} {label}: {msg}")
            if progress:
                with open(progress + ".tmp", "w") as f:
                    json.dump(to_json(list(records.values())), f)
                os.replace(progress + ".tmp", progress)
    return list(records.values())


def all_cases(subset: str = "full"):
    """Every launcher case ("full"), or the CI subset ("ci"): the three attention kernels at bf16, head
    dim 128 (the largest kernels that must not spill, and the sm_86/sm_89 shared-memory defect), and the
    fused encoder with error feedback and stochastic rounding plus decode-accumulate; or "hopper", what
    training on the validation machine compiles (bf16 at head dims 64 / 128 with and without a window,
    fp32 at 128, every Squinch kernel for fp32 / bf16 gradients), which CI checks for sm_90 with its
    Triton (3.6.0). The full set runs in tools/compile_kernels.py (bench/results/compile_kernels.md)."""
    if subset == "full":
        yield from attention_cases()
        yield from squinch_cases()
    elif subset == "hopper":
        yield from attention_cases(dtypes=(torch.bfloat16,), head_dims=(64, 128), layouts=("plain",), zregs=(0.0,))
        yield from attention_cases(dtypes=(torch.float32,), head_dims=(128,), layouts=("plain",), windows=(None,),
                                   zregs=(0.0,))
        yield from squinch_cases(dtypes=(torch.float32, torch.bfloat16), misaligned=(0,))
    elif subset == "ci":
        yield from attention_cases(dtypes=(torch.bfloat16,), head_dims=(128,), layouts=("plain",), windows=(None,),
                                   zregs=(0.0,))
        yield from squinch_cases(dtypes=(torch.float32,), residuals=(torch.float32,), stochastic=(True,),
                                 misaligned=(0,), wire_rows=(True,))
    else:
        raise ValueError(f"subset must be 'full', 'hopper' or 'ci', got {subset!r}")


def filter_cases(cases, only: str | None):
    """The cases whose label contains one of the comma-separated substrings of `only` (None: all)."""
    if not only:
        yield from cases
        return
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    for case in cases:
        if any(w in case[0] for w in wanted):
            yield case


def run_check(targets: list[str], subset: str = "full", log: Callable[[str], None] = print,
              progress_prefix: str | None = None, only: str | None = None) -> list[KernelRecord]:
    """Compile the cases for each named target ("sm_80", ...); returns every record. ``only``: keep the
    cases whose label ("float32 d128 plain window", "encode bfloat16 res=float32", ...) contains one of
    these comma-separated substrings (for iterating on a few table rows)."""
    out: list[KernelRecord] = []
    for name in targets:
        if name not in kc.AOT_TARGETS:
            raise ValueError(f"unknown target {name!r}: expected one of {sorted(kc.AOT_TARGETS)}")
        t0 = time.perf_counter()
        progress = f"{progress_prefix}.{name}.progress.json" if progress_prefix else None
        recs = check_target(kc.Target.for_capability(kc.AOT_TARGETS[name]),
                            filter_cases(all_cases(subset), only), log, progress)
        log(f"{name}: {len(recs)} kernels in {time.perf_counter() - t0:.1f} s")
        out.extend(recs)
    return out


def unexercised_candidates(records: list[KernelRecord]) -> list[str]:
    """Table candidates that no checked target selected (never compiled by this check)."""
    used = {r.config for r in records}
    missing = []
    for (role, kind, dim), cands in kc.ATTENTION_TABLE.items():
        dtypes = ("fp32",) if kind == "fp32" else ("bf16", "fp16")
        for cand in cands:
            tiles = cand[1]
            if not any(c.startswith(f"{dt} d{dim} {tiles}") for c in used for dt in dtypes):
                missing.append(f"{role} {kind} d{dim} {tiles}")
    return missing


def to_markdown(records: list[KernelRecord]) -> str:
    head = ("| kernel | config | target | registers | spill B | shared B | limit B | 16-B ld / st | compile s "
            "| status |")
    lines = [head, "|" + "---|" * 10]
    for r in records:
        status = "; ".join(r.problems()) or "ok"
        lines.append(f"| {r.kernel} | {r.config} | {r.target} | {r.registers} | {r.spill_bytes} | {r.shared_bytes} "
                     f"| {r.smem_limit} | {r.wide_loads} / {r.wide_stores} | {r.compile_s} | {status} |")
    return "\n".join(lines)


def to_json(records: list[KernelRecord]) -> list[dict]:
    return [dict(asdict(r), problems=r.problems()) for r in records]

"""Launch configurations of every Triton kernel in the package: ONE table, read by the launchers and
enumerated by the ahead-of-time check (:mod:`megatron_cai.core.triton_aot`, ``tools/compile_kernels.py``).

A launcher never picks a tile size, warp count or stage count of its own: it asks this module with the
device's target (compute capability and per-block opt-in shared memory; queried through
:mod:`megatron_cai.core.device` on CUDA, or set by the check with :func:`override_target`). The check
walks the same table for every target, so a configuration added here is compiled by the check too.

Attention candidates are listed largest first, each with the shared memory it may use at most (an upper
bound over every target; the check fails if a compiled kernel uses more). A launcher takes the first
candidate that fits the device.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

# Per-block opt-in shared memory (bytes), from the CUDA programming guide's compute-capability table.
SMEM_OPTIN: dict[int, int] = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                              103: 232448, 120: 101376}
# Targets the check compiles for (sm_100 only where the installed Triton knows it).
AOT_TARGETS: dict[str, int] = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100}


@dataclass(frozen=True)
class Target:
    """A CUDA compile target: compute capability (major * 10 + minor) and per-block shared memory."""

    capability: int
    smem_limit: int

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"

    @classmethod
    def for_capability(cls, capability: int) -> Target:
        if capability not in SMEM_OPTIN:
            raise ValueError(f"no shared-memory limit known for sm_{capability}; add it to kernel_configs.SMEM_OPTIN")
        return cls(capability, SMEM_OPTIN[capability])


_OVERRIDE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("kernel_target", default=None)


@contextlib.contextmanager
def override_target(target: Target):
    """Make launchers choose configurations for `target` (the ahead-of-time check uses this)."""
    token = _OVERRIDE.set(target)
    try:
        yield target
    finally:
        _OVERRIDE.reset(token)


def launch_target(device: torch.device) -> Target | None:
    """The target whose configurations a launch on `device` uses; None under the CPU interpreter."""
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced
    if device.type != "cuda":
        return None
    from megatron_cai.core import device as dev

    capability, smem = dev.kernel_limits(device)
    if not smem:  # older torch: the documented per-block opt-in limit
        smem = SMEM_OPTIN.get(capability, 101376)
    return Target(capability, smem)


# ------------------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class Tiles:
    """One attention launch configuration: query tile, key tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


ATTENTION_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
# Table roles: one row per kernel. dQ walks the forward's key-block lists, so the "fwd" and "dq" rows must
# choose the same BLOCK_M x BLOCK_N on every target (attention_tiles enforces it); their warps and stages
# are their own. The dK/dV kernel walks query blocks per key block and has free tiles.
ATTENTION_ROLES = {"fwd": "fwd", "bwd_dq": "dq", "bwd_dkdv": "dkdv"}
ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ATTENTION_HEAD_DIMS = (64, 128, 256)  # BLOCK_D buckets: head dims <= 64 use the 64 row, etc.
INTERPRETER_TILES = Tiles(16, 16, 4, 1)

# (role, "fp32" | "16bit", head-dim bucket) -> ((shared bytes it may use at most, Tiles[, lowest compute
# capability]), ...), largest first. Chosen with tools/compile_kernels.py so that nothing at head dim
# <= 128 spills on sm_80..sm_100 (ptxas -v) and every row fits the targets that select it
# (bench/results/compile_kernels.md):
# - 16-bit, d128: dK/dV at 64 x 64 with 4 warps and 3 stages used 107,520 B on sm_89 (over its 101,376 B)
#   and spilled (255 registers); 8 warps and 1 stage: 73,728 B, no spill. fwd/dQ at 64 x 64 with 4 warps
#   spilled in dQ on sm_80/sm_89; 8 warps do not.
# - fp32 (ieee dots on FMA units) needs 8 warps at 32 x 32 (4 warps spilled ~2-15 KB). d128 forward
#   spilled 768 B on sm_86/sm_89 with 2 stages; 1 stage fixes it but makes dQ spill, hence separate fwd
#   and dq rows. d128 dK/dV spills at 32 x 32 on sm_86..sm_90 (~310 B), at 16 x 32 with a window on
#   sm_86/sm_89 (32 B) and at 16 x 32 on sm_80 (64 B): sm_86+ take 16 x 16 (33,792 B, ~64 registers).
#   d64 dK/dV at 32 x 32 spilled 32 B with a window on sm_80 with 1 stage; 2 stages do not.
# - d256 may spill (not a failure) but must fit: the 64 x 32 rows need ~131 KB, so sm_86/sm_89 take 32 x 32.
# - Hopper (sm_90+, first in the 16-bit d64 / d128 rows): the generic d128 rows put 8 warps on a 64-row
#   tile (warpsPerCTA=[8,1]: both warpgroups compute the same S and dP) and dK/dV has 1 stage (no
#   cp.async). fwd / dQ take 128-row tiles on 8 warps (3 / 2 stages), dK/dV 2 stages. With triton 3.6.0
#   and 3.9.0 (bench/results/compile_kernels*.md): d128 dK/dV at 64 x 64 w8 s2 spilled 16-64 B (with
#   or without a window, depending on the version) and at 128 x 64 32-72 B with a window; 32 x 64 on
#   8 warps does not spill. d64 dQ at 128 x 64 on 4 warps spilled 56 B with a window; 8 warps do not.
_T = Tiles
ATTENTION_TABLE: dict[tuple[str, str, int], tuple[tuple, ...]] = {
    # ---- bf16 / fp16 inputs
    ("fwd", "16bit", 64): ((52_000, _T(128, 64, 8, 3), 90), (56_000, _T(64, 64, 4, 2))),
    ("dq", "16bit", 64): ((68_000, _T(128, 64, 8, 2), 90), (56_000, _T(64, 64, 4, 2))),
    ("dkdv", "16bit", 64): ((60_000, _T(64, 64, 4, 2), 90),
                            (44_000, _T(64, 32, 8, 1))),  # 40,960 B; 64x64 w8 spilled 36 B on sm_89
    ("fwd", "16bit", 128): ((100_000, _T(128, 64, 8, 3), 90), (100_000, _T(64, 64, 8, 2))),
    ("dq", "16bit", 128): ((133_000, _T(128, 64, 8, 2), 90), (100_000, _T(64, 64, 8, 2))),
    ("dkdv", "16bit", 128): ((56_000, _T(32, 64, 8, 2), 90), (80_000, _T(64, 64, 8, 1))),
    ("fwd", "16bit", 256): ((136_000, _T(64, 32, 8, 2)), (72_000, _T(32, 32, 4, 2))),
    ("dq", "16bit", 256): ((136_000, _T(64, 32, 8, 2)), (72_000, _T(32, 32, 4, 2))),
    ("dkdv", "16bit", 256): ((136_000, _T(32, 64, 8, 1)), (72_000, _T(32, 32, 4, 1))),
    # ---- fp32 (and fp64 computed in fp32)
    ("fwd", "fp32", 64): ((60_000, _T(32, 32, 4, 2)),),
    ("dq", "fp32", 64): ((60_000, _T(32, 32, 4, 2)),),
    ("dkdv", "fp32", 64): ((60_000, _T(32, 32, 8, 2)),),  # s1 spilled 32 B with a window on sm_80
    ("fwd", "fp32", 128): ((76_000, _T(32, 32, 8, 1)),),  # s2 spilled 768 B on sm_86/sm_89
    ("dq", "fp32", 128): ((76_000, _T(32, 32, 8, 2)),),  # s1 spilled
    # 16 x 16 on 8 warps spilled 28-36 B on sm_90 once the (batch, head) bases became int64; 4 warps do not
    ("dkdv", "fp32", 128): ((40_000, _T(16, 16, 4, 1), 86), (76_000, _T(32, 32, 8, 1))),
    ("fwd", "fp32", 256): ((100_000, _T(16, 32, 4, 1)),),
    ("dq", "fp32", 256): ((100_000, _T(16, 32, 4, 1)),),
    ("dkdv", "fp32", 256): ((101_376, _T(16, 32, 4, 1)),),  # 100,352 B compiled
}


# The backward's preprocess (delta = rowsum(dO * O) in fp32): query rows per program and warps (no shared
# memory, no loop); BLOCK_N is unused.
DELTA_TILES = Tiles(64, 1, 4, 1)


def delta_tiles(target: Target | None) -> Tiles:
    """The preprocess kernel's rows and warps on `target` (None: the CPU interpreter)."""
    return INTERPRETER_TILES if target is None else DELTA_TILES


def dtype_kind(dtype: torch.dtype) -> str:
    """The table's dtype column: "16bit" for bf16/fp16, "fp32" otherwise (fp64 is computed in fp32)."""
    return "16bit" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def head_dim_bucket(head_dim: int) -> int:
    """The table row of a head dim: the smallest of ATTENTION_HEAD_DIMS holding it."""
    for bucket in ATTENTION_HEAD_DIMS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"triton attention: head_dim {head_dim} > {ATTENTION_HEAD_DIMS[-1]} has no compile-checked "
                     "configuration in kernel_configs.ATTENTION_TABLE")


def attention_candidates(kernel: str, dtype: torch.dtype, head_dim: int) -> tuple[tuple[int, Tiles, int], ...]:
    """The table row of one attention kernel ("fwd", "bwd_dq" or "bwd_dkdv"): (shared bytes, tiles,
    lowest compute capability) per candidate."""
    row = ATTENTION_TABLE[(ATTENTION_ROLES[kernel], dtype_kind(dtype), head_dim_bucket(head_dim))]
    return tuple((c[0], c[1], c[2] if len(c) > 2 else 0) for c in row)


def fits(candidate: tuple[int, Tiles, int], target: Target) -> bool:
    """Whether a candidate may run on `target` (shared memory and lowest capability)."""
    need, _, min_capability = candidate
    return need <= target.smem_limit and target.capability >= min_capability


def attention_tiles(kernel: str, dtype: torch.dtype, head_dim: int, target: Target | None) -> Tiles:
    """The configuration a launch of `kernel` uses on `target` (None: the CPU interpreter's 16 x 16):
    the first candidate of its table row whose shared memory fits the target."""
    if target is None:
        return INTERPRETER_TILES
    tiles = _first_fit(kernel, dtype, head_dim, target)
    if kernel == "bwd_dq":
        fwd = _first_fit("fwd", dtype, head_dim, target)
        if (fwd.block_m, fwd.block_n) != (tiles.block_m, tiles.block_n):
            raise RuntimeError(
                f"triton attention: the dq row for {dtype}, head_dim {head_dim} on {target.name} chose "
                f"{tiles.block_m}x{tiles.block_n} but fwd chose {fwd.block_m}x{fwd.block_n}; dQ walks the forward's "
                "key-block lists, so kernel_configs.ATTENTION_TABLE's fwd and dq rows must agree on tiles")
    return tiles


def _first_fit(kernel: str, dtype: torch.dtype, head_dim: int, target: Target) -> Tiles:
    for candidate in attention_candidates(kernel, dtype, head_dim):
        if fits(candidate, target):
            return candidate[1]
    raise RuntimeError(
        f"triton attention: no {kernel} configuration for {dtype}, head_dim {head_dim} fits {target.name}'s "
        f"{target.smem_limit} B of shared memory per block (kernel_configs.ATTENTION_TABLE)")


# ------------------------------------------------------------------------------------------- squinch
@dataclass(frozen=True)
class CodecLaunch:
    """One Squinch codec launch configuration: 8-element blocks per program, warps, stages."""

    blocks: int
    num_warps: int
    num_stages: int


# Full blocks take an unmasked path (16-byte loads and residual stores, 4 elements per thread) and only a
# row's last program is masked, so each program compiles both: 128 blocks on 8 warps then spilled 16 B at
# 40 registers on sm_86/sm_89 (bf16 residual); 64 blocks on 4 warps (the same 4 elements per thread) use
# 40-56 registers and never spill. Payloads do not depend on these numbers.
SQUINCH_TABLE: dict[str, CodecLaunch] = {
    "encode": CodecLaunch(blocks=64, num_warps=4, num_stages=3),
    "decode": CodecLaunch(blocks=128, num_warps=4, num_stages=3),
}
SQUINCH_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SQUINCH_RESIDUALS = (None, torch.float32, torch.bfloat16)


def squinch_launch(kernel: str) -> CodecLaunch:
    return SQUINCH_TABLE[kernel]

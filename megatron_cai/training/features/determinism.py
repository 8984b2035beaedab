"""``--deterministic-mode``: the same losses and weights run to run, as Megatron-LM's ``megatron/training/
determinism.py`` sets it up.

On CPU every kernel here (gloo's collectives, the blocked attention, the Squinch codec) already gives the same
bits run to run. On CUDA the mode sets, before the first cuBLAS handle and NCCL communicator exist
(``initialize_distributed``), Megatron's environment: ``NCCL_ALGO=Ring`` (a fixed reduction order),
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, each only where the launcher has
not set it; a launcher value that is not deterministic is a flag problem (Megatron's accepted values). Then
``torch.use_deterministic_algorithms(True)``. Our Triton attention backward accumulates dK / dV per key block in
registers (no atomics), and the Squinch kernels' only atomics are a maximum and a counter, so no kernel here
needs a deterministic variant. Megatron-LM's flag checks come along: ``--cross-entropy-loss-fusion`` and
``--tp-comm-overlap`` are refused with it.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, MutableMapping

import torch

from ..flags.report import FlagProblems

# megatron-core 0.19.2's DETERMINISM_ENV_VAR_DEFAULTS and accepted values
ENV_DEFAULTS: dict[str, str] = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_ALGO_TOKENS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
ENV_VALUES: dict[str, frozenset[str]] = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
                                         "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"})}
# Megatron-LM's ARG_VALUES_REQUIRED_FOR_DETERMINISM: these switches must be off
_FLAGS_OFF = ("--cross-entropy-loss-fusion", "--tp-comm-overlap")


def environment_problems(env: Mapping[str, str]) -> list[str]:
    """The launcher's environment variables that would make a deterministic run non-deterministic."""
    out = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGO_TOKENS for t in tokens):
            out.append(f"--deterministic-mode with NCCL_ALGO={algo!r}: each token must be one of "
                       f"{sorted(NCCL_ALGO_TOKENS)} (unset, it is Ring)")
    for name, accepted in ENV_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            out.append(f"--deterministic-mode with {name}={value!r}: not a deterministic setting; use one of "
                       f"{sorted(accepted)} (unset, it is {ENV_DEFAULTS[name]})")
    mamba = env.get("MAMBA_DETERMINISTIC")
    if mamba and mamba[0] != "1":
        out.append(f"--deterministic-mode with MAMBA_DETERMINISTIC={mamba!r}: unset it or set it to 1")
    return out


def check_deterministic_flags(args: argparse.Namespace, problems: FlagProblems) -> None:
    """Megatron-LM's flag checks of --deterministic-mode."""
    if args.deterministic_mode:
        for flag in _FLAGS_OFF:
            if vars(args)[flag[2:].replace("-", "_")]:
                problems.conflict(f"--deterministic-mode requires {flag} off (Megatron-LM's rule)")


def check_deterministic_environment(args: argparse.Namespace, env: Mapping[str, str],
                                    problems: FlagProblems) -> None:
    """The launcher's environment under --deterministic-mode (Megatron-LM's accepted values)."""
    if args.deterministic_mode:
        for message in environment_problems(env):
            problems.conflict(message)


def apply_deterministic_mode(env: MutableMapping[str, str]) -> None:
    """Set Megatron's deterministic environment (where unset) and PyTorch's deterministic algorithms; call
    before the first cuBLAS / NCCL use."""
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)

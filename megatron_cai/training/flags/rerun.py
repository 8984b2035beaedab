"""Megatron-LM's rerun-engine flags (megatron-core's ``RerunStateMachineConfig``): ``--rerun-mode``,
``--error-injection-rate``, ``--error-injection-type`` and ``--result-rejected-tracker-filename``, with
megatron-core's defaults and its checks. The machine is ``training/rerun.py``."""

from __future__ import annotations

import argparse
from typing import Protocol

from ..features.rerun import INJECTION_TYPES, MODES, RerunConfig


class Problems(Protocol):
    """What :func:`check` records into (``report.FlagProblems``, which this module cannot import: the
    configuration it imports holds this module's config)."""

    def conflict(self, text: str) -> None: ...

    def missing(self, text: str) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rerun engine (Megatron-LM's rerun state machine; docs/rerun.md)")
    g.add_argument("--rerun-mode", choices=MODES, default="validate_results",
                   help="validate_results: a rejected result re-runs its iteration in place and stops the job with "
                        "Megatron's verdict (exit 16: resume elsewhere, 17: failed); report_stats (or "
                        "report_determinism_stats): every iteration runs twice and the differences are reported; "
                        "disabled: neither. A real non-finite loss or gradient is handled by "
                        "--check-for-nan-in-loss-and-grad in every mode")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="with validate_results, reject a validated result once every this many validation calls "
                        "(0: never)")
    g.add_argument("--error-injection-type", choices=INJECTION_TYPES, default="transient_error",
                   help="what the re-runs of an injected rejection find")
    g.add_argument("--result-rejected-tracker-filename", type=str, default=None,
                   help="append a line for every rejected result and re-run verdict (megatron-core's format)")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="validate the gradient norm: after 100 sampled norms (iterations 2 to 101), one at or above "
                        "10 x their largest is re-run and judged (not fatal: training goes on)")


def rerun_config(args: argparse.Namespace) -> RerunConfig:
    return RerunConfig(mode=args.rerun_mode, error_injection_rate=args.error_injection_rate,
                       error_injection_type=args.error_injection_type,
                       result_rejected_tracker_filename=args.result_rejected_tracker_filename,
                       check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
                       check_for_large_grads=args.check_for_large_grads)


def check(args: argparse.Namespace, problems: Problems) -> None:
    """Value rules, and the start-up line of a mode that re-runs nothing."""
    cfg = rerun_config(args)
    reruns = cfg.reports_stats or (cfg.validates and (cfg.error_injection_rate > 0 or cfg.check_for_large_grads))
    if reruns and args.num_experts:
        why = f"--rerun-mode {cfg.mode}" if cfg.reports_stats else "--error-injection-rate / --check-for-large-grads"
        problems.conflict(f"{why} with --num-experts: a re-run would count the MoE router's token loads twice "
                          f"(its counters are not restored); drop one")
    path = cfg.result_rejected_tracker_filename
    if path is not None:
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            problems.missing(f"--result-rejected-tracker-filename {path}: cannot be appended to ({e.strerror})")
    if cfg.mode == "disabled":
        args.megatron_notes.append(" > --rerun-mode disabled: no iteration is re-run; non-finite losses and "
                                   "gradients are still handled by --check-for-nan-in-loss-and-grad")

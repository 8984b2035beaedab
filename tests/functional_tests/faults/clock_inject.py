"""fault_inject.py plus a clock step (for tests/functional_tests/faults/test_clock_faults.py):

    FAULT_CLOCK_STEP_AT=K   from iteration K on, this process's time.time and time.monotonic read
                            FAULT_CLOCK_STEP_SECONDS (default 7200) ahead (FAULT_CLOCK_STEP_RANK=r: on rank r only)

    python tests/functional_tests/faults/clock_inject.py PRETRAIN_GPT_FLAGS...
"""
from __future__ import annotations

import os
import sys
import time

import fault_inject  # its directory is sys.path[0]; it puts the repository root on sys.path
import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron_cai.training import training  # noqa: E402


def _this_rank_is(var: str) -> bool:  # unset or empty: every rank
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.environ.get(var) in (None, "", str(rank))


def step_the_clock(seconds: float) -> None:
    real_time, real_monotonic = time.time, time.monotonic
    time.time = lambda: real_time() + seconds
    time.monotonic = lambda: real_monotonic() + seconds
    print(f"FAULT: clock stepped {seconds:+.0f} s", file=sys.stderr, flush=True)


def install() -> None:
    real_step, stepped = training.Trainer.train_step, {"done": False}

    def train_step(self):
        step_at = int(os.environ.get("FAULT_CLOCK_STEP_AT", "0") or 0)
        it = self.state.iteration + 1
        if step_at and it >= step_at and _this_rank_is("FAULT_CLOCK_STEP_RANK") and not stepped["done"]:
            step_the_clock(float(os.environ.get("FAULT_CLOCK_STEP_SECONDS", "7200")))
            stepped["done"] = True
        return real_step(self)

    training.Trainer.train_step = train_step


if __name__ == "__main__":
    from megatron_cai.training.errors import exit_process

    fault_inject.install()
    install()
    exit_process(lambda: pretrain_gpt.main(sys.argv[1:]))

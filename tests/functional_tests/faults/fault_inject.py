"""Run pretrain_gpt.py with a fault injected (for tests/functional_tests/faults/test_faults.py).

    FAULT_NAN_LOSS_FROM=K   the loss is NaN from iteration K on (FAULT_NAN_ONCE=1: at iteration K only;
                            FAULT_NAN_RANK=r: on global rank r only)
    FAULT_ENOSPC=SUBSTR     torch.save of a path containing SUBSTR writes 4 KiB, then fails with ENOSPC
    FAULT_HANG_SAVE=SUBSTR  torch.save of such a path writes 4 KiB, prints "FAULT: saving" and sleeps (kill -9 it);
                            so does torch.distributed.checkpoint.save into such a directory (a partial .distcp)
    FAULT_SLOW_SAVE=SUBSTR  torch.save of such a path prints "FAULT: slow saving", sleeps FAULT_SLOW_SAVE_SECONDS
                            (default 3), then saves
    FAULT_KILL_SAVE=SUBSTR  torch.save of such a path writes 4 KiB, then the process dies at once (os._exit(9))
    FAULT_KILL_DELETE=N     the process dies (os._exit(9)) at the N-th checkpoint deletion of retention, after the
                            newer checkpoint is published and before anything older is deleted
    FAULT_ITER_SLEEP=S      sleep S seconds per iteration (time for a signal to land mid-run)
    FAULT_PAUSE_AT=K        before iteration K, wait until the file FAULT_PAUSE_UNTIL exists
    FAULT_PAUSE_CHOSEN=P    once a load has chosen its checkpoint (the tracker read), create P.paused and wait
                            until P.go exists (another job may save and remove checkpoints meanwhile)
    FAULT_PAUSE_DATA=1      before building the datasets (start-up, after the checkpoint load), print
                            "FAULT: building datasets" on stderr and wait until the file FAULT_PAUSE_UNTIL exists

    python tests/functional_tests/faults/fault_inject.py PRETRAIN_GPT_FLAGS...
"""
from __future__ import annotations

import errno
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron_cai.training import training  # noqa: E402


def _partial_write_then(path, action) -> None:
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 4092)
    action()


def install() -> None:
    env = os.environ
    real_save = torch.save
    nan_state = {"on": False}

    def faulty_save(obj, f, *args, **kwargs):
        name = getattr(f, "name", None) or str(f)  # checkpoint files are written through a hashing stream
        if env.get("FAULT_ENOSPC") and env["FAULT_ENOSPC"] in name:
            def fail():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _partial_write_then(name, fail)
        if env.get("FAULT_HANG_SAVE") and env["FAULT_HANG_SAVE"] in name:
            def hang():
                print(f"FAULT: saving {name}", file=sys.stderr, flush=True)
                time.sleep(600)
            return _partial_write_then(name, hang)
        if env.get("FAULT_KILL_SAVE") and env["FAULT_KILL_SAVE"] in name:
            return _partial_write_then(name, lambda: os._exit(9))
        if env.get("FAULT_SLOW_SAVE") and env["FAULT_SLOW_SAVE"] in name:
            print(f"FAULT: slow saving {name}", file=sys.stderr, flush=True)
            time.sleep(float(env.get("FAULT_SLOW_SAVE_SECONDS", "3")))
        return real_save(obj, f, *args, **kwargs)

    torch.save = faulty_save
    import torch.distributed.checkpoint as dcp

    real_dcp_save = dcp.save

    def faulty_dcp_save(state_dict, *args, checkpoint_id=None, **kwargs):
        target = checkpoint_id or getattr(kwargs.get("storage_writer"), "path", None)
        if env.get("FAULT_HANG_SAVE") and env["FAULT_HANG_SAVE"] in str(target):
            checkpoint_id = target
            def hang():
                print(f"FAULT: saving {checkpoint_id}", file=sys.stderr, flush=True)
                time.sleep(600)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            return _partial_write_then(os.path.join(str(checkpoint_id), f"__{rank}_0.distcp"), hang)
        return real_dcp_save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs) if checkpoint_id else \
            real_dcp_save(state_dict, *args, **kwargs)

    dcp.save = faulty_dcp_save

    real_step = training.Trainer.train_step

    def train_step(self):
        it = self.state.iteration + 1
        start = int(env.get("FAULT_NAN_LOSS_FROM", "0") or 0)
        rank_ok = env.get("FAULT_NAN_RANK") in (None, "", str(torch.distributed.get_rank()
                                                             if torch.distributed.is_initialized() else 0))
        nan_state["on"] = bool(start) and rank_ok and (it == start if env.get("FAULT_NAN_ONCE") else it >= start)
        if env.get("FAULT_ITER_SLEEP"):
            time.sleep(float(env["FAULT_ITER_SLEEP"]))
        if env.get("FAULT_PAUSE_AT") and it == int(env["FAULT_PAUSE_AT"]):
            while not os.path.exists(env["FAULT_PAUSE_UNTIL"]):
                time.sleep(0.1)
        return real_step(self)

    training.Trainer.train_step = train_step
    if env.get("FAULT_KILL_DELETE"):
        from megatron_cai.training import checkpoint

        retention = checkpoint.retention  # the module whose function the checkpointer calls
        real_remove, calls = retention.remove_iteration, {"n": 0}

        def remove_iteration(root, iteration, log):
            calls["n"] += 1
            if calls["n"] == int(env["FAULT_KILL_DELETE"]):
                os._exit(9)
            return real_remove(root, iteration, log)

        retention.remove_iteration = remove_iteration
    if env.get("FAULT_PAUSE_CHOSEN"):
        from megatron_cai.training import checkpoint

        checkpointer = checkpoint.checkpointer  # the module whose name the load calls
        real_newest = checkpointer.newest_checkpoint

        def newest_checkpoint(*args, **kwargs):
            out = real_newest(*args, **kwargs)
            prefix = env["FAULT_PAUSE_CHOSEN"]
            open(prefix + ".paused", "w").close()
            while not os.path.exists(prefix + ".go"):
                time.sleep(0.1)
            return out

        checkpointer.newest_checkpoint = newest_checkpoint
    real_loss = pretrain_gpt.loss_func

    def loss_func(loss_mask, output, **kwargs):
        loss, stats = real_loss(loss_mask, output, **kwargs)
        if nan_state["on"]:
            loss = loss * float("nan")
            stats = {"lm loss": loss.detach()}
        return loss, stats

    pretrain_gpt.loss_func = loss_func
    real_provider = pretrain_gpt.train_valid_test_datasets_provider

    def datasets_provider(*args, **kwargs):
        if env.get("FAULT_PAUSE_DATA"):
            print("FAULT: building datasets", file=sys.stderr, flush=True)
            while not os.path.exists(env["FAULT_PAUSE_UNTIL"]):
                time.sleep(0.1)
        return real_provider(*args, **kwargs)

    pretrain_gpt.train_valid_test_datasets_provider = datasets_provider


if __name__ == "__main__":
    from megatron_cai.training.errors import exit_process

    install()
    exit_process(lambda: pretrain_gpt.main(sys.argv[1:]))  # as pretrain_gpt.py itself exits

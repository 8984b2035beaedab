"""``--async-save``: the training loop hands a checkpoint to a background writer and goes on training.

One save is in flight at most. :meth:`AsyncCheckpointSaver.submit` runs in the main thread, right after
the collective part of the save (:func:`.torch_format.stage_checkpoint`: the
optimizer state gathered over DP, the RNG states gathered, ``iter_XXXXXXX.tmp`` cleared): it copies
every tensor of this rank's payload into CPU staging buffers (kept and reused by the next saves, so a
save after the first is a plain copy, without new allocations) and starts a writer thread. The thread
writes this rank's files into ``iter_XXXXXXX.tmp`` with no collectives (the training process group is
never used concurrently with training), then checks each file (its zip directory, written last, is
readable and lists the pickled object): that is "finished and verified" for this rank. Before writing,
it checks that the staged parameters and optimizer state are finite (the check a synchronous save makes
on the live state, moved off the training loop); a non-finite save is dropped at finalize.

``--ckpt-format torch_dist`` (:meth:`AsyncCheckpointSaver.submit_dist`): ``run_dirs.begin_save`` and
``dist_format.build_state_dict`` run in the main thread, the DCP state dict (its ``Pieces`` too) is staged the same
way, and the thread runs ``torch.distributed.checkpoint.save`` over a gloo process group of the saver's
own, then rank 0 writes ``metadata.json``; finalizing checks DCP's ``.metadata`` before the rename.

:meth:`AsyncCheckpointSaver.maybe_finalize` (every rank, main thread) makes the checkpoint current: a
small all-reduce agrees whether every rank's write is finished and verified (Megatron-LM's
``maybe_finalize_async_save``); only then does rank 0 rename ``.tmp`` into place and move the tracker.
The training loop calls it without blocking every iteration, and blocking before the next save, at the
end of training and on exit (SIGTERM waits for the save in flight). A process killed during an async
save leaves the tracker on the previous checkpoint; the next save of that iteration clears the ``.tmp``.
A write that failed on any rank fails every rank at the next check, the failing rank with its own error
(naming the file), and the tracker stays where it was.
"""
from __future__ import annotations

import copy
import os
import shutil
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...core import device as device_mod
from ...core import parallel_state as ps
from . import dist_format as dc
from .dcp_pieces import Pieces, dcp_save
from .file_io import CheckpointError, FileHash
from .run_dirs import IterationPaths, begin_save
from .torch_format import StagedCheckpoint, finalize_staged, write_staged

__all__ = ["AsyncCheckpointSaver", "AsyncSave", "StagingCache", "dist_state_finite", "staged_state_finite",
           "verify_torch_file"]


class StagingCache:
    """CPU copies of a payload's tensors, in buffers reused from one save to the next.

    A buffer is keyed by the tensor's place in the payload (file, then key path) and reused when shape and
    dtype match; views of one storage (a tied weight saved twice) stay one copy within a save."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.pin_memory = pin_memory
        self.copied_bytes = 0

    def stage(self, obj: Any, key: str = "", owned: tuple[str, ...] = ()) -> Any:
        """A copy of ``obj``: containers rebuilt, tensors copied into the staging buffers, other leaves deep-copied.

        ``owned``: top-level keys (or key prefixes ending in ".") of a dict ``obj`` whose values are already
        private copies (the distributed optimizer's ``state_dict()``): kept as they are, not copied again."""
        seen: dict[tuple, torch.Tensor] = {}
        if owned and isinstance(obj, dict):
            out = obj.copy()
            for k, v in obj.items():
                mine = any(k == o or (o.endswith(".") and k.startswith(o)) for o in owned)
                out[k] = v if mine else self._stage(v, f"{key}/{k}", seen)
            return out
        return self._stage(obj, key, seen)

    def _stage(self, obj: Any, key: str, seen: dict) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key, seen)
        if isinstance(obj, Pieces):
            pieces = [(o, self._tensor(t, f"{key}/{i}", seen)) for i, (o, t) in enumerate(obj.pieces)]
            return type(obj)(obj.shape, pieces)
        if isinstance(obj, dict):
            out = obj.copy()  # keeps the mapping's type (OrderedDict)
            for k, v in obj.items():
                out[k] = self._stage(v, f"{key}/{k}", seen)
            return out
        if isinstance(obj, list):
            return [self._stage(v, f"{key}/{i}", seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage(v, f"{key}/{i}", seen) for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, key: str, seen: dict) -> torch.Tensor:
        t = t.detach()
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            return seen[ident]
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory and t.is_cuda)
            self.buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        self.copied_bytes += t.numel() * t.element_size()
        seen[ident] = buf
        return buf


def _floats(obj: Any):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _floats(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _floats(v)


def staged_state_finite(staged: StagedCheckpoint) -> bool:
    """Whether the parameters and the optimizer state in this rank's staged payloads are all finite.

    The check ``DivergenceMonitor.refuse_save`` makes on the live state before a synchronous save, made
    here on the staged copy in the writer thread (the training loop does not wait for it)."""
    for obj in staged.files.values():
        if not (isinstance(obj, dict) and "tp_layout" in obj):
            continue
        params = set(obj["tp_layout"])
        tensors = [t for sd in obj["model"].values() for k, t in sd.items() if k in params]
        for t in [*tensors, *_floats(obj.get("optimizer"))]:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return False
    return True


def dist_state_finite(state_dict: dict[str, Any]) -> bool:
    """torch_dist: whether every saved piece of the weights and Adam moments is finite (buffers excluded)."""
    return all(bool(torch.isfinite(t).all()) for obj in state_dict.values() if isinstance(obj, Pieces)
               for _, t in obj.pieces if t.is_floating_point())


def verify_torch_file(path: str) -> None:
    """A ``torch.save`` file whose zip directory (written last) is readable and lists the pickled object."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"asynchronous checkpoint write of {path} did not verify: {e}") from None
    if not any(n.endswith("data.pkl") for n in names):
        raise CheckpointError(f"asynchronous checkpoint write of {path} did not verify: no data.pkl record")


class _ViewsOptimizer:
    """The distributed optimizer, whose ``state_dict(names)`` returns views of its freshly gathered flat
    buffers (``copy=False``): still private to the caller, and one copy fewer in the training thread."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def state_dict(self, param_names: list[dict[int, str]]) -> dict:
        return self._optimizer.state_dict(param_names, copy=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


@dataclass
class AsyncSave(IterationPaths):
    """One save handed to the writer thread: ``check`` (is the staged state finite?), then ``write``; the
    main thread calls ``finalize`` once every rank's write has finished and verified."""

    root: str
    iteration: int
    check: Callable[[], bool]
    write: Callable[[], dict[str, FileHash]]
    finalize: Callable[[dict[str, FileHash]], str]
    records: dict[str, FileHash] = field(default_factory=dict)  # what this rank wrote, hashed as written
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    non_finite: bool = False        # this rank's staged state is not finite: nothing written
    refused: bool = False           # set at finalize: some rank's state was not finite, the save was dropped
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None


def _write_torch(staged: StagedCheckpoint) -> dict[str, FileHash]:
    records = write_staged(staged)
    for path in staged.files:
        verify_torch_file(path)
    return records


class AsyncCheckpointSaver:
    """Writes staged checkpoints in a background thread; one in flight at most (see the module docstring).

    ``ckpt_format`` torch_dist: the writer thread runs ``torch.distributed.checkpoint.save`` over a gloo
    process group of its own (made here, collectively), never over the training group."""

    def __init__(self, device: torch.device, ckpt_format: str = "torch") -> None:
        self.device = device
        self.cache = StagingCache(pin_memory=device.type == "cuda")
        self.in_flight: AsyncSave | None = None
        self.group = None
        if ckpt_format == "torch_dist" and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = ps.new_group(backend="gloo")  # collective: every rank builds the saver

    def submit(self, staged: StagedCheckpoint, owned: tuple[str, ...] = ()) -> None:
        """torch format: copy this rank's payloads into the staging buffers and start writing them.

        ``owned``: payload keys whose tensors are private copies already (see :meth:`StagingCache.stage`)."""
        staged.files = {path: self.cache.stage(obj, os.path.basename(path), owned)
                        for path, obj in staged.files.items()}
        self._start(AsyncSave(staged.root, staged.iteration, check=lambda: staged_state_finite(staged),
                              write=lambda: _write_torch(staged),
                              finalize=lambda records: finalize_staged(staged, records)))

    def submit_dist(self, root: str, iteration: int, model_chunks, optimizer, scheduler, train_config, state: dict,
                    param_layout: dict, *, reducer_states: list[dict] | None = None, save_optim: bool = True,
                    tokenizer_files: list[str] | None = None, overwrite: bool = False) -> None:
        """torch_dist format (collective): ``run_dirs.begin_save`` and ``build_state_dict`` as a
        synchronous save; the state dict is staged and ``dcp.save`` of it runs in the writer thread, over
        this saver's own gloo group; rank 0 then writes ``metadata.json``."""
        tmp = begin_save(root, iteration)
        private = optimizer.state_dict_copies and not dc.is_fsdp(model_chunks)
        sd = dc.build_state_dict(model_chunks, _ViewsOptimizer(optimizer) if private else optimizer, scheduler,
                                 train_config.model, state, param_layout, reducer_states=reducer_states,
                                 save_optim=save_optim)
        staged = self.cache.stage(sd, "dcp", owned=(dc.EXP_AVG, dc.EXP_AVG_SQ) if private else ())
        dp_kind = "fsdp2" if dc.is_fsdp(model_chunks) else "ddp"

        def write() -> dict[str, FileHash]:
            records = dcp_save(staged, tmp, process_group=self.group)  # over this saver's own process group
            if ps.get_rank() == 0:
                records.update(dc.write_metadata(tmp, iteration, train_config, param_layout, dp_kind,
                                                 tokenizer_files))
            return records

        self._start(AsyncSave(root, iteration, check=lambda: dist_state_finite(staged), write=write,
                              finalize=lambda records: dc.finish_save(root, iteration, tmp, records, overwrite)))

    def _start(self, job: AsyncSave) -> None:
        if self.in_flight is not None:
            raise RuntimeError("an asynchronous save is still in flight: finalize it first (blocking)")
        device_mod.synchronize(self.device)  # the non-blocking copies to the staging buffers have landed
        job.thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                      name=f"async-save-iter{job.iteration}")
        self.in_flight = job
        job.thread.start()

    @staticmethod
    def _run(job: AsyncSave) -> None:
        try:
            if not job.check():
                job.non_finite = True
                return
            job.records = job.write()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread at the next finalize
            job.error = e
        finally:
            job.finished = time.perf_counter()
            job.done.set()

    def maybe_finalize(self, blocking: bool) -> AsyncSave | None:
        """Collective (every rank): make the save in flight current if every rank's write has finished.

        Returns the finished save (``refused`` when some rank's staged state was not finite: its ``.tmp``
        is removed and the tracker stays put), or None (nothing in flight, or not finished on some rank
        and ``blocking`` is false). Raises if the write failed on any rank; the tracker then stays put."""
        job = self.in_flight
        if job is None:
            return None
        if blocking:
            job.done.wait()
        done = job.done.is_set()
        failed = done and job.error is not None
        flags = torch.tensor([0.0 if done else 1.0, 1.0 if failed else 0.0, 1.0 if job.non_finite else 0.0],
                             device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [any rank still writing, any failed, any non-finite]
        pending, any_failed, job.refused = (bool(v) for v in flags.tolist())
        if any_failed:
            self.in_flight = None
            if failed:
                raise job.error
            raise CheckpointError(f"the asynchronous save of iteration {job.iteration} failed on another "
                                  f"rank; the previous checkpoint stays current")
        if pending:
            return None
        self.in_flight = None
        if job.refused:
            if ps.get_rank() == 0:
                shutil.rmtree(job.tmp, ignore_errors=True)
        else:
            job.finalize(job.records)  # collective: the hashes go to rank 0, which publishes
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return job

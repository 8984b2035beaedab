"""The one save/load entry of a training run: :class:`Checkpointer` (``save``, ``load``, ``finalize_async``).

It dispatches on the run's :class:`~megatron_cai.training.config.CheckpointConfig`:

- ``torch``, synchronous: :func:`.torch_format.save_torch_checkpoint`;
- ``torch``, ``--async-save``: :func:`.torch_format.stage_checkpoint`, then
  :meth:`.async_save.AsyncCheckpointSaver.submit` (the write runs in a background thread);
- ``torch_dist``, synchronous: :func:`.dist_format.save_dist_checkpoint`;
- ``torch_dist``, ``--async-save``: :meth:`.async_save.AsyncCheckpointSaver.submit_dist`;

and, on load, on what the ``--load`` directory holds (``--ckpt-format``, ``--auto-detect-ckpt-format``).
Before anything is read, every file of the iteration is checked against its content hash (the files
split over the ranks, :mod:`.integrity`), and the tokenizer's content hash against this run's.
A save never replaces a published iteration unless ``--overwrite-checkpoints`` (then it is moved aside).
``save(..., non_persistent=True)`` writes into the non-persistent directory instead; once a save is published,
rank 0 deletes what it supersedes (``--save-retain-interval``, older non-persistent saves: :mod:`.retention`),
and a load without ``--ckpt-step`` reads the newest of the persistent and non-persistent checkpoints.
The Trainer keeps the policy: when to save, and refusing to save non-finite state.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ...core import parallel_state as ps
from ..config import CheckpointConfig, TrainConfig
from ..errors import safe_print
from . import data_record, dist_format, torch_format
from .async_save import AsyncCheckpointSaver, AsyncSave
from .dcp_pieces import DCP_METADATA, dcp_load, read_dcp_metadata
from .file_io import CheckpointError
from .integrity import MANIFEST, Mismatch, UnverifiableError, check_listing, read_manifest, verify_share
from .metadata import TORCH_DIST, check_tokenizer, detect_format, read_metadata, refuse_megatron_lm_checkpoint
from .retention import RetentionPolicy, check_non_persistent_dir, newest_checkpoint, non_persistent_root
from .run_dirs import (
    TRACKER,
    IterationPin,
    barrier,
    check_paths,
    check_run_dirs,
    directory_bytes,
    free_space_warning,
    iteration_dir,
    last_verifying_iteration,
    read_tracker,
    same_path,
)
from .run_lock import RunLock, lock_holder
from .safe_load import CheckpointTrust, current_trust, load_torch, read_signing_key, set_trust


class Checkpointer:
    """Saves and loads one run's model chunks, optimizer and LR scheduler, in the run's format.

    Constructing it is collective when ``--async-save`` is on with ``torch_dist`` (the writer's own gloo
    group). ``param_layout`` is each parameter's TP split (:func:`.metadata.tp_layout`), read before FSDP2
    replaced the parameters."""

    def __init__(self, config: TrainConfig, model_chunks, optimizer, scheduler, param_layout: dict,
                 device: torch.device) -> None:
        self.config = config
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.param_layout = param_layout
        ckpt = config.checkpoint
        self.async_saver = (AsyncCheckpointSaver(device, ckpt.ckpt_format)  # collective (torch_dist)
                            if ckpt.async_save and ckpt.save else None)
        self.retention = RetentionPolicy(ckpt, log=safe_print)
        self.loaded_root: str | None = None  # the directory load() read (--load or its non-persistent one)
        set_trust(CheckpointTrust(trust_code=ckpt.trust_checkpoint_code,  # what this process's loads accept
                                  allow_unverified=ckpt.allow_unverified_checkpoint,
                                  signing_key=read_signing_key(ckpt.checkpoint_signing_key)), log=self._rank0_log)

    @staticmethod
    def _rank0_log(line: str) -> None:
        if ps.get_rank() == 0:
            safe_print(line)

    @property
    def asynchronous(self) -> bool:
        """Whether :meth:`save` only starts a background write (``--async-save``)."""
        return self.async_saver is not None

    # ------------------------------------------------------------------------------------------ save
    def save(self, state: dict, reducer_states: list[dict] | None = None, non_persistent: bool = False) -> str | None:
        """Save at ``--save``, or its non-persistent directory (collective). ``state``: the counters to restore
        (``iteration`` included).

        Synchronous: returns the published ``iter_XXXXXXX`` directory. ``--async-save``: stages the state
        (the collective part, then a copy), starts the background write and returns None; a later
        :meth:`finalize_async` publishes it."""
        path = self._save(state, reducer_states, non_persistent)
        if path is not None:
            self._published(path, state["iteration"])
        return path

    def _published(self, path: str, iteration: int) -> None:
        if ps.get_rank() == 0:
            self.retention.after_publish(os.path.dirname(path), iteration)

    def _save(self, state: dict, reducer_states: list[dict] | None, non_persistent: bool) -> str | None:
        ckpt, cfg = self.config.checkpoint, self.config
        it = state["iteration"]
        root = self.retention.np_root if non_persistent else ckpt.save
        if root is None:
            raise CheckpointError("a non-persistent save needs --non-persistent-ckpt-type global and --save")
        self._refuse_existing(root, it, ckpt.overwrite_checkpoints)
        tok = cfg.tokenizer.tokenizer_model
        tok_files = [tok] if tok else []
        sharded = ckpt.ckpt_format == TORCH_DIST
        if self.async_saver is not None:
            if sharded:
                self.async_saver.submit_dist(root, it, self.model_chunks, self.optimizer, self.scheduler, cfg,
                                             state, self.param_layout, reducer_states=reducer_states,
                                             save_optim=ckpt.save_optim, tokenizer_files=tok_files,
                                             overwrite=ckpt.overwrite_checkpoints)
            else:
                private = self.optimizer.state_dict_copies  # its state needs no staging copy
                staged = torch_format.stage_checkpoint(
                    root, it, self.model_chunks, self.optimizer, self.scheduler, cfg, state,
                    reducer_states=reducer_states, save_optim=ckpt.save_optim, tokenizer_files=tok_files,
                    optimizer_views=private)
                staged.overwrite = ckpt.overwrite_checkpoints
                self.async_saver.submit(staged, owned=("optimizer",) if private else ())
            return None
        if sharded:
            return dist_format.save_dist_checkpoint(
                root, it, self.model_chunks, self.optimizer, self.scheduler, cfg, state, self.param_layout,
                reducer_states=reducer_states, save_optim=ckpt.save_optim, tokenizer_files=tok_files,
                overwrite=ckpt.overwrite_checkpoints)
        return torch_format.save_torch_checkpoint(root, it, self.model_chunks, self.optimizer, self.scheduler, cfg,
                                                  state, reducer_states=reducer_states, save_optim=ckpt.save_optim,
                                                  tokenizer_files=tok_files, overwrite=ckpt.overwrite_checkpoints)

    @staticmethod
    def _refuse_existing(root: str, iteration: int, overwrite: bool) -> None:
        """Collective: a published ``iter_XXXXXXX`` in ``--save`` is never replaced without
        ``--overwrite-checkpoints`` (rank 0 looks; every rank raises alike)."""
        exists = [os.path.isdir(iteration_dir(root, iteration)) if ps.get_rank() == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(exists, src=0)
        if exists[0] and not overwrite:
            raise CheckpointError(f"--save {root} already holds {os.path.basename(iteration_dir(root, iteration))}, "
                                  f"which this run did not write: not replacing it (pass --overwrite-checkpoints to "
                                  f"move it aside, or choose another --save directory)")

    def finalize_async(self, blocking: bool = False) -> AsyncSave | None:
        """Collective: publish the ``--async-save`` in flight once every rank has written it (see
        :meth:`.async_save.AsyncCheckpointSaver.maybe_finalize`); None when nothing finished."""
        done = self.async_saver.maybe_finalize(blocking) if self.async_saver is not None else None
        if done is not None and not done.refused:
            self._published(done.final, done.iteration)
        return done

    # ------------------------------------------------------------------------------------------ load
    def load(self, reducers=None, *, root: str | None = None, step: int | None = None) -> dict:
        """Restore ``--load`` (or ``root``) at ``--ckpt-step`` (or ``step``, else the tracker's iteration) into
        this run's layout, either format (collective); returns the saved counters, {} when nothing loaded."""
        ckpt = self.config.checkpoint
        step = step if step is not None else ckpt.ckpt_step
        root, iteration, pin = choose_iteration(ckpt, root, step)  # collective; rank 0 pins it
        if iteration is None:
            if ckpt.exit_on_missing_checkpoint:
                raise CheckpointError(f"no checkpoint in {root} ({TRACKER} is missing)")
            return {}
        try:
            counters = self._load(root, iteration, reducers)
            barrier()  # every rank has read its files: the pin may go
        finally:
            if pin is not None:
                pin.release()
        return counters

    def _load(self, root: str, iteration: int, reducers) -> dict:
        ckpt = self.config.checkpoint
        refuse_megatron_lm_checkpoint(root, iteration)
        fmt = resolve_load_format(root, iteration, ckpt.ckpt_format, ckpt.auto_detect_ckpt_format)
        verify_checkpoint(root, iteration)  # collective: every file against its content hash
        check_tokenizer(read_metadata(root, iteration), self.config.tokenizer, iteration_dir(root, iteration),
                        allowed=ckpt.finetune or ckpt.allow_tokenizer_change)
        if not ckpt.finetune:  # the data's fingerprints against the checkpoint's record (fine-tuning: other data)
            data_record.check_data(read_metadata(root, iteration), self.config.data, iteration_dir(root, iteration),
                                   allowed=self.config.data.allow_data_change)
        self.loaded_root = root
        if not ckpt.finetune and (same_path(root, ckpt.save) or same_path(root, self.retention.np_root)):
            self.retention.resumed_in_place()
        if fmt == TORCH_DIST:
            return dist_format.load_dist_checkpoint(
                root, iteration, self.model_chunks, self.optimizer, self.scheduler, self.config.model,
                self.param_layout, load_optim=ckpt.load_optim, load_rng=ckpt.load_rng, finetune=ckpt.finetune,
                reducers=reducers, train_config=self.config)
        if experts_split(self.config):
            raise CheckpointError(f"{iteration_dir(root, iteration)} is a torch-format checkpoint, which a run with "
                                  f"experts split over ranks (expert model / tensor parallel size > 1) cannot load; "
                                  f"convert it: python tools/convert_checkpoint.py --load {root} --save NEW_DIR "
                                  f"--target-ckpt-format torch_dist")
        if dist_format.is_fsdp(self.model_chunks):
            raise CheckpointError(f"{iteration_dir(root, iteration)} is a torch-format checkpoint, which "
                                  f"--use-torch-fsdp2 cannot load (FSDP2 parameters are DTensor shards); convert "
                                  f"it: python tools/convert_checkpoint.py --load {root} --save NEW_DIR "
                                  f"--target-ckpt-format torch_dist")
        return torch_format.load_torch_checkpoint(
            root, self.model_chunks, self.optimizer, self.scheduler, self.config.model, load_optim=ckpt.load_optim,
            load_rng=ckpt.load_rng, finetune=ckpt.finetune, step=iteration,
            exit_on_missing=ckpt.exit_on_missing_checkpoint, reducers=reducers, train_config=self.config)


def experts_split(config: TrainConfig) -> bool:
    """Whether this run's MoE experts are split over ranks (EP or expert TP > 1): only torch_dist holds them."""
    return config.model.moe is not None and (ps.get_expert_model_parallel_world_size() > 1
                                             or ps.get_expert_tensor_parallel_world_size() > 1)


def choose_iteration(ckpt: CheckpointConfig, root: str | None, step: int | None,
                     attempts: int = 5) -> tuple[str | None, int | None, IterationPin | None]:
    """Collective: (directory, iteration, rank 0's pin) that a load reads, decided by rank 0 for every rank.

    Without a step: the newest published iteration of ``--load`` (or its non-persistent directory), pinned so
    that another job saving into the directory cannot remove it while this job reads it; when it went away
    before the pin held (that job published a newer one and removed it), the newest one is chosen again. A
    directory another job is saving into gets one line saying which iteration is loaded."""
    choice: list = [None, None, None]  # directory, iteration, rank 0's error
    pin = None
    if ps.get_rank() == 0:
        try:
            choice[:2], pin = _choose_and_pin(ckpt, root, step, attempts)
        except CheckpointError as e:
            choice[2] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[2] is not None:
        raise CheckpointError(choice[2])
    return choice[0], choice[1], pin


def _choose_and_pin(ckpt: CheckpointConfig, root: str | None, step: int | None,
                    attempts: int) -> tuple[list, IterationPin | None]:
    """Rank 0's part of :func:`choose_iteration`: ``[directory, iteration]`` and the pin."""
    choice: list = [None, None]
    pin = None
    for _ in range(attempts):
        if root is None and step is None:
            where, it = newest_checkpoint(ckpt.load, non_persistent_root(ckpt, ckpt.load))
        else:
            where = root if root is not None else ckpt.load
            it = step if step is not None else read_tracker(where)
        choice = [where, it]
        if it is None:
            break
        pin = IterationPin.take(where, it)
        if pin is not None or step is not None:
            break
        safe_print(f" {iteration_dir(where, it)} went away while this job chose it (another job saving into "
                   f"{where} removed it): choosing the newest published iteration again")
    if choice[1] is not None and not same_path(choice[0], ckpt.save):
        writer = lock_holder(choice[0])
        if writer is not None:
            safe_print(f" --load {choice[0]} is being saved into by another job ({writer}): loading "
                       f"iter_{choice[1]:07d}, the newest published iteration (never one being written)")
    return choice, pin


def resolve_load_format(root: str, iteration: int, ckpt_format: str, auto_detect: bool) -> str:
    """The reader for ``iter_XXXXXXX`` in ``root``: ``ckpt_format``, or what the files say with
    ``--auto-detect-ckpt-format``; a mismatch without the flag is an error naming the directory and the flag."""
    d = iteration_dir(root, iteration)
    found = detect_format(root, iteration)
    if found is None:
        if auto_detect and os.path.isdir(d):
            raise CheckpointError(f"{d} holds neither a torch_dist checkpoint ({DCP_METADATA}) nor torch-format "
                                  f"mp_rank_* directories: --auto-detect-ckpt-format cannot tell its format (an "
                                  f"interrupted save, or a damaged checkpoint)")
        return ckpt_format  # that format's reader names what is missing
    if found != ckpt_format:
        if not auto_detect:
            raise CheckpointError(f"{d} is a {found} checkpoint but this run reads --ckpt-format {ckpt_format}: pass "
                                  f"--ckpt-format {found}, or --auto-detect-ckpt-format to read whichever format the "
                                  f"directory holds")
        if ps.get_rank() == 0:
            safe_print(f" --auto-detect-ckpt-format: {d} is a {found} checkpoint; reading it as such")
    return found


def verify_checkpoint(root: str, iteration: int, *, collective: bool = True) -> None:
    """Collective: check every file of ``iter_XXXXXXX`` against its recorded content hash, the files split
    over the ranks (``collective=False``: this process checks them all, as the offline readers and a teacher
    loaded by some ranks only do). A file that does not verify is one error (every rank raises it, rank 0 prints it)
    naming the file, the rank that checked it, the expected and found hashes, and the last iteration that
    verifies. A manifest that is missing or uses an algorithm this installation lacks is an error, or one
    warning under ``--allow-unverified-checkpoint``; a damaged, unsigned (with ``--checkpoint-signing-key``) or
    incomplete manifest (files on disk it does not list, names outside the directory) is always an error."""
    d = iteration_dir(root, iteration)
    rank, world = (ps.get_rank(), ps.get_world_size()) if collective else (0, 1)
    try:  # every rank reads the manifest: a bad one is an error on every rank alike
        manifest = read_manifest(d)
        if manifest is None:
            raise UnverifiableError(f"checkpoint {d} has no content hashes ({MANIFEST}): its files cannot be "
                                    f"verified (the manifest was removed, or the checkpoint predates them); pass "
                                    f"--allow-unverified-checkpoint to load it anyway")
    except UnverifiableError as e:
        if not current_trust().allow_unverified:
            raise
        if rank == 0 and ps.get_rank() == 0:
            why = str(e).split("; pass --allow-unverified-checkpoint")[0]
            safe_print(f" WARNING: {why}: loading it unverified (--allow-unverified-checkpoint)")
        return
    check_listing(d, manifest)
    bad: list[Mismatch] = verify_share(d, manifest, rank, world)
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = [m for part in everyone for m in part]
    if not bad:
        return
    good = last_verifying_iteration(root, iteration) if rank == 0 else None
    more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
    last = (f"the last iteration that verifies is iter_{good:07d}: resume it with --load {root} --ckpt-step {good}"
            if good is not None else "no earlier iteration in this directory verifies")
    raise CheckpointError(f"{bad[0].describe()}{more}; {last}")


def check_plain_data(iteration_dir_path: str) -> int:
    """Read every pickle of one iteration directory as a load would (no collectives): torch files as weights
    only, DCP's ``.metadata`` through the restricted unpickler and its byte objects as weights only. Raises
    :class:`.safe_load.UnsafeCheckpointError` for the first one that is not plain data; returns how many were read
    (``tools/verify_checkpoint.py``)."""
    n = 0
    for d, _, names in os.walk(iteration_dir_path):
        for name in sorted(names):
            if name.endswith(".pt") and not os.path.islink(os.path.join(d, name)):
                load_torch(os.path.join(d, name))
                n += 1
    if os.path.isfile(os.path.join(iteration_dir_path, DCP_METADATA)):
        saved = read_dcp_metadata(iteration_dir_path).state_dict_metadata
        objects = {k: None for k, v in saved.items() if isinstance(v, BytesStorageMetadata)}
        if objects:
            dcp_load(objects, iteration_dir_path, no_dist=True)
        n += 1 + len(objects)
    return n


def open_run_dirs(ckpt: CheckpointConfig) -> RunLock | None:
    """Collective start-up checks of ``--save`` and ``--load``: rank 0 checks the paths (``--save``
    writable or creatable, ``--load`` readable) and takes the run lock on ``--save`` (held until the job
    ends); then every rank checks that nothing would start fresh or overwrite a run
    (:func:`.run_dirs.check_run_dirs`). Every rank raises the same error."""
    lock, error = None, [None]
    if ps.get_rank() == 0:
        try:
            check_paths(ckpt.load, ckpt.save)
            if ckpt.save:
                lock = RunLock.acquire(ckpt.save, log=safe_print)
        except CheckpointError as e:
            error = [str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(error[0])
    check_run_dirs(ckpt.load, ckpt.save, ckpt.ckpt_step, finetune=ckpt.finetune, overwrite=ckpt.overwrite_checkpoints)
    check_non_persistent_dir(ckpt)
    return lock


def warn_if_short_of_space(ckpt: CheckpointConfig, estimated_bytes: int) -> None:
    """Rank 0: one warning when ``--save`` has less free space than a checkpoint needs (the size of the
    checkpoint being resumed when there is one, else ``estimated_bytes``)."""
    if not ckpt.save or ps.get_rank() != 0:
        return
    expected = estimated_bytes
    resumed = ckpt.ckpt_step if ckpt.ckpt_step is not None else (read_tracker(ckpt.load) if ckpt.load and
                                                                   os.path.isdir(ckpt.load) else None)
    if resumed is not None and os.path.isdir(iteration_dir(ckpt.load, resumed)):
        expected = directory_bytes(iteration_dir(ckpt.load, resumed))
    line = free_space_warning(ckpt.save, expected)
    if line:
        safe_print(f" {line}")

"""The one save/load entry of a training run: :class:`Checkpointer` (``save``, ``load``, ``finalize_async``).

It dispatches on the run's :class:`~megatron_cai.training.config.CheckpointConfig`:

- ``torch``, synchronous: :func:`.torch_format.save_torch_checkpoint`;
- ``torch``, ``--async-save``: :func:`.torch_format.stage_checkpoint`, then
  :meth:`.async_save.AsyncCheckpointSaver.submit` (the write runs in a background thread);
- ``torch_dist``, synchronous: :func:`.dist_format.save_dist_checkpoint`;
- ``torch_dist``, ``--async-save``: :meth:`.async_save.AsyncCheckpointSaver.submit_dist`;

and, on load, on what the ``--load`` directory holds (``--ckpt-format``, ``--auto-detect-ckpt-format``).
The Trainer keeps the policy: when to save, and refusing to save non-finite state.
"""
from __future__ import annotations

import os

import torch

from ...core import parallel_state as ps
from ..config import TrainConfig
from ..errors import safe_print
from . import dist_format, torch_format
from .async_save import AsyncCheckpointSaver, AsyncSave
from .dcp_pieces import DCP_METADATA
from .file_io import CheckpointError
from .metadata import TORCH_DIST, detect_format, refuse_megatron_lm_checkpoint
from .run_dirs import TRACKER, iteration_dir, read_tracker


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

    @property
    def asynchronous(self) -> bool:
        """Whether :meth:`save` only starts a background write (``--async-save``)."""
        return self.async_saver is not None

    # ------------------------------------------------------------------------------------------ save
    def save(self, state: dict, reducer_states: list[dict] | None = None) -> str | None:
        """Save at ``--save`` (collective). ``state``: the counters to restore (``iteration`` included).

        Synchronous: returns the published ``iter_XXXXXXX`` directory. ``--async-save``: stages the state
        (the collective part, then a copy), starts the background write and returns None; a later
        :meth:`finalize_async` publishes it."""
        ckpt, cfg = self.config.checkpoint, self.config
        it = state["iteration"]
        tok = cfg.tokenizer.tokenizer_model
        tok_files = [tok] if tok else []
        sharded = ckpt.ckpt_format == TORCH_DIST
        if self.async_saver is not None:
            if sharded:
                self.async_saver.submit_dist(ckpt.save, it, self.model_chunks, self.optimizer, self.scheduler, cfg,
                                             state, self.param_layout, reducer_states=reducer_states,
                                             save_optim=ckpt.save_optim, tokenizer_files=tok_files)
            else:
                private = getattr(self.optimizer, "state_dict_copies", False)  # its state needs no staging copy
                staged = torch_format.stage_checkpoint(
                    ckpt.save, it, self.model_chunks, self.optimizer, self.scheduler, cfg, state,
                    reducer_states=reducer_states, save_optim=ckpt.save_optim, tokenizer_files=tok_files,
                    optimizer_views=private)
                self.async_saver.submit(staged, owned=("optimizer",) if private else ())
            return None
        if sharded:
            return dist_format.save_dist_checkpoint(
                ckpt.save, it, self.model_chunks, self.optimizer, self.scheduler, cfg, state, self.param_layout,
                reducer_states=reducer_states, save_optim=ckpt.save_optim, tokenizer_files=tok_files)
        return torch_format.save_torch_checkpoint(ckpt.save, it, self.model_chunks, self.optimizer, self.scheduler, cfg,
                                            state, reducer_states=reducer_states, save_optim=ckpt.save_optim,
                                            tokenizer_files=tok_files)

    def finalize_async(self, blocking: bool = False) -> AsyncSave | None:
        """Collective: publish the ``--async-save`` in flight once every rank has written it (see
        :meth:`.async_save.AsyncCheckpointSaver.maybe_finalize`); None when nothing finished."""
        return self.async_saver.maybe_finalize(blocking) if self.async_saver is not None else None

    # ------------------------------------------------------------------------------------------ load
    def load(self, reducers=None, *, root: str | None = None, step: int | None = None) -> dict:
        """Restore ``--load`` (or ``root``) at ``--ckpt-step`` (or ``step``, else the tracker's iteration) into
        this run's layout, either format (collective); returns the saved counters, {} when nothing loaded."""
        ckpt = self.config.checkpoint
        root = root if root is not None else ckpt.load
        step = step if step is not None else ckpt.ckpt_step
        iteration = step if step is not None else read_tracker(root)
        if iteration is None:
            if ckpt.exit_on_missing_checkpoint:
                raise CheckpointError(f"no checkpoint in {root} ({TRACKER} is missing)")
            return {}
        refuse_megatron_lm_checkpoint(root, iteration)
        fmt = resolve_load_format(root, iteration, ckpt.ckpt_format, ckpt.auto_detect_ckpt_format)
        if fmt == TORCH_DIST:
            return dist_format.load_dist_checkpoint(
                root, iteration, self.model_chunks, self.optimizer, self.scheduler, self.config.model,
                self.param_layout, load_optim=ckpt.load_optim, load_rng=ckpt.load_rng, finetune=ckpt.finetune,
                reducers=reducers, train_config=self.config)
        if dist_format.is_fsdp(self.model_chunks):
            raise CheckpointError(f"{iteration_dir(root, iteration)} is a torch-format checkpoint, which "
                                  f"--use-torch-fsdp2 cannot load (FSDP2 parameters are DTensor shards); convert "
                                  f"it: python tools/convert_checkpoint.py --load {root} --save NEW_DIR "
                                  f"--target-ckpt-format torch_dist")
        return torch_format.load_torch_checkpoint(
            root, self.model_chunks, self.optimizer, self.scheduler, self.config.model, load_optim=ckpt.load_optim,
            load_rng=ckpt.load_rng, finetune=ckpt.finetune, step=iteration,
            exit_on_missing=ckpt.exit_on_missing_checkpoint, reducers=reducers, train_config=self.config)


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

"""``--ckpt-format torch``: per-rank files in Megatron's layout, written atomically, resumed bit-exactly.

::

    <save>/latest_checkpointed_iteration.txt       written last (atomic replace)
    <save>/iter_0000010/metadata.json              layout, model config, train config, flags
    <save>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/iter_0000010/mp_rank_TT[_PPP]/reducer_dp_DDD.pt   per-DP-rank reducer state (Squinch residuals)

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed when every rank has finished, so a process
killed during a save leaves the previous checkpoint current. Each ``model_optim_rng.pt`` (written by DP
rank 0 of its TP/PP rank) holds the model chunks (parameter names use global layer numbers), the Adam
state per parameter (gathered over DP when the optimizer is sharded), the LR scheduler, the RNG states
of every DP rank, the iteration and consumed samples, and each parameter's TP layout so that
``tools/convert_checkpoint.py`` can reshard it. ``tokenizer/`` holds a copy of the tokenizer files;
``metadata.json`` is described in :mod:`.metadata`. Loading needs the saved TP/PP/VPP layout (the
``torch_dist`` format loads into any).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ...core import device as device_mod
from ...core import parallel_state as ps
from ...core.distributed.contracts import ModelChunk
from ...core.models.gpt.config import GPTConfig
from ...core.pipeline_parallel.layer_split import PipelineSplit, stage_layer_numbers
from ...core.tensor_parallel.random import get_rng_tracker
from ..config import TrainConfig
from ..errors import safe_print
from .file_io import CheckpointError, FileHash, save_torch, write_json
from .integrity import gather_records
from .metadata import (
    FORMAT_VERSION,
    check_architecture,
    check_version,
    copy_tokenizer_files,
    read_metadata,
    report_config_changes,
    run_metadata,
    tp_layout,
)
from .run_dirs import TRACKER, IterationPaths, barrier, begin_save, iteration_dir, publish, read_tracker
from .safe_load import load_torch
from .shape_check import check_shapes, likely_flag, saved_config


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def param_names(model_chunks: list[ModelChunk]) -> list[dict[int, str]]:
    """Per chunk, parameter id -> name in the (unwrapped) model's state dict."""
    return [{id(p): n for n, p in m.module.named_parameters()} for m in model_chunks]


def _gather_over_dp(obj: Any) -> list[Any]:
    """``obj`` of every rank of this rank's DP x CP group (the ranks holding the same weights), in order."""
    if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return [obj]
    out: list[Any] = [None] * ps.get_data_parallel_world_size(with_context_parallel=True)
    dist.all_gather_object(out, obj, group=ps.get_data_parallel_group(with_context_parallel=True))
    return out


@dataclass
class StagedCheckpoint(IterationPaths):
    """What one rank writes for one save: files to ``torch.save``, plus (rank 0) metadata and tokenizer files.

    Built by :func:`stage_checkpoint` (collective); written by :func:`write_staged` (no collectives: it may
    run in a background thread); made current by :func:`finalize_staged` (rank 0) once every rank wrote."""

    root: str
    iteration: int
    files: dict[str, Any]                       # path -> object for torch.save
    meta: dict | None = None                    # metadata.json (rank 0)
    tokenizer_files: list[str] = field(default_factory=list)
    overwrite: bool = False                     # --overwrite-checkpoints: an existing iteration is moved aside


def stage_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, train_config: TrainConfig,
                     state: dict, reducer_states: list[dict] | None = None,
                     save_optim: bool = True, tokenizer_files: list[str] | None = None,
                     optimizer_views: bool = False) -> StagedCheckpoint:
    """Collective: every rank must call it. Clears ``iter_XXXXXXX.tmp`` and gathers what each rank writes.

    The returned payloads may reference live tensors (model parameters, optimizer state): copy them
    (:mod:`.async_save`) before training mutates them, or write them at once (:func:`save_torch_checkpoint`).
    ``optimizer_views``: the optimizer state as views of its gathered flat buffers (``state_dict(copy=False)``)."""
    config = train_config.model
    tmp = begin_save(root, iteration)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)  # files per DP x CP rank
    rdir = os.path.join(tmp, rank_dir_name(tp_rank, pp_rank, ps.get_pipeline_model_parallel_world_size()))
    names = param_names(model_chunks)
    optim_state = None
    if save_optim:  # collective over DP
        optim_state = optimizer.state_dict(names, copy=False) if optimizer_views else optimizer.state_dict(names)
    rng = {**device_mod.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    all_rng = _gather_over_dp(rng)
    staged = StagedCheckpoint(root, iteration, {})
    if dp_rank == 0 and ps.get_island_rank() == 0:  # DiLoCo: island 0's; the others' in their rank state
        payload = {
            "checkpoint_version": FORMAT_VERSION,
            "iteration": iteration,
            "model": {f"model{i}": m.module.state_dict() for i, m in enumerate(model_chunks)},
            "optimizer": optim_state,
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": all_rng,
            "tp_layout": tp_layout([m.module for m in model_chunks]),
            "model_config": config.to_dict(),
            **state,
        }
        staged.files[os.path.join(rdir, "model_optim_rng.pt")] = payload
    if reducer_states and any(reducer_states):
        staged.files[os.path.join(rdir, reducer_file_name(dp_rank))] = reducer_states
    if ps.get_rank() == 0:
        staged.meta = run_metadata(iteration, train_config)
        staged.tokenizer_files = list(tokenizer_files or [])
    return staged


def write_staged(staged: StagedCheckpoint) -> dict[str, FileHash]:
    """Write this rank's files into ``iter_XXXXXXX.tmp``; no collectives (safe in a background thread).
    Returns their content hashes, computed as they were written (:mod:`.integrity`)."""
    records = {}
    for path, obj in staged.files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # atomic; an I/O error names the file, the rank and (ENOSPC) the bytes needed
        records[os.path.abspath(path)] = save_torch(obj, path)
    if staged.meta is not None:
        meta_path = os.path.join(staged.tmp, "metadata.json")
        records[os.path.abspath(meta_path)] = write_json(meta_path, staged.meta)
        records.update(copy_tokenizer_files(staged.tmp, staged.tokenizer_files))
    return records


def finalize_staged(staged: StagedCheckpoint, records: dict[str, FileHash]) -> str:
    """Collective, once every rank's write has finished: gather the content hashes to rank 0, which writes
    them, renames ``.tmp`` into place and then moves the tracker."""
    everyone = gather_records(records)
    if ps.get_rank() == 0:
        publish(staged.root, staged.iteration, everyone, overwrite=staged.overwrite)
    return staged.final


def save_torch_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, train_config: TrainConfig,
                    state: dict, reducer_states: list[dict] | None = None,
                    save_optim: bool = True, tokenizer_files: list[str] | None = None,
                    overwrite: bool = False) -> str:
    """Collective: every rank must call it. ``state`` holds iteration counters (consumed samples...)."""
    staged = stage_checkpoint(root, iteration, model_chunks, optimizer, scheduler, train_config, state,
                              reducer_states, save_optim, tokenizer_files)
    staged.overwrite = overwrite
    records = write_staged(staged)
    final = finalize_staged(staged, records)
    barrier()
    return final


def _split_of(meta: dict) -> PipelineSplit:
    return GPTConfig.from_dict(meta["model_config"]).pipeline_split


def same_stage_layers(meta: dict, config: GPTConfig, pp: int, vpp: int | None) -> bool:
    """Whether the checkpoint's pipeline split puts the same layers on every (rank, chunk) as this run's (saved
    before uneven splits existed: the even split)."""
    return all(stage_layer_numbers(config.num_layers, r, pp, v, vpp, _split_of(meta))
               == stage_layer_numbers(config.num_layers, r, pp, v, vpp, config.pipeline_split)
               for r in range(pp) for v in range(vpp or 1))


def check_compatible(meta: dict, config: GPTConfig, root: str) -> None:
    """A version this code reads and the same TP/PP/VPP layout, or a clear error saying what differs (the
    architecture is compared after the weights' shapes: :func:`check_weights_fit`)."""
    check_version(meta, root)
    here = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size())
    there = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
             meta.get("virtual_pipeline_model_parallel_size"))
    if here == there and not same_stage_layers(meta, config, here[1], here[2]):
        raise CheckpointError(
            f"checkpoint {root} was saved with another pipeline split ({_split_of(meta)}) than this run's "
            f"({config.pipeline_split}): its stages hold other layers; convert it once with "
            f"tools/convert_checkpoint.py --target-ckpt-format torch_dist (that format loads into any layout)")
    if here != there:
        raise CheckpointError(
            f"checkpoint {root} was saved with (TP, PP, VPP) = {there} but this run uses {here}; convert it "
            f"first: python tools/convert_checkpoint.py --load {root} --save NEW_DIR "
            f"--target-tensor-parallel-size {here[0]} --target-pipeline-model-parallel-size {here[1]} (or convert "
            f"it once with --target-ckpt-format torch_dist: that format loads into any layout)")


def load_torch_checkpoint(root: str, model_chunks, optimizer, scheduler, config: GPTConfig, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, step: int | None = None,
                    exit_on_missing: bool = False, reducers=None, train_config: TrainConfig | None = None) -> dict:
    """Restore what :func:`save_torch_checkpoint` wrote; returns the saved counters (empty dict if nothing loaded).

    With ``train_config``, the checkpoint's saved configuration is compared with it field by field
    (differences are printed on rank 0)."""
    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        if exit_on_missing:
            raise CheckpointError(f"no checkpoint in {root} ({TRACKER} is missing)")
        return {}
    meta = read_metadata(root, iteration)
    check_compatible(meta, config, root)
    if train_config is not None and ps.get_rank() == 0:
        report_config_changes(meta, train_config, root)
    rdir = os.path.join(iteration_dir(root, iteration),
                        rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                      ps.get_pipeline_model_parallel_world_size()))
    path = os.path.join(rdir, "model_optim_rng.pt")
    try:
        payload = load_torch(path)  # a missing, truncated or foreign file is an error naming it and the rank
    except CheckpointError:
        check_architecture(meta, config, root)  # a model that could not use the file anyway: say that first
        raise
    check_weights_fit(path, payload, model_chunks, config, meta, with_optim=load_optim and not finetune)
    check_architecture(meta, config, root)
    merged = {k: v for sd in payload["model"].values() for k, v in sd.items()}
    for m in model_chunks:
        module = m.module
        own = module.state_dict()
        missing = [k for k in own if k not in merged]  # buffers only (check_weights_fit)
        if missing:  # buffers this run adds (e.g. QAT calibration of a bf16 checkpoint): keep their values
            print(f" checkpoint {path} has no {missing[:3]}{'...' if len(missing) > 3 else ''}: keeping "
                  "this run's initial values for these buffers", flush=True)
        module.load_state_dict({k: merged[k] if k in merged else v for k, v in own.items()})
    if finetune:
        return {}
    if load_optim and payload.get("optimizer") is not None:
        optimizer.load_state_dict(payload["optimizer"], param_names(model_chunks))
        scheduler.load_state_dict(payload["opt_param_scheduler"])
    if load_rng and payload.get("rng_state"):  # none in checkpoints imported from Hugging Face
        rngs = payload["rng_state"]
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        rng = rngs[dp_rank] if dp_rank < len(rngs) else rngs[0]
        device_mod.set_rng_state(rng)
        get_rng_tracker().set_states(rng["tracker"])
    if reducers:
        rpath = os.path.join(rdir, reducer_file_name(ps.get_data_parallel_rank(with_context_parallel=True)))
        same_dp = (meta.get("data_parallel_size") == ps.get_data_parallel_world_size()
                   and meta.get("context_parallel_size", 1) == ps.get_context_parallel_world_size())
        dropped = reducer_state_dropped(rpath, same_dp, reducers, meta)
        if dropped:
            if ps.get_rank() == 0:
                safe_print(f" WARNING: {dropped}")
        elif os.path.exists(rpath):
            states = load_torch(rpath)
            for r, s in zip(reducers, states):
                r.load_state_dict(s)
    counters = {k: v for k, v in payload.items()
                if k not in ("model", "optimizer", "opt_param_scheduler", "rng_state", "tp_layout", "model_config")}
    return counters


OPTIM_PREFIX = "optimizer.state.exp_avg."  # the Adam moments' names in shape errors (torch_dist's, the same)


def check_weights_fit(path: str, payload: dict, model_chunks, config: GPTConfig, meta: dict, *,
                      with_optim: bool) -> None:
    """Collective: every saved weight (and, ``with_optim``, Adam moment) of this rank's file ``path`` fits the
    live tensor it is loaded into, or one :class:`.shape_check.CheckpointShapeError` on every rank."""
    saved = {k: v.shape for sd in payload["model"].values() for k, v in sd.items()}
    here = {}
    for m in model_chunks:
        params = dict(m.module.named_parameters())
        here.update({k: v.shape for k, v in m.module.state_dict().items() if k in params or k in saved})
    optim = payload.get("optimizer") if with_optim else None
    if optim is not None:
        saved.update({OPTIM_PREFIX + k: st["exp_avg"].shape for k, st in optim["param_state"].items()})
        here.update({OPTIM_PREFIX + n: p.shape for m in model_chunks for n, p in m.module.named_parameters()})
    check_shapes(path, saved, here, hint=likely_flag(saved_config(meta), config),
                 saved_params=payload.get("tp_layout") or ())


def reducer_file_name(dp_rank: int) -> str:
    """A DP rank's reducer state file; with DiLoCo islands each island's rank has its own."""
    island = f"_island_{ps.get_island_rank():03d}" if ps.get_num_islands() > 1 else ""
    return f"reducer_dp_{dp_rank:03d}{island}.pt"


def reducer_state_dropped(rpath: str, same_dp: bool, reducers, meta: dict) -> str | None:
    """Why the saved reducer (Squinch) state cannot be restored into this run, or None when it can.

    ``rpath`` is this DP rank's ``reducer_dp_DDD.pt``; ``meta`` the checkpoint's metadata.json.
    """
    rank_dir = os.path.dirname(rpath)
    saved = any(n.startswith("reducer_dp_") for n in os.listdir(rank_dir)) if os.path.isdir(rank_dir) else False
    squinch_now = any(r.carries_feedback for r in reducers)
    saved_args = meta.get("args") or {}
    if saved and not squinch_now:
        return (f"{rank_dir} holds Squinch error-feedback state (reducer_dp_*.pt) but this run does not use "
                f"--squinch: dropping it")
    if saved and not same_dp:
        return (f"{rank_dir} holds Squinch error-feedback state for DP={meta.get('data_parallel_size')}, this run "
                f"has another DP size: dropping it (the first step runs without residuals)")
    if squinch_now and not saved and saved_args.get("squinch") is False:
        return "the checkpoint was saved without --squinch: Squinch error-feedback residuals start at zero"
    return None

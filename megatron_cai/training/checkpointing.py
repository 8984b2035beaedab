"""Checkpoints in Megatron's layout, written atomically, resumed bit-exactly.

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
``tools/convert_checkpoint.py`` can reshard it. ``tokenizer/`` holds a copy of the tokenizer files.

``metadata.json`` records the run's whole :class:`~megatron_cai.training.config.TrainConfig`
(``train_config``) and the flags it was built from (``args``). On resume the architecture fields of the
model configuration must match (else :class:`CheckpointError` names them); every other field that
differs is listed, field by field. Checkpoints written before ``train_config`` existed (format 1
without it) load; only their model configuration is compared.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.models.gpt.config import GPTConfig
from ..core.tensor_parallel.random import get_rng_tracker
from .checkpoint_io import (
    CheckpointError,
    load_torch,
    read_json,
    reducer_state_dropped,
    save_torch,
    write_json,
    write_text,
)
from .config import TrainConfig, config_diff
from .errors import safe_print

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


__all__ = ["CheckpointError", "StagedCheckpoint", "finalize_staged", "load_checkpoint", "read_metadata", "read_tracker",
           "save_checkpoint", "stage_checkpoint", "write_staged"]


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") from None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_torch_save(obj: Any, path: str) -> None:
    save_torch(obj, path)  # atomic; an I/O error names the file, the rank and (ENOSPC) the bytes needed


def begin_save(root: str, iteration: int) -> str:
    """Make the empty temporary directory ``iter_XXXXXXX.tmp`` (rank 0) and return it (collective)."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    if ps.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    return tmp


def param_names(model_chunks) -> list[dict[int, str]]:
    """Per chunk, parameter id -> name in the (unwrapped) model's state dict."""
    return [{id(p): n for n, p in getattr(m, "module", m).named_parameters()} for m in model_chunks]


def tp_layout(model_chunks) -> dict[str, dict]:
    out = {}
    for m in model_chunks:
        for n, p in getattr(m, "module", m).named_parameters():
            out[n] = {"tp_dim": getattr(p, "tp_dim", None), "tp_sections": getattr(p, "tp_sections", None),
                      "full_shape": list(getattr(p, "full_shape", p.shape))}
    return out


def _gather_over_dp(obj: Any) -> list[Any]:
    if ps.get_data_parallel_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(out, obj, group=ps.get_data_parallel_group())
    return out


class IterationPaths:
    """``final`` (``root/iter_XXXXXXX``) and ``tmp`` (``final + ".tmp"``) for objects with ``root`` and
    ``iteration``: a save is written into ``tmp`` and renamed to ``final`` before the tracker moves."""

    root: str
    iteration: int

    @property
    def final(self) -> str:
        return iteration_dir(self.root, self.iteration)

    @property
    def tmp(self) -> str:
        return self.final + ".tmp"


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


def stage_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, train_config: TrainConfig,
                     state: dict, reducer_states: list[dict] | None = None,
                     save_optim: bool = True, tokenizer_files: list[str] | None = None,
                     optimizer_views: bool = False) -> StagedCheckpoint:
    """Collective: every rank must call it. Clears ``iter_XXXXXXX.tmp`` and gathers what each rank writes.

    The returned payloads may reference live tensors (model parameters, optimizer state): copy them
    (``async_checkpoint``) before training mutates them, or write them at once (:func:`save_checkpoint`).
    ``optimizer_views``: the optimizer state as views of its gathered flat buffers (``state_dict(copy=False)``)."""
    config = train_config.model
    tmp = begin_save(root, iteration)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    rdir = os.path.join(tmp, rank_dir_name(tp_rank, pp_rank, ps.get_pipeline_model_parallel_world_size()))
    names = param_names(model_chunks)
    optim_state = None
    if save_optim:  # collective over DP
        optim_state = optimizer.state_dict(names, copy=False) if optimizer_views else optimizer.state_dict(names)
    rng = {**device_mod.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    all_rng = _gather_over_dp(rng)
    staged = StagedCheckpoint(root, iteration, {})
    if dp_rank == 0:
        payload = {
            "checkpoint_version": FORMAT_VERSION,
            "iteration": iteration,
            "model": {f"model{i}": getattr(m, "module", m).state_dict() for i, m in enumerate(model_chunks)},
            "optimizer": optim_state,
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": all_rng,
            "tp_layout": tp_layout(model_chunks),
            "model_config": config.to_dict(),
            **state,
        }
        staged.files[os.path.join(rdir, "model_optim_rng.pt")] = payload
    if reducer_states and any(reducer_states):
        staged.files[os.path.join(rdir, f"reducer_dp_{dp_rank:03d}.pt")] = reducer_states
    if ps.get_rank() == 0:
        staged.meta = run_metadata(iteration, train_config)
        staged.tokenizer_files = list(tokenizer_files or [])
    return staged


def write_staged(staged: StagedCheckpoint) -> None:
    """Write this rank's files into ``iter_XXXXXXX.tmp``; no collectives (safe in a background thread)."""
    for path, obj in staged.files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _atomic_torch_save(obj, path)
    if staged.meta is not None:
        write_json(os.path.join(staged.tmp, "metadata.json"), staged.meta)
        copy_tokenizer_files(staged.tmp, staged.tokenizer_files)


def finalize_staged(staged: StagedCheckpoint) -> str:
    """Rank 0, once every rank's write has finished: rename ``.tmp`` into place, then move the tracker."""
    if ps.get_rank() == 0:
        if os.path.exists(staged.final):
            shutil.rmtree(staged.final)
        os.replace(staged.tmp, staged.final)
        write_text(os.path.join(staged.root, TRACKER), str(staged.iteration), fsync=True)
    return staged.final


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, train_config: TrainConfig,
                    state: dict, reducer_states: list[dict] | None = None,
                    save_optim: bool = True, tokenizer_files: list[str] | None = None) -> str:
    """Collective: every rank must call it. ``state`` holds iteration counters (consumed samples...)."""
    staged = stage_checkpoint(root, iteration, model_chunks, optimizer, scheduler, train_config, state,
                              reducer_states, save_optim, tokenizer_files)
    write_staged(staged)
    _barrier()
    final = finalize_staged(staged)
    _barrier()
    return final


def run_metadata(iteration: int, train_config: TrainConfig) -> dict:
    """The ``metadata.json`` of a checkpoint of this run (rank 0 writes it): layout, configs, flags."""
    return {"checkpoint_version": FORMAT_VERSION, "iteration": iteration,
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "model_config": train_config.model.to_dict(),
            "train_config": {k: v for k, v in train_config.to_dict().items() if k != "flags"},
            "args": train_config.flags}


def copy_tokenizer_files(ckpt_dir: str, tokenizer_files: list[str] | None) -> None:
    """Copy the tokenizer files into ``ckpt_dir/tokenizer`` (none: nothing)."""
    if not tokenizer_files:
        return
    tok_dir = os.path.join(ckpt_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    for src in tokenizer_files:
        if src and os.path.isfile(src):
            shutil.copy2(src, tok_dir)


def refuse_megatron_lm_checkpoint(root: str, iteration: int) -> None:
    """A Megatron-LM checkpoint given to ``--load`` gets one error naming the converter command.

    Megatron-LM's ``torch_dist`` directories hold a ``metadata.json`` with ``sharded_backend``; its legacy
    ``torch`` ones hold ``mp_rank_*`` directories and no ``metadata.json`` (ours always write one)."""
    d = iteration_dir(root, iteration)
    meta_path = os.path.join(d, "metadata.json")
    megatron = False
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                megatron = "sharded_backend" in json.load(f)
        except (OSError, ValueError):
            return  # read_metadata names the corrupt file
    elif glob.glob(os.path.join(d, "mp_rank_*")):
        megatron = True
    if megatron:
        raise CheckpointError(f"{d} is a Megatron-LM checkpoint, not one of ours: convert it first with "
                              f"python tools/convert_checkpoint.py --from-megatron --load {root} --save NEW_DIR "
                              f"(docs/conversion.md)")


def read_metadata(root: str, iteration: int) -> dict:
    meta = read_json(os.path.join(iteration_dir(root, iteration), "metadata.json"))
    missing = [k for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "model_config")
               if k not in meta]
    if missing:
        raise CheckpointError(f"{os.path.join(iteration_dir(root, iteration), 'metadata.json')} is corrupt: it "
                              f"lacks {missing}")
    return meta


def check_compatible(meta: dict, config: GPTConfig, root: str) -> None:
    """Same TP/PP/VPP layout and the same architecture, or a clear error saying what differs."""
    version = meta.get("checkpoint_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {root} has checkpoint_version {version!r}; this version of megatron-cai "
                              f"reads versions up to {FORMAT_VERSION}")
    here = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size())
    there = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
             meta.get("virtual_pipeline_model_parallel_size"))
    if here != there:
        raise CheckpointError(
            f"checkpoint {root} was saved with (TP, PP, VPP) = {there} but this run uses {here}; convert it "
            f"first: python tools/convert_checkpoint.py --load {root} --save NEW_DIR "
            f"--target-tensor-parallel-size {here[0]} --target-pipeline-model-parallel-size {here[1]} (or convert "
            f"it once with --target-ckpt-format torch_dist: that format loads into any layout)")
    diff = config.architecture_diff(GPTConfig.from_dict(meta["model_config"]))
    if diff:
        raise CheckpointError(f"checkpoint {root} has a different model configuration: " + "; ".join(diff))


def report_config_changes(meta: dict, train_config: TrainConfig, root: str, log=print) -> list[tuple]:
    """Compare the checkpoint's saved TrainConfig with this run's, field by field, and log what differs.

    Returns the differences ``[(field, checkpoint value, this run's value)]`` (architecture mismatches are
    refused earlier, by :func:`check_compatible`)."""
    saved = meta.get("train_config")
    if saved is None:
        log(f" checkpoint {root} predates saved training configurations: only its model configuration "
            "was compared")
        return []
    current = {k: v for k, v in train_config.to_dict().items() if k != "flags"}
    diff = config_diff(saved, json.loads(json.dumps(current, default=str)))
    if diff:
        log(f" configuration differs from checkpoint {root} in {len(diff)} field(s):")
        for name, there, here in diff:
            log(f"   {name}: {there!r} (checkpoint) -> {here!r} (this run)")
    return diff


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, config: GPTConfig, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, step: int | None = None,
                    exit_on_missing: bool = False, reducers=None, train_config: TrainConfig | None = None) -> dict:
    """Restore what `save_checkpoint` wrote; returns the saved counters (empty dict if nothing loaded).

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
    payload = load_torch(path)  # a missing, truncated or foreign file is an error naming it and the rank
    merged = {}
    for sd in payload["model"].values():
        merged.update(sd)
    for m in model_chunks:
        module = getattr(m, "module", m)
        own = module.state_dict()
        params = {n for n, _ in module.named_parameters()}
        missing = [k for k in own if k not in merged]
        missing_params = [k for k in missing if k in params]
        if missing_params:
            raise CheckpointError(f"{path} lacks parameters {missing_params[:5]}"
                                  f"{'...' if len(missing_params) > 5 else ''}")
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
        dp_rank = ps.get_data_parallel_rank()
        rng = rngs[dp_rank] if dp_rank < len(rngs) else rngs[0]
        device_mod.set_rng_state(rng)
        get_rng_tracker().set_states(rng["tracker"])
    if reducers:
        rpath = os.path.join(rdir, f"reducer_dp_{ps.get_data_parallel_rank():03d}.pt")
        same_dp = meta.get("data_parallel_size") == ps.get_data_parallel_world_size()
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

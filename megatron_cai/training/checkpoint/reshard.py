"""Reshard checkpoints between TP/PP(/VPP) layouts through a layout-free ("canonical") form.

``load_canonical`` reads every rank file of a checkpoint (see :mod:`.torch_format`) and rebuilds
the full tensors: shards are joined with ``unshard_tensor`` along each parameter's ``tp_dim`` and
``tp_sections`` (recorded per parameter in ``tp_layout``), pipeline stages are merged by their global
parameter names, and the last stage's copy of tied embeddings (``output_layer.weight``) is dropped.
The Adam state (``exp_avg``, ``exp_avg_sq``, already gathered over DP in the files) gets the same
treatment. ``save_resharded`` cuts the canonical tensors for a target layout and writes a checkpoint
that ``pretrain_gpt.py --load`` accepts with that layout.

What carries over and what does not:

- weights and Adam state exactly (resharding only moves elements); the vocabulary rows are re-padded
  to Megatron's rule for the target (a multiple of ``make_vocab_size_divisible_by x TP``): rows past
  the old padding are zero (weights and Adam state), rows beyond the new padding are dropped. Padding
  rows (ids >= vocab_size) are never looked up and are masked out of the softmax, so they never affect
  outputs or gradients;
- the LR scheduler, the optimizer step, iteration, consumed samples (so the data loader resumes at the
  same global sample) and the other counters;
- RNG states: kept as saved when TP and PP are unchanged (one state per DP rank; a run with more DP
  ranks than were saved gives the extra ranks DP rank 0's state). When TP or PP changes, target rank
  (t, p) takes the states of source rank (t mod TP_src, the source stage holding p's first layer).
  Dropout masks depend on the layout anyway, so only runs without dropout continue bit-for-bit;
- reducer files (Squinch error-feedback residuals, per DP rank) describe this rank's flat gradient
  buffer and are only valid for the same TP/PP/VPP layout: they are copied when that layout is
  unchanged (the loader still ignores them when DP differs) and dropped otherwise, so the first
  step after a layout change runs without residuals.
"""
from __future__ import annotations

import copy
import glob
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.models.gpt.config import GPTConfig
from ...core.models.gpt.model import WORD_EMBEDDINGS
from ...core.parallel_state import ParallelLayoutError, check_layout
from ...core.pipeline_parallel.layer_split import split_problems, stage_layer_numbers
from ...core.tensor_parallel.utils import shard_tensor, unshard_tensor
from ..errors import UserError
from ..tokenizer import vocab_size_with_padding
from .file_io import CheckpointError, save_torch, write_json
from .integrity import hash_tree
from .metadata import FORMAT_VERSION, read_metadata
from .run_dirs import TRACKER, iteration_dir, publish, read_tracker
from .safe_load import load_torch
from .torch_format import rank_dir_name

OUTPUT_WEIGHT = "output_layer.weight"
VOCAB_PARAMS = (WORD_EMBEDDINGS, OUTPUT_WEIGHT)
_PAYLOAD_KEYS = ("model", "optimizer", "opt_param_scheduler", "rng_state", "tp_layout", "model_config")


class ConversionError(UserError, RuntimeError):
    """A checkpoint that cannot be converted as asked; the message says why."""


@dataclass
class Layout:
    """A parallel layout of model-parallel ranks (DP is decided by the world size at run time)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None   # virtual pipeline chunks per rank (None: not interleaved)
    dp: int | None = None    # recorded when known

    def same_model_parallel(self, other: Layout) -> bool:
        return (self.tp, self.pp, self.vpp or 1) == (other.tp, other.pp, other.vpp or 1)


@dataclass
class CanonicalCheckpoint:
    """A checkpoint with full (unsharded) tensors keyed by global parameter names."""

    config: GPTConfig
    iteration: int = 0
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    layout_meta: dict[str, dict] = field(default_factory=dict)  # name -> {"tp_dim", "tp_sections"} (params)
    optimizer: dict | None = None  # {"step", "hyper", "param_state": {name: {"exp_avg", "exp_avg_sq"}}}
    scheduler: dict | None = None
    counters: dict[str, Any] = field(default_factory=dict)
    rng: dict[tuple[int, int], list] = field(default_factory=dict)  # (tp_rank, pp_rank) -> per-DP states
    args: dict[str, Any] = field(default_factory=dict)
    source: Layout = field(default_factory=Layout)
    reducer_files: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    tokenizer_dir: str | None = None
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- helpers
def layer_of(name: str) -> int | None:
    """Global layer number of a ``decoder.layers.N.*`` name (None for other names)."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    return None


def tp_dim_for(name: str, meta: dict, config: GPTConfig, tp: int) -> int | None:
    """The split dimension of a parameter under TP = tp. KV projections are replicated (not split) when
    the query groups do not divide over TP; everything else keeps the dimension it was saved with."""
    if ".linear_kv." in name:
        return None if config.num_query_groups % tp != 0 else 0
    return meta.get("tp_dim")


def fit_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim padding rows or append zero rows so that dimension 0 has ``rows`` rows."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows].clone()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


def chunk_names(names, config: GPTConfig, pp_rank: int, pp: int, v: int, vpp: int | None) -> list[str]:
    """Canonical names that live in chunk v of pipeline rank pp_rank (the tied output copy excluded)."""
    chunks = vpp or 1
    pre, post = pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == chunks - 1
    layers = set(stage_layer_numbers(config.num_layers, pp_rank, pp, v, vpp, config.pipeline_split))
    out = []
    for n in names:
        lay = layer_of(n)
        if lay is not None:
            keep = lay in layers
        elif n.startswith("embedding."):
            keep = pre
        elif n.startswith("decoder.final_layernorm.") or n.startswith("output_layer."):
            keep = post
        else:
            raise ConversionError(f"parameter {n!r} belongs to no known pipeline stage")
        if keep:
            out.append(n)
    return out


def _source_stage_of_layer(layer: int, config: GPTConfig, src: Layout) -> int:
    for p in range(src.pp):
        for v in range(src.vpp or 1):
            if layer in stage_layer_numbers(config.num_layers, p, src.pp, v, src.vpp, config.pipeline_split):
                return p
    return 0


# ---------------------------------------------------------------------------------------------- load
def _rank_files(root: str, iteration: int, tp: int, pp: int) -> dict[tuple[int, int], str]:
    out = {}
    for t in range(tp):
        for p in range(pp):
            path = os.path.join(iteration_dir(root, iteration), rank_dir_name(t, p, pp), "model_optim_rng.pt")
            if not os.path.exists(path):
                raise ConversionError(f"{path} is missing: incomplete checkpoint (metadata.json says TP={tp}, "
                                      f"PP={pp})")
            out[(t, p)] = path
    return out


def _join(shards: dict[int, torch.Tensor], meta: dict | None, name: str, tp: int, what: str) -> torch.Tensor:
    missing = [t for t in range(tp) if t not in shards]
    if missing:
        raise ConversionError(f"{what} {name!r} is missing on tensor-parallel ranks {missing}")
    if meta is None or meta.get("tp_dim") is None or tp == 1:
        return shards[0]
    return unshard_tensor([shards[t] for t in range(tp)], meta["tp_dim"], meta.get("tp_sections"))


def load_canonical(root: str, step: int | None = None, *, load_optimizer: bool = True) -> CanonicalCheckpoint:
    """Read a checkpoint of any TP/PP/VPP layout into full tensors (see the module docstring), after checking
    its files against their content hashes."""
    from .checkpointer import verify_checkpoint

    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        raise ConversionError(f"no checkpoint in {root} ({TRACKER} is missing; pass --ckpt-step N)")
    try:
        meta = read_metadata(root, iteration)
        verify_checkpoint(root, iteration, collective=False)  # one process reads it all (some ranks only)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    src = Layout(meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
                 meta.get("virtual_pipeline_model_parallel_size"), meta.get("data_parallel_size"))
    config = GPTConfig.from_dict(meta["model_config"])
    files = _rank_files(root, iteration, src.tp, src.pp)
    weights: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    states: dict[str, dict[int, dict]] = defaultdict(dict)
    layout_meta: dict[str, dict] = {}
    ck = CanonicalCheckpoint(config=config, iteration=iteration, args=dict(meta.get("args") or {}), source=src)
    has_optim = load_optimizer
    tied_copy: dict[int, torch.Tensor] = {}
    for (t, p), path in files.items():
        payload = load_torch(path)  # errors name the file
        layout_meta.update({k: {"tp_dim": v.get("tp_dim"), "tp_sections": v.get("tp_sections")}
                            for k, v in payload.get("tp_layout", {}).items()})
        for sd in payload["model"].values():
            for name, tensor in sd.items():
                if name == OUTPUT_WEIGHT and not config.untie_embeddings_and_output_weights:
                    tied_copy[t] = tensor  # the last stage's copy of the tied embeddings
                    continue
                weights[name][t] = tensor
        optim = payload.get("optimizer")
        if optim is None:
            has_optim = False
        elif has_optim:
            for name, st in optim["param_state"].items():
                if name == OUTPUT_WEIGHT and not config.untie_embeddings_and_output_weights:
                    continue
                states[name][t] = st
            if (t, p) == (0, 0) or ck.optimizer is None:
                ck.optimizer = {"step": optim["step"], "hyper": optim.get("hyper", {})}
        ck.rng[(t, p)] = payload.get("rng_state") or []
        if (t, p) == (0, 0):
            ck.scheduler = payload.get("opt_param_scheduler")
            ck.counters = {k: v for k, v in payload.items() if k not in _PAYLOAD_KEYS}
        reducers = sorted(glob.glob(os.path.join(os.path.dirname(path), "reducer_dp_*.pt")))
        if reducers:
            ck.reducer_files[(t, p)] = reducers
        del payload
    ck.model = {n: _join(s, layout_meta.get(n), n, src.tp, "parameter") for n, s in weights.items()}
    ck.layout_meta = {n: m for n, m in layout_meta.items() if n in ck.model}
    if tied_copy and WORD_EMBEDDINGS in ck.model:
        copy_full = _join(tied_copy, layout_meta.get(OUTPUT_WEIGHT), OUTPUT_WEIGHT, src.tp, "parameter")
        if not torch.equal(copy_full, ck.model[WORD_EMBEDDINGS]):
            diff = (copy_full - ck.model[WORD_EMBEDDINGS]).abs().max().item()
            ck.notes.append(f"the last stage's tied output weights differ from the embeddings by up to {diff:.3g}; "
                            "kept the first stage's embeddings")
    if has_optim and ck.optimizer is not None:
        ck.optimizer["param_state"] = {
            n: {k: _join({t: st[k] for t, st in s.items()}, layout_meta.get(n), n, src.tp, "optimizer state of")
                for k in ("exp_avg", "exp_avg_sq")}
            for n, s in states.items()}
        missing = sorted(set(ck.model) - set(ck.optimizer["param_state"]) - _buffer_names(ck))
        if missing:
            raise ConversionError(f"optimizer state is missing for {missing[:5]} in {root}")
    else:
        ck.optimizer = None
    tok = os.path.join(iteration_dir(root, iteration), "tokenizer")
    ck.tokenizer_dir = tok if os.path.isdir(tok) else None
    return ck


def _buffer_names(ck: CanonicalCheckpoint) -> set[str]:
    """State-dict entries that are not parameters (e.g. QAT static clamps): no layout, no Adam state."""
    return {n for n in ck.model if n not in ck.layout_meta}


# ---------------------------------------------------------------------------------------------- save
def target_layout(config: GPTConfig, tp: int, pp: int, vp_layers: int | None = None,
                  dp: int | None = None) -> Layout:
    """Validate a target layout (the same rules as the run's start-up) and return it."""
    vpp, split = None, config.pipeline_split
    if not split.even and (vp_layers is not None or split_problems(config.num_layers, pp, None, split)):
        raise ConversionError(f"the model's uneven pipeline split ({split}) does not fit target PP={pp}"
                              + (" with virtual stages" if vp_layers is not None else ""))
    if vp_layers is not None:
        if pp < 2:
            raise ConversionError("--target-num-layers-per-virtual-pipeline-stage needs a target pipeline size > 1")
        if config.num_layers % pp != 0 or (config.num_layers // pp) % vp_layers != 0:
            raise ConversionError(f"num-layers {config.num_layers} cannot be cut into {pp} stages of chunks of "
                                  f"{vp_layers} layers")
        vpp = config.num_layers // pp // vp_layers
        vpp = vpp if vpp > 1 else None
    try:
        check_layout(tp * pp, tp, pp, num_layers=config.num_layers if split.even else None,
                     num_attention_heads=config.num_attention_heads,
                     num_query_groups=config.num_query_groups)
    except ParallelLayoutError as e:
        raise ConversionError(f"target layout TP={tp}, PP={pp}: {e}") from None
    return Layout(tp, pp, vpp, dp)


def _shard(full: torch.Tensor, name: str, meta: dict, config: GPTConfig, tp: int, t: int) -> torch.Tensor:
    dim = tp_dim_for(name, meta, config, tp)
    if dim is None or tp == 1:
        return full.clone()
    try:
        return shard_tensor(full, dim, t, tp, meta.get("tp_sections"))
    except ValueError as e:
        raise ConversionError(f"cannot split {name!r} of shape {tuple(full.shape)} over TP={tp}: {e}") from None


def _rank_payload(ck: CanonicalCheckpoint, config: GPTConfig, target: Layout, t: int, p: int,
                  with_optimizer: bool) -> dict:
    tied_last = not config.untie_embeddings_and_output_weights
    chunks = target.vpp or 1
    model_sds, layout, param_state = {}, {}, {}
    for v in range(chunks):
        names = chunk_names(ck.model, config, p, target.pp, v, target.vpp)
        pre = p == 0 and v == 0
        post = p == target.pp - 1 and v == chunks - 1
        pairs = [(n, n) for n in names]
        if post and not pre and tied_last:
            pairs.append((OUTPUT_WEIGHT, WORD_EMBEDDINGS))  # the last stage's copy of the tied embeddings
        sd = {}
        for name, src in pairs:
            meta = ck.layout_meta.get(src)
            sd[name] = _shard(ck.model[src], src, meta or {}, config, target.tp, t) if meta else ck.model[src].clone()
            if meta is None:
                continue  # a buffer: replicated, no layout, no optimizer state
            dim = tp_dim_for(src, meta, config, target.tp)
            layout[name] = {"tp_dim": dim, "tp_sections": meta.get("tp_sections"),
                            "full_shape": list(ck.model[src].shape)}
            if with_optimizer:
                st = ck.optimizer["param_state"][src]
                param_state[name] = {k: _shard(st[k], src, meta, config, target.tp, t)
                                     for k in ("exp_avg", "exp_avg_sq")}
        model_sds[f"model{v}"] = sd
    optimizer = None
    if with_optimizer:
        optimizer = {"step": ck.optimizer["step"], "param_state": param_state,
                     "hyper": copy.deepcopy(ck.optimizer.get("hyper", {}))}
    return {"model": model_sds, "optimizer": optimizer, "tp_layout": layout}


def _rng_for(ck: CanonicalCheckpoint, config: GPTConfig, target: Layout, t: int, p: int) -> list:
    if not ck.rng:
        return []
    if ck.source.tp == target.tp and ck.source.pp == target.pp:
        return ck.rng.get((t, p), [])
    layers = [n for v in range(target.vpp or 1)
              for n in stage_layer_numbers(config.num_layers, p, target.pp, v, target.vpp, config.pipeline_split)]
    source_stage = _source_stage_of_layer(layers[0], config, ck.source) if layers else 0
    return ck.rng.get((t % ck.source.tp, source_stage), [])


def save_resharded(ck: CanonicalCheckpoint, out_root: str, target: Layout, *,
                   make_vocab_size_divisible_by: int | None = None, with_optimizer: bool = True,
                   log=print) -> str:
    """Write ``ck`` as a checkpoint with the ``target`` layout into ``out_root``; returns the iteration dir.

    The directory is written under a temporary name and renamed, and the tracker is written last.
    """
    divisible = make_vocab_size_divisible_by or int(ck.args.get("make_vocab_size_divisible_by") or 128)
    config = GPTConfig.from_dict(ck.config.to_dict())
    config.padded_vocab_size = vocab_size_with_padding(config.vocab_size, divisible, target.tp)
    model = dict(ck.model)
    optimizer = copy.copy(ck.optimizer) if (with_optimizer and ck.optimizer is not None) else None
    if optimizer is not None:
        optimizer["param_state"] = dict(optimizer["param_state"])
    for name in VOCAB_PARAMS:
        if name in model:
            model[name] = fit_vocab_rows(model[name], config.padded_vocab_size)
            if optimizer is not None:
                optimizer["param_state"][name] = {k: fit_vocab_rows(v, config.padded_vocab_size)
                                                  for k, v in optimizer["param_state"][name].items()}
    work = copy.copy(ck)
    work.model, work.optimizer = model, optimizer
    same_mp = ck.source.same_model_parallel(target)
    dp = target.dp if target.dp is not None else (ck.source.dp if same_mp else None)

    final = iteration_dir(out_root, ck.iteration)
    tmp = final + ".tmp"
    os.makedirs(out_root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for t in range(target.tp):
        for p in range(target.pp):
            rdir = os.path.join(tmp, rank_dir_name(t, p, target.pp))
            os.makedirs(rdir)
            payload = {"checkpoint_version": FORMAT_VERSION, **ck.counters, "iteration": ck.iteration,
                       **_rank_payload(work, config, target, t, p, optimizer is not None),
                       "opt_param_scheduler": copy.deepcopy(ck.scheduler) if ck.scheduler else None,
                       "rng_state": _rng_for(ck, config, target, t, p), "model_config": config.to_dict()}
            save_torch(payload, os.path.join(rdir, "model_optim_rng.pt"))
            if same_mp and (target.dp is None or target.dp == ck.source.dp):
                for src in ck.reducer_files.get((t, p), []):
                    shutil.copy2(src, rdir)
    if ck.reducer_files and not same_mp:
        log(" note: reducer (Squinch residual) files dropped: they only fit the layout they were saved with")
    args = dict(ck.args)
    args.update({"tensor_model_parallel_size": target.tp, "pipeline_model_parallel_size": target.pp,
                 "virtual_pipeline_model_parallel_size": target.vpp,
                 "num_layers_per_virtual_pipeline_stage":
                     config.num_layers // target.pp // target.vpp if target.vpp else None,
                 "make_vocab_size_divisible_by": divisible, "data_parallel_size": dp,
                 "world_size": target.tp * target.pp * dp if dp else None})
    meta = {"checkpoint_version": FORMAT_VERSION, "iteration": ck.iteration,
            "tensor_model_parallel_size": target.tp, "pipeline_model_parallel_size": target.pp,
            "virtual_pipeline_model_parallel_size": target.vpp, "data_parallel_size": dp,
            "model_config": config.to_dict(), "args": args,
            "converted_from": {"tensor_model_parallel_size": ck.source.tp,
                               "pipeline_model_parallel_size": ck.source.pp,
                               "virtual_pipeline_model_parallel_size": ck.source.vpp,
                               "data_parallel_size": ck.source.dp, "optimizer_state": optimizer is not None,
                               "notes": list(ck.notes)}}
    return publish_converted(out_root, ck.iteration, meta, ck.tokenizer_dir)


def publish_converted(out_root: str, iteration: int, meta: dict, tokenizer_dir: str | None) -> str:
    """Finish a converted checkpoint written into ``iter_XXXXXXX.tmp``: ``metadata.json``, the tokenizer copy,
    the content hashes of every file (``checksums.json``, signed under a signing key), the rename to
    ``iter_XXXXXXX/`` and the tracker, written last. The caller has checked that ``out_root`` is not the source or
    another run (``check_conversion_target``)."""
    tmp = iteration_dir(out_root, iteration) + ".tmp"
    write_json(os.path.join(tmp, "metadata.json"), meta)
    if tokenizer_dir:
        shutil.copytree(tokenizer_dir, os.path.join(tmp, "tokenizer"))
    return publish(out_root, iteration, hash_tree(tmp))


def reshard_checkpoint(load: str, save: str, tp: int, pp: int, vp_layers: int | None = None, *,
                       dp: int | None = None, step: int | None = None, with_optimizer: bool = True,
                       make_vocab_size_divisible_by: int | None = None, log=print) -> str:
    """Convert the checkpoint in ``load`` to (TP, PP[, VPP]) = (tp, pp[, vp_layers]) and write it to ``save``."""
    ck = load_canonical(load, step, load_optimizer=with_optimizer)
    target = target_layout(ck.config, tp, pp, vp_layers, dp)
    for note in ck.notes:
        log(f" note: {note}")
    out = save_resharded(ck, save, target, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                         with_optimizer=with_optimizer, log=log)
    log(f" converted iteration {ck.iteration}: (TP, PP, VPP) = ({ck.source.tp}, {ck.source.pp}, {ck.source.vpp}) -> "
        f"({target.tp}, {target.pp}, {target.vpp}); optimizer state: "
        f"{'yes' if with_optimizer and ck.optimizer is not None else 'no'}; wrote {out}")
    return out

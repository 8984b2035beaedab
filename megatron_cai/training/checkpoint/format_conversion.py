"""Format conversion between the per-rank ``torch`` checkpoints and ``torch_dist`` ones (one process).

``tools/convert_checkpoint.py --target-ckpt-format`` calls these. Both go through the canonical
(full-tensor) form of :mod:`.reshard`: ``torch -> torch_dist`` writes it with DCP (plain global
tensors, which any layout then reads piecewise); ``torch_dist -> torch`` reads every tensor whole and
cuts it for the target layout with ``save_resharded``. Per-rank RNG states and Squinch reducer states
keep their (TP, PP, DP) coordinates both ways.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ...core.models.gpt.config import GPTConfig
from .dcp_pieces import dcp_load, dcp_save, read_dcp_metadata
from .dist_format import COMMON, EXP_AVG, EXP_AVG_SQ, FORMAT, RANK_STATE, rank_key
from .metadata import FORMAT_VERSION, TORCH_DIST, detect_format, read_metadata
from .reshard import (
    CanonicalCheckpoint,
    ConversionError,
    Layout,
    load_canonical,
    publish_converted,
    save_resharded,
    target_layout,
)
from .run_dirs import TRACKER, iteration_dir, read_tracker
from .safe_load import load_torch


def torch_to_dist(load: str, save: str, step: int | None = None, *, with_optimizer: bool = True,
                  log=print) -> str:
    """Write the torch-format checkpoint in ``load`` as a torch_dist checkpoint in ``save`` (one process).

    Weights, Adam moments, scheduler and counters carry over exactly; the per-rank RNG states and reducer
    files keep their (TP, PP, DP) coordinates, so a resume in the source layout stays bit-exact."""
    ck = load_canonical(load, step, load_optimizer=with_optimizer)
    meta = read_metadata(load, ck.iteration)
    sd: dict[str, Any] = {n: t.contiguous() for n, t in ck.model.items()}
    optim = None
    if ck.optimizer is not None:
        for n, st in ck.optimizer["param_state"].items():
            sd[EXP_AVG + n], sd[EXP_AVG_SQ + n] = st["exp_avg"].contiguous(), st["exp_avg_sq"].contiguous()
        optim = {"step": ck.optimizer["step"], "hyper": ck.optimizer.get("hyper", {})}
    sd[COMMON] = {"checkpoint_version": FORMAT_VERSION, **ck.counters, "iteration": ck.iteration,
                  "opt_param_scheduler": ck.scheduler, "optimizer": optim}
    for (t, p), states in ck.rng.items():
        reducer_files = {int(os.path.basename(f)[len("reducer_dp_"):-3]): f for f in ck.reducer_files.get((t, p), [])}
        for d, rng in enumerate(states):
            reducers = load_torch(reducer_files[d]) if d in reducer_files else None
            sd[rank_key(t, p, d)] = {"rng": rng, "reducers": reducers, "data_parallel_kind": "ddp"}
    final = iteration_dir(save, ck.iteration)
    tmp = final + ".tmp"
    os.makedirs(save, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    dcp_save(sd, tmp, no_dist=True)
    meta.update({"ckpt_format": FORMAT, "data_parallel_kind": "ddp",
                 "param_layout": {n: {**m, "full_shape": list(ck.model[n].shape)} for n, m in ck.layout_meta.items()},
                 "converted_from": {"ckpt_format": "torch", "optimizer_state": ck.optimizer is not None,
                                    "notes": list(ck.notes)}})
    publish_converted(save, ck.iteration, meta, ck.tokenizer_dir)
    log(f" converted iteration {ck.iteration} from torch to torch_dist (layout-free; optimizer state: "
        f"{'yes' if ck.optimizer is not None else 'no'}); wrote {final}")
    return final


def load_dist_canonical(root: str, step: int | None = None, *, load_optimizer: bool = True):
    """Read a torch_dist checkpoint into full tensors (a ``CanonicalCheckpoint``, one process), after checking
    its files against their content hashes.

    The per-rank states come back keyed by their saved (TP, PP) coordinates, with reducer states in
    ``reducer_states[(tp, pp)][dp]``."""
    from .checkpointer import verify_checkpoint

    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        raise ConversionError(f"no checkpoint in {root} ({TRACKER} is missing; pass --ckpt-step N)")
    path = iteration_dir(root, iteration)
    meta = read_metadata(root, iteration)
    verify_checkpoint(root, iteration, collective=False)  # one process reads it all (some ranks only)
    saved = read_dcp_metadata(path).state_dict_metadata
    sd: dict[str, Any] = {}
    for k, md in saved.items():
        if isinstance(md, BytesStorageMetadata):
            sd[k] = None
        elif load_optimizer or not k.startswith("optimizer."):
            sd[k] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp_load(sd, path, no_dist=True)
    src = Layout(meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
                 meta.get("virtual_pipeline_model_parallel_size"), meta.get("data_parallel_size"))
    ck = CanonicalCheckpoint(config=GPTConfig.from_dict(meta["model_config"]), iteration=iteration,
                             args=dict(meta.get("args") or {}), source=src)
    ck.model = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}
    ck.layout_meta = {n: {"tp_dim": m.get("tp_dim"), "tp_sections": m.get("tp_sections"),
                          **({"expert": True} if m.get("expert") else {})}
                      for n, m in (meta.get("param_layout") or {}).items() if n in ck.model}
    common = sd.get(COMMON) or {}
    ck.scheduler = common.get("opt_param_scheduler")
    ck.counters = {k: v for k, v in common.items() if k not in ("optimizer", "opt_param_scheduler")}
    if load_optimizer and common.get("optimizer") is not None and any(k.startswith(EXP_AVG) for k in sd):
        ck.optimizer = {**common["optimizer"], "param_state": {
            n: {"exp_avg": sd[EXP_AVG + n], "exp_avg_sq": sd[EXP_AVG_SQ + n]} for n in ck.layout_meta}}
    rngs: dict[tuple[int, int], dict[int, Any]] = {}
    ck.reducer_states = {}
    for k, v in sd.items():
        if k.startswith(RANK_STATE) and v:
            t, p, d = (int(x[2:]) for x in k[len(RANK_STATE):].split("."))
            rngs.setdefault((t, p), {})[d] = v.get("rng")
            if v.get("reducers") and v.get("data_parallel_kind") == "ddp":
                ck.reducer_states.setdefault((t, p), {})[d] = v["reducers"]
    ck.rng = {tp_pp: [by_dp[d] for d in sorted(by_dp)] for tp_pp, by_dp in rngs.items()}
    tok = os.path.join(path, "tokenizer")
    ck.tokenizer_dir = tok if os.path.isdir(tok) else None
    return ck


def load_any_canonical(root: str, step: int | None = None, *, load_optimizer: bool = True) -> CanonicalCheckpoint:
    """Either format's checkpoint (``iter_XXXXXXX`` at ``step``, else the tracker's) in canonical form, in one
    process, after checking its files against their content hashes (``tools/generate.py``)."""
    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        raise ConversionError(f"no checkpoint in {root} ({TRACKER} is missing; pass --ckpt-step N)")
    if detect_format(root, iteration) == TORCH_DIST:
        return load_dist_canonical(root, iteration, load_optimizer=load_optimizer)
    return load_canonical(root, iteration, load_optimizer=load_optimizer)


def dist_to_torch(load: str, save: str, step: int | None = None, *, tp: int | None = None, pp: int | None = None,
                  vp_layers: int | None = None, dp: int | None = None, with_optimizer: bool = True,
                  make_vocab_size_divisible_by: int | None = None, log=print) -> str:
    """Write the torch_dist checkpoint in ``load`` as a torch-format checkpoint of (TP, PP[, VPP]) in ``save``
    (default: the saving run's layout). Reducer (Squinch) states of the saving layout are kept as
    ``reducer_dp_DDD.pt`` files when the target layout is that layout (as the torch resharder does)."""
    import tempfile

    ck = load_dist_canonical(load, step, load_optimizer=with_optimizer)
    for m in ck.layout_meta.values():  # a torch-format run holds every expert whole on each TP rank (expert TP 1)
        if m.get("expert"):
            m.update(tp_dim=None, tp_sections=None)
    target = target_layout(ck.config, tp or ck.source.tp, pp or ck.source.pp, vp_layers, dp)
    with tempfile.TemporaryDirectory() as staging:
        for (t, p), by_dp in ck.reducer_states.items():
            os.makedirs(os.path.join(staging, f"{t}_{p}"))
            for d, states in by_dp.items():
                file = os.path.join(staging, f"{t}_{p}", f"reducer_dp_{d:03d}.pt")
                torch.save(states, file)
                ck.reducer_files.setdefault((t, p), []).append(file)
        out = save_resharded(ck, save, target, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             with_optimizer=with_optimizer, log=log)
    log(f" converted iteration {ck.iteration} from torch_dist to torch with (TP, PP, VPP) = ({target.tp}, "
        f"{target.pp}, {target.vpp}); optimizer state: {'yes' if ck.optimizer is not None else 'no'}; wrote {out}")
    return out

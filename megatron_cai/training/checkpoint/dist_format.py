"""``--ckpt-format torch_dist``: checkpoints on ``torch.distributed.checkpoint`` (DCP) that load into any layout.

::

    <save>/latest_checkpointed_iteration.txt        written last (atomic replace), as in the torch format
    <save>/iter_0000010/.metadata                   DCP's global metadata: every tensor's global shape and pieces
    <save>/iter_0000010/__R_0.distcp                what rank R wrote (its pieces, deduplicated over replicas)
    <save>/iter_0000010/metadata.json               layout, model config, train config, flags (as the torch format)

Every tensor is saved under a layout-free name with its **global** (canonical) shape: the weights under
their parameter names (global layer numbers, ``decoder.layers.N.*``), the Adam moments under
``optimizer.state.exp_avg.<name>`` and ``optimizer.state.exp_avg_sq.<name>``. Each rank contributes the
pieces it holds, with their global offsets (DCP's sharded metadata, through :class:`Pieces`): a
TP-split parameter is one piece per TP rank, or one piece per section and TP rank for fused tensors
(SwiGLU's ``[gate, up]`` fc1, ``[k, v]``), so a rank's non-contiguous share of a fused tensor is written
in place. DP replicas write the same pieces, which DCP deduplicates. Loading asks, for this run's layout,
for exactly the pieces each rank needs; DCP reads their overlap with what was written, so TP, PP, DP and
virtual-PP may all change with no conversion step.

- FSDP2: each rank writes and reads only its DP shard (rows of the TP-local tensor, ``local_part``)
  of every weight and Adam moment, with its global offsets; nothing is gathered.
- The distributed optimizer's flat DP shards (which cut across parameters) are first gathered over DP
  into per-parameter TP-local tensors by its ``state_dict``; DCP's deduplication then has each piece
  written by one DP replica. Loading hands the TP-local tensors to ``load_state_dict``, which keeps
  this rank's shard.
- Vocabulary padding depends on TP: the embedding and output tables are saved with the saving run's
  padded row count. A run with other padding reads the rows both have; its extra padding rows are zero
  (their weights and Adam moments). Padding rows are never looked up and are masked out of the softmax.
- Tied embeddings across pipeline stages: only ``embedding.word_embeddings.weight`` is saved; the last
  stage's copy (``output_layer.weight``) is loaded from it, Adam moments included.
- ``common`` (rank 0): iteration, consumed samples (the data loader's position), the other counters, the
  LR scheduler, the optimizer step and hyper-parameters (and the fp16 loss scaler).
- ``rank_state.tpTT.ppPPP.dpDDD`` (each rank; DDD is its index in the DP x CP group): its RNG states and
  its gradient reducer state (Squinch error-feedback residuals, per bucket or per FSDP2 unit). They are
  restored exactly when the layout (TP, PP, virtual PP, DP, CP) is the saved one; in another layout they
  have no meaning: the residuals are dropped (one logged line; the first step runs without error
  feedback) and the RNG keeps this run's start-up seeding, as a fresh run with the same ``--seed`` (one
  logged line), as Megatron-LM does.

Which format a ``--load`` directory holds, and ``--auto-detect-ckpt-format``, are the dispatch's
(:mod:`.checkpointer`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ...core import device as device_mod
from ...core import parallel_state as ps
from ...core.distributed.contracts import ModelChunk
from ...core.models.gpt.config import GPTConfig
from ...core.models.gpt.model import WORD_EMBEDDINGS
from ...core.tensor_parallel.random import get_rng_tracker
from ..config import TrainConfig
from ..errors import safe_print
from .dcp_pieces import (
    DCP_METADATA,
    OUTPUT_WEIGHT,
    VOCAB_PARAMS,
    dcp_load,
    dcp_save,
    load_pieces,
    local_part,
    read_dcp_metadata,
    row_sharded,
    save_pieces,
)
from .file_io import CheckpointError, FileHash, payload_nbytes, write_json
from .integrity import gather_records
from .metadata import (
    FORMAT_VERSION,
    TORCH_DIST,
    check_architecture,
    check_version,
    copy_tokenizer_files,
    read_metadata,
    report_config_changes,
    run_metadata,
)
from .run_dirs import barrier, begin_save, iteration_dir, publish
from .shape_check import check_shapes, likely_flag, saved_config

FORMAT = TORCH_DIST
EXP_AVG = "optimizer.state.exp_avg."
EXP_AVG_SQ = "optimizer.state.exp_avg_sq."
COMMON = "common"
RANK_STATE = "rank_state."


# ------------------------------------------------------------------------------------ model access
def is_fsdp(model_chunks: list[ModelChunk]) -> bool:
    return model_chunks[0].data_parallel_kind == "fsdp2"


def _tied(config: GPTConfig) -> bool:
    return not config.untie_embeddings_and_output_weights


def source_name(name: str, config: GPTConfig) -> str:
    """The saved name a parameter is read from (the last stage's tied output copy reads the embeddings)."""
    return WORD_EMBEDDINGS if name == OUTPUT_WEIGHT and _tied(config) else name


def local_weights(model_chunks) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) of this rank by global name: TP-local tensors, or FSDP2's DTensors."""
    params, buffers = {}, {}
    for m in model_chunks:
        module = m.module
        names = {n for n, _ in module.named_parameters()}
        for n, p in module.named_parameters():
            params[n] = p.detach()
        for n, b in module.state_dict().items():
            if n not in names:
                buffers[n] = b.detach()
    return params, buffers


def optimizer_state(model_chunks, optimizer) -> dict:
    """``{"step", "hyper", "param_state": {name: {"exp_avg", "exp_avg_sq"}}}``: TP-local tensors (the
    distributed optimizer's flat DP shards are gathered over DP: collective), or FSDP2's DTensors."""
    if not is_fsdp(model_chunks):
        names = [{id(p): n for n, p in m.module.named_parameters()} for m in model_chunks]
        return optimizer.state_dict(names)
    opt = optimizer.optimizer
    param_state, step = {}, 0
    for m in model_chunks:
        for n, p in m.module.named_parameters():
            st = opt.state.get(p, {})
            if "exp_avg" in st:
                step = int(st["step"])
                param_state[n] = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
            else:
                zeros = torch.zeros_like(p.detach())
                param_state[n] = {"exp_avg": zeros, "exp_avg_sq": zeros}
    group = opt.param_groups[0]
    hyper = {"betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": optimizer_weight_decay(opt)}
    return {"step": step, "param_state": param_state, "hyper": hyper, **optimizer.scaler_state()}


def optimizer_weight_decay(opt) -> float:
    return max(g["weight_decay"] for g in opt.param_groups)


def rank_key(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"{RANK_STATE}tp{tp_rank:02d}.pp{pp_rank:03d}.dp{dp_rank:03d}"


def current_layout() -> dict:
    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()}


def saved_layout(meta: dict) -> dict:
    """The checkpoint's layout in :func:`current_layout`'s keys (checkpoints from before context
    parallelism have CP = 1; from before expert parallelism EP = 1 and expert TP = TP)."""
    defaults = {"context_parallel_size": 1, "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": meta.get("tensor_model_parallel_size")}
    return {k: meta.get(k, defaults.get(k)) for k in current_layout()}


def split_of(meta: dict) -> tuple[int, int, tuple[int, int]]:
    """(TP rank, TP size, (EP rank, EP size)) that place this rank's piece of a parameter with layout ``meta``:
    the expert-TP and EP ranks for MoE expert parameters, this rank's TP rank otherwise."""
    if meta.get("expert"):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()))
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), (0, 1)


def this_rank_key() -> str:
    """This rank's per-rank state key; its ``dp`` is the rank's index in the DP x CP group (the DP rank
    when CP is 1), the group whose ranks hold the same weights."""
    return rank_key(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_data_parallel_rank(with_context_parallel=True))


# ------------------------------------------------------------------------------------------- save
def build_state_dict(model_chunks, optimizer, scheduler, config: GPTConfig, state: dict, param_layout: dict, *,
                     reducer_states: list[dict] | None = None, save_optim: bool = True) -> dict[str, Any]:
    """This rank's DCP state dict (see the module docstring). Collective: every rank must call it."""
    params, buffers = local_weights(model_chunks)
    sd: dict[str, Any] = {}
    for name, t in params.items():
        if source_name(name, config) != name:
            continue  # the tied copy: saved once, as the embeddings
        local, row0 = local_part(t)
        tp_rank, tp, ep = split_of(param_layout[name])
        sd[name] = save_pieces(local, param_layout[name], tp_rank, tp, row0, ep)
    sd.update(buffers)  # replicated scalars (QAT static clamps): plain tensors, deduplicated by DCP
    common = {"checkpoint_version": FORMAT_VERSION, **state, "opt_param_scheduler": scheduler.state_dict(),
              "optimizer": None}
    if save_optim:
        optim = optimizer_state(model_chunks, optimizer)
        for name, st in optim.pop("param_state").items():
            if source_name(name, config) != name:
                continue
            tp_rank, tp, ep = split_of(param_layout[name])
            for prefix, key in ((EXP_AVG, "exp_avg"), (EXP_AVG_SQ, "exp_avg_sq")):
                local, row0 = local_part(st[key])
                sd[prefix + name] = save_pieces(local, param_layout[name], tp_rank, tp, row0, ep)
        common["optimizer"] = optim
    if ps.get_rank() == 0:
        sd[COMMON] = common
    rng = {**device_mod.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    sd[this_rank_key()] = {
        "rng": rng, "reducers": reducer_states if reducer_states and any(reducer_states) else None,
        "data_parallel_kind": "fsdp2" if is_fsdp(model_chunks) else "ddp"}
    return sd


def write_metadata(tmp: str, iteration: int, train_config: TrainConfig, param_layout: dict, dp_kind: str,
                   tokenizer_files: list[str] | None = None) -> dict[str, FileHash]:
    """metadata.json (and the tokenizer copy) of a torch_dist checkpoint; rank 0 only. Their content hashes."""
    meta = run_metadata(iteration, train_config)
    meta.update({"ckpt_format": FORMAT, "data_parallel_kind": dp_kind, "param_layout": param_layout})
    path = os.path.abspath(os.path.join(tmp, "metadata.json"))
    return {path: write_json(path, meta), **copy_tokenizer_files(tmp, tokenizer_files)}


def finish_save(root: str, iteration: int, tmp: str, records: dict[str, FileHash], overwrite: bool = False) -> str:
    """Once every rank has written: gather the content hashes to rank 0, which writes them, renames ``tmp``
    to ``iter_XXXXXXX`` and writes the tracker (collective)."""
    everyone = gather_records(records)
    if ps.get_rank() == 0:
        if not os.path.isfile(os.path.join(tmp, DCP_METADATA)):
            raise CheckpointError(f"{tmp} has no {DCP_METADATA} after the save: not publishing it")
        publish(root, iteration, everyone, overwrite=overwrite)
    barrier()
    return iteration_dir(root, iteration)


def save_dist_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, train_config: TrainConfig,
                         state: dict, param_layout: dict, *, reducer_states: list[dict] | None = None,
                         save_optim: bool = True, tokenizer_files: list[str] | None = None,
                         overwrite: bool = False) -> str:
    """Write a torch_dist checkpoint (collective); returns the iteration directory."""
    tmp = begin_save(root, iteration)
    sd = build_state_dict(model_chunks, optimizer, scheduler, train_config.model, state, param_layout,
                          reducer_states=reducer_states, save_optim=save_optim)
    records = dcp_save(sd, tmp)
    if ps.get_rank() == 0:
        records.update(write_metadata(tmp, iteration, train_config, param_layout,
                                      "fsdp2" if is_fsdp(model_chunks) else "ddp", tokenizer_files))
    return finish_save(root, iteration, tmp, records, overwrite)


# ------------------------------------------------------------------------------------------- load
@dataclass
class _Targets:
    """Zeroed TP-local tensors that the load fills, by this run's parameter name."""

    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def same_layout(meta: dict) -> bool:
    return saved_layout(meta) == current_layout()


def load_dist_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, config: GPTConfig,
                         param_layout: dict, *, load_optim: bool = True, load_rng: bool = True,
                         finetune: bool = False, reducers=None, train_config: TrainConfig | None = None) -> dict:
    """Restore a torch_dist checkpoint into this run's layout (collective); returns the saved counters."""
    path = iteration_dir(root, iteration)
    meta = read_metadata(root, iteration)
    check_version(meta, path)
    if train_config is not None and ps.get_rank() == 0:
        report_config_changes(meta, train_config, root)
    saved = read_dcp_metadata(path).state_dict_metadata
    params, buffers = local_weights(model_chunks)
    with_optim = load_optim and not finetune and any(k.startswith(EXP_AVG) for k in saved)
    if load_optim and not finetune and not with_optim and ps.get_rank() == 0:
        safe_print(f" checkpoint {path} holds no optimizer state (saved with --no-save-optim): Adam starts afresh")
    check_dist_fit(path, saved, meta, params, buffers, config, param_layout, with_optim)
    check_architecture(meta, config, path)
    tg = _Targets({}, {}, {}, {})
    sd: dict[str, Any] = {}
    for name, t in params.items():
        src = source_name(name, config)
        shape, meta_p = saved[src].size, param_layout[name]
        tp_rank, tp, ep = split_of(meta_p)
        local, row0 = local_part(t)  # under FSDP2: this rank's DP shard only, read as such
        kinds = [("", tg.params)] + ([(EXP_AVG, tg.exp_avg), (EXP_AVG_SQ, tg.exp_avg_sq)] if with_optim else [])
        for prefix, out in kinds:
            out[name] = torch.zeros(local.shape, dtype=torch.float32)
            key = prefix + src
            if key in sd:  # one rank holds both tied copies: read once, copy after
                continue
            sd[key] = load_pieces(out[name], meta_p, shape, tp_rank, tp, src, row0, ep)
    for name, b in buffers.items():
        if name in saved:
            tg.buffers[name] = sd[name] = torch.empty_like(b, device="cpu")
        elif ps.get_rank() == 0:
            safe_print(f" checkpoint {path} has no {name}: keeping this run's initial value")
    need_common = COMMON in saved
    if need_common:
        sd[COMMON] = None
    key = this_rank_key()
    layout_same = same_layout(meta)
    if layout_same and key in saved and isinstance(saved[key], BytesStorageMetadata):
        sd[key] = None
    dcp_load(sd, path)
    _copy_shared_tied(sd, tg, config)
    apply_weights(model_chunks, tg.params, tg.buffers)
    if finetune:
        return {}
    common = sd.get(COMMON) or {}
    if with_optim and common.get("optimizer") is not None:
        apply_optimizer(model_chunks, optimizer, {**common["optimizer"], "param_state": {
            n: {"exp_avg": tg.exp_avg[n], "exp_avg_sq": tg.exp_avg_sq[n]} for n in tg.exp_avg}})
    if load_optim and common.get("opt_param_scheduler") is not None:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    _restore_rank_state(sd.get(key), meta, path, load_rng, reducers, model_chunks)
    return {k: v for k, v in common.items() if k not in ("optimizer", "opt_param_scheduler")}


def check_dist_fit(path: str, saved: dict, meta: dict, params: dict, buffers: dict, config: GPTConfig,
                   param_layout: dict, with_optim: bool) -> None:
    """Collective: every global shape of the checkpoint fits this run's (the vocabulary tables' rows may differ:
    they are re-padded), or one :class:`.shape_check.CheckpointShapeError` on every rank."""
    here = {}
    for name in params:
        src, full = source_name(name, config), tuple(param_layout[name]["full_shape"])
        here[src] = full
        if with_optim:
            here[EXP_AVG + src] = here[EXP_AVG_SQ + src] = full
    here.update({n: b.shape for n, b in buffers.items() if n in saved})
    shapes = {k: v.size for k, v in saved.items() if not isinstance(v, BytesStorageMetadata)}
    check_shapes(path, shapes, here, hint=likely_flag(saved_config(meta), config),
                 rows_may_differ=lambda n: n.endswith(VOCAB_PARAMS),
                 saved_params=[n for n in meta.get("param_layout") or {} if n in shapes])


def _copy_shared_tied(sd: dict, tg: _Targets, config: GPTConfig) -> None:
    """A rank holding both the embeddings and the tied output copy read them once: copy to the second."""
    if OUTPUT_WEIGHT in tg.params and WORD_EMBEDDINGS in tg.params and _tied(config):
        for out in (tg.params, tg.exp_avg, tg.exp_avg_sq):
            if OUTPUT_WEIGHT in out:
                out[OUTPUT_WEIGHT].copy_(out[WORD_EMBEDDINGS])


def _restore_rank_state(rank_state: dict | None, meta: dict, path: str, load_rng: bool, reducers,
                        model_chunks) -> None:
    """RNG and reducer state: exactly in the saved layout, else dropped with one line (module docstring)."""
    saved = tuple(saved_layout(meta).values())
    here = tuple(current_layout().values())
    squinch_saved = bool((meta.get("args") or {}).get("squinch"))
    if rank_state is None:
        if ps.get_rank() == 0 and saved != here:
            what = "RNG state" + (" and Squinch error-feedback residuals" if squinch_saved else "")
            safe_print(f" checkpoint {path} was saved with (TP, PP, VPP, DP, CP, EP, expert TP) = {saved}, this run "
                       f"uses {here}: its per-rank {what} do not apply: not restored (the RNG keeps this run's --seed "
                       f"start-up state{'; the first step runs without residuals' if squinch_saved else ''})")
        return
    if load_rng and rank_state.get("rng"):
        device_mod.set_rng_state(rank_state["rng"])
        get_rng_tracker().set_states(rank_state["rng"]["tracker"])
    states = rank_state.get("reducers")
    if not reducers or not states:
        return
    kind = "fsdp2" if is_fsdp(model_chunks) else "ddp"
    if rank_state.get("data_parallel_kind") != kind:
        if ps.get_rank() == 0:
            safe_print(f" checkpoint {path} holds {rank_state.get('data_parallel_kind')} reducer state, this run uses "
                       f"{kind}: Squinch error-feedback residuals dropped (the first step runs without them)")
        return
    if not _uses_squinch(reducers):
        if payload_nbytes(states) and ps.get_rank() == 0:
            safe_print(f" checkpoint {path} holds Squinch error-feedback state but this run does not use --squinch: "
                       f"dropping it")
        return
    for r, s in zip(reducers, states):
        r.load_state_dict(s)


def _uses_squinch(reducers) -> bool:
    """Whether this run's reducers (DDP) or FSDP2 reduce-scatter hooks are Squinch's."""
    return any(r.carries_feedback for r in reducers)


def apply_weights(model_chunks, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Copy TP-local tensors into the model (into this rank's DP shard under FSDP2)."""
    with torch.no_grad():
        for m in model_chunks:
            module = m.module
            for n, p in module.named_parameters():
                _copy_into(p, params[n])
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def _copy_into(dst: torch.Tensor, data: torch.Tensor) -> None:
    """``dst`` takes ``data``: a tensor, or an FSDP2 DTensor and its DP shard (as :func:`local_part` gave
    it; the whole TP-local tensor for other placements)."""
    if hasattr(dst, "device_mesh") and row_sharded(dst):
        dst.to_local().copy_(data)
    elif hasattr(dst, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        full = data
        shape, offset = compute_local_shape_and_global_offset(full.shape, dst.device_mesh, dst.placements)
        part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        dst.to_local().copy_(part)
    else:
        dst.copy_(data)


def apply_optimizer(model_chunks, optimizer, state: dict) -> None:
    """Load ``{"step", "hyper", "param_state"}`` (TP-local moments) into either optimizer."""
    if not is_fsdp(model_chunks):
        names = [{id(p): n for n, p in m.module.named_parameters()} for m in model_chunks]
        optimizer.load_state_dict(state, names)
        return
    from torch.optim.optimizer import _get_scalar_dtype

    optimizer.load_scaler_state(state)
    opt = optimizer.optimizer
    for m in model_chunks:
        for n, p in m.module.named_parameters():
            st = {"step": torch.tensor(float(state["step"]), dtype=_get_scalar_dtype()),
                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            with torch.no_grad():
                _copy_into(st["exp_avg"], state["param_state"][n]["exp_avg"])
                _copy_into(st["exp_avg_sq"], state["param_state"][n]["exp_avg_sq"])
            opt.state[p] = st

"""What a checkpoint says about itself: its ``metadata.json`` (layout, model and training configuration, flags),
its format (``torch`` or ``torch_dist``), the checks a resume makes against it, and the tokenizer copy.

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

from torch import nn

from ...core import parallel_state as ps
from ...core.models.gpt.config import GPTConfig
from ..config import TokenizerConfig, TrainConfig, config_diff
from ..errors import safe_print
from .data_record import RECORD_KEY, data_fingerprints
from .dcp_pieces import DCP_METADATA
from .file_io import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    CheckpointError,
    FileHash,
    copy_hashed,
    hash_file,
    new_hasher,
    read_json,
)
from .run_dirs import iteration_dir

FORMAT_VERSION = 1
TORCH = "torch"
TORCH_DIST = "torch_dist"


def run_metadata(iteration: int, train_config: TrainConfig) -> dict:
    """The ``metadata.json`` of a checkpoint of this run (rank 0 writes it): layout, configs, flags."""
    return {"checkpoint_version": FORMAT_VERSION, "iteration": iteration,
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
            "model_config": train_config.model.to_dict(),
            "train_config": {k: v for k, v in train_config.to_dict().items() if k != "flags"},
            "args": train_config.flags,
            "tokenizer_hash": tokenizer_content_hash(train_config.tokenizer),
            RECORD_KEY: data_fingerprints(train_config.data)}  # compared on resume (data_record.check_data)


def tokenizer_content_hash(tokenizer: TokenizerConfig, algorithm: str = DEFAULT_ALGORITHM) -> str | None:
    """A content hash of the tokenizer's files (model, vocab and merge files; every file of a directory);
    None for a tokenizer without files (``NullTokenizer``, mock data)."""
    files: list[str] = []
    for path in (tokenizer.tokenizer_model, tokenizer.vocab_file, tokenizer.merge_file):
        if path and os.path.isdir(path):
            files += sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
        elif path and os.path.isfile(path):
            files.append(path)
    if not files:
        return None
    h = new_hasher(algorithm)
    for f in files:
        h.update(hash_file(f, algorithm).digest.encode())
    return f"{algorithm}:{h.hexdigest()}"


def check_tokenizer(meta: dict, tokenizer: TokenizerConfig, where: str, allowed: bool, log=safe_print) -> None:
    """The tokenizer's content hash against the one the checkpoint was saved with: a difference is an error
    unless ``allowed`` (``--finetune``, ``--allow-tokenizer-change``), then one line says so."""
    saved = meta.get("tokenizer_hash")
    if not isinstance(saved, str) or saved.split(":")[0] not in ALGORITHMS:
        return  # no hash saved (or one this installation cannot compute): nothing to compare
    here = tokenizer_content_hash(tokenizer, saved.split(":")[0])
    if here is None or saved == here:
        return
    files = ", ".join(p for p in (tokenizer.tokenizer_model, tokenizer.vocab_file, tokenizer.merge_file) if p)
    what = (f"the tokenizer ({files}) is not the one checkpoint {where} was trained with: its content hash is "
            f"{here}, the checkpoint's {saved}")
    if not allowed:
        raise CheckpointError(f"{what}; token ids would change meaning. Use the tokenizer the run was trained "
                              f"with (a copy is in {os.path.join(where, 'tokenizer')}), or pass "
                              f"--allow-tokenizer-change (or --finetune) to go on with this one")
    if ps.get_rank() == 0:
        log(f" WARNING: {what} (going on: --allow-tokenizer-change / --finetune)")


def read_metadata(root: str, iteration: int) -> dict:
    meta = read_json(os.path.join(iteration_dir(root, iteration), "metadata.json"))
    missing = [k for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "model_config")
               if k not in meta]
    if missing:
        raise CheckpointError(f"{os.path.join(iteration_dir(root, iteration), 'metadata.json')} is corrupt: it "
                              f"lacks {missing}")
    return meta


def check_version(meta: dict, where: str) -> None:
    """A format version this code reads, or an error naming it."""
    version = meta.get("checkpoint_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {where} has checkpoint_version {version!r}; this version of megatron-cai "
                              f"reads versions up to {FORMAT_VERSION}")


def check_architecture(meta: dict, config: GPTConfig, where: str) -> None:
    """The same architecture (after the shapes were compared: this catches what keeps every shape, e.g. the
    activation of a relu2 vs gelu model), or an error naming the fields that differ."""
    diff = config.architecture_diff(GPTConfig.from_dict(meta["model_config"]))
    if diff:
        raise CheckpointError(f"checkpoint {where} has a different model configuration: " + "; ".join(diff))


def report_config_changes(meta: dict, train_config: TrainConfig, root: str, log=print) -> list[tuple]:
    """Compare the checkpoint's saved TrainConfig with this run's, field by field, and log what differs.

    Returns the differences ``[(field, checkpoint value, this run's value)]`` (architecture mismatches are
    refused by :func:`check_architecture`)."""
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


def detect_format(root: str, iteration: int) -> str | None:
    """``torch_dist`` (a DCP ``.metadata``), ``torch`` (``mp_rank_*`` directories) or None."""
    d = iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(d, DCP_METADATA)):
        return TORCH_DIST
    if glob.glob(os.path.join(d, "mp_rank_*")):
        return TORCH
    return None


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


def tp_layout(modules: list[nn.Module]) -> dict[str, dict]:
    """Each parameter's TP split (``tp_dim``, ``tp_sections``) and full shape, by name, over the (unwrapped)
    model chunks: what resharding and the torch_dist format need (read before FSDP2 replaces the parameters).
    MoE expert parameters: ``"expert": True``, the global ``[num_experts, ...]`` shape and their expert-TP split."""
    out = {}
    for m in modules:
        for n, p in m.named_parameters():
            out[n] = expert_layout(p) if getattr(p, "is_expert", False) else {
                "tp_dim": getattr(p, "tp_dim", None), "tp_sections": getattr(p, "tp_sections", None),
                "full_shape": list(getattr(p, "full_shape", p.shape))}
    return out


def expert_layout(p: nn.Parameter) -> dict:
    """A stacked expert parameter's layout (``moe.experts.expert_param``): every expert along dim 0, and
    this run's expert-TP split (``tp_dim`` None at expert TP 1; swiglu's fc1 as [gate, up] sections)."""
    full = list(p.expert_global_shape)
    sections = [full[p.etp_dim] // p.etp_sections] * p.etp_sections if p.etp_dim is not None else None
    return {"tp_dim": p.etp_dim, "tp_sections": sections if p.etp_sections > 1 else None, "full_shape": full,
            "expert": True}


def copy_tokenizer_files(ckpt_dir: str, tokenizer_files: list[str] | None) -> dict[str, FileHash]:
    """Copy the tokenizer files into ``ckpt_dir/tokenizer`` (none: nothing); their content hashes by path."""
    out: dict[str, FileHash] = {}
    if not tokenizer_files:
        return out
    tok_dir = os.path.join(ckpt_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    for src in tokenizer_files:
        if src and os.path.isfile(src):
            dst = os.path.abspath(os.path.join(tok_dir, os.path.basename(src)))
            out[dst] = copy_hashed(src, dst)
    return out

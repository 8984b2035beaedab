"""Megatron-LM checkpoints, both ways: import a Megatron-LM GPT checkpoint into this project's format,
and write one of ours as a Megatron-LM checkpoint (``tools/convert_checkpoint.py --from-megatron`` /
``--to-megatron``; see docs/conversion.md).

Formats: Megatron-LM's legacy ``torch`` format (``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``,
a pickled dict with ``model`` (or ``model0``, ``model1``, ... with virtual pipeline stages), ``args``
and ``iteration``) both ways; the ``torch_dist`` format (``megatron.core.dist_checkpointing``) both
ways too, read and written with ``torch.distributed.checkpoint`` alone (:func:`read_torch_dist`,
:func:`write_torch_dist`), so megatron-core need not be installed.

Architecture mapping (megatron-core name <-> ours; tensors per TP rank on Megatron's side, full
tensors on ours, see ``training.checkpoint.reshard``):

===========================================  ===============================================================
``...self_attention.linear_qkv``             ``linear_q`` + ``linear_kv``. Megatron fuses Q, K and V *per query
                                             group*: the rows are [q heads of group 0, k_0, v_0, q heads of group
                                             1, k_1, v_1, ...], each TP rank holding whole groups. Ours keeps Q
                                             (all heads) and KV ([k of all groups; v of all groups]). GQA/MQA:
                                             heads per group = heads / query groups.
``...mlp.linear_fc1`` (SwiGLU)               [gate; up] halves *per TP rank* on Megatron's side (rank t: [gate_t;
                                             up_t]); ours: [gate (all ranks); up (all ranks)].
``...input_layernorm``, ``pre_mlp_layernorm`` the same names (local spec). The Transformer-Engine spec fuses them
                                             into the next linear: ``linear_qkv.layer_norm_weight`` /
                                             ``linear_fc1.layer_norm_weight`` (and ``_bias``); both are read.
``output_layer.weight``                      absent with tied embeddings (except as the last pipeline stage's
                                             copy, which is dropped on import and written on export).
``embedding.word_embeddings.weight``         rows padded to a multiple of ``make_vocab_size_divisible_by`` x TP.
                                             Megatron's softmax runs over all padded rows (it does not mask them),
                                             so an import keeps them as vocabulary (our ``vocab_size`` = Megatron's
                                             ``padded_vocab_size``): training continues as it would in Megatron-LM.
``*._extra_state``                           Transformer-Engine / megatron-core module state (FP8 metadata): not
                                             weights; dropped on import, written as None on export.
===========================================  ===============================================================

Not carried either way: the optimizer state (Megatron's distributed optimizer keeps flat fp32 buffers
in ``distrib_optim.pt`` whose order depends on its bucketing), the LR scheduler and the RNG states.
The iteration and the consumed-sample counters are carried, so the data loader continues where the
source stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.models.gpt.config import GPTConfig
from ..core.models.gpt.model import WORD_EMBEDDINGS, GPTModel
from ..core.mup import MupConfig
from ..core.pipeline_parallel.layer_split import PipelineSplit, stage_layer_numbers
from ..training.checkpoint import (
    OUTPUT_WEIGHT,
    TRACKER,
    CanonicalCheckpoint,
    CheckpointTrust,
    ConversionError,
    Layout,
    SafeFileSystemReader,
    check_shapes,
    checkpoint_trust,
    current_trust,
    fit_vocab_rows,
    iteration_dir,
    load_canonical,
    rank_dir_name,
    save_resharded,
    save_torch,
    target_layout,
    write_text,
)
from ..training.tokenizer import vocab_size_with_padding
from .megatron_moe import (
    is_megatron_moe_tensor,
    is_moe_tensor,
    megatron_moe_args,
    megatron_moe_flags,
    moe_config_from_megatron_args,
    moe_from_megatron,
    moe_to_megatron,
)

SPECS = ("local", "transformer_engine")
CHECKPOINT_VERSION = 3.0  # what Megatron-LM's legacy save writes
# Megatron-side TP split dimension by name suffix (everything else is replicated over TP)
_TP_DIM = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "linear_qkv.weight": 0,
           "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0, "linear_proj.weight": 1,
           "linear_fc2.weight": 1}
# Transformer-Engine spec: the norms live inside the following linear
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
             "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


# ---------------------------------------------------------------------------------------- config
def _get(source: Any, name: str, default=None):
    """A field of Megatron-LM's saved ``args`` (an argparse.Namespace, or a dict)."""
    if isinstance(source, dict):
        return source.get(name, default)
    return getattr(source, name, default)


def config_from_megatron_args(args: Any) -> GPTConfig:
    """Our GPTConfig from a Megatron-LM checkpoint's ``args`` (a Namespace or dict). Options this
    codebase cannot represent exactly are refused, each by its Megatron-LM flag."""
    why = []
    refuse = {"multi_latent_attention": "--multi-latent-attention",
              "rotary_interleaved": "--rotary-interleaved",
              "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
              "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
              "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
              "quick_geglu": "--quick-geglu", "mtp_num_layers": "--mtp-num-layers",
              "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
              "hybrid_layer_pattern": "--hybrid-layer-pattern", "qk_l2_norm": "--qk-l2-norm",
              "window_size": "--window-size"}
    for name, flag in refuse.items():
        if _get(args, name):
            why.append(f"{flag} is not supported")
    pe = _get(args, "position_embedding_type", "learned_absolute")
    if pe not in ("learned_absolute", "rope", "none"):
        why.append(f"--position-embedding-type {pe} is not supported")
    if pe == "rope" and _get(args, "seq_len_interpolation_factor"):
        why.append("--rotary-seq-len-interpolation-factor is not supported")
    bias = bool(_get(args, "add_bias_linear", True))
    if _get(args, "swiglu"):
        activation = "swiglu"
    elif _get(args, "squared_relu"):
        activation = "relu2"
    else:  # megatron-core's MLP runs F.gelu (erf) unless the bias-GeLU fusion is on, which is the tanh GeLU
        activation = "gelu_tanh" if bias and _get(args, "bias_gelu_fusion", True) else "gelu_erf"
    norm = _get(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        why.append(f"--normalization {norm} is not supported")
    padded = _get(args, "padded_vocab_size")
    if padded is None:
        why.append("args.padded_vocab_size is missing")
    moe = moe_config_from_megatron_args(lambda name: _get(args, name), why)
    if why:
        raise ConversionError("this Megatron-LM checkpoint cannot be represented: " + "; ".join(why))
    heads = _get(args, "num_attention_heads")
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention") else heads
    seq = _get(args, "seq_length") or _get(args, "max_position_embeddings")
    return GPTConfig(
        num_layers=_get(args, "num_layers"), hidden_size=_get(args, "hidden_size"), num_attention_heads=heads,
        vocab_size=padded, padded_vocab_size=padded, ffn_hidden_size=_get(args, "ffn_hidden_size"),
        num_query_groups=groups or heads, kv_channels=_get(args, "kv_channels"), seq_length=seq,
        max_position_embeddings=_get(args, "max_position_embeddings") or seq, position_embedding_type=pe,
        rotary_base=float(_get(args, "rotary_base", 10000) or 10000),
        rotary_percent=float(_get(args, "rotary_percent", 1.0) or 1.0),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        rope_scaling=bool(_get(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(_get(args, "rope_scaling_factor", 8.0) or 8.0),
        add_qkv_bias=bool(_get(args, "add_qkv_bias", bias)) and not bias,
        apply_layernorm_1p=bool(_get(args, "apply_layernorm_1p", False) or _get(args, "layernorm_zero_centered_gamma")),
        normalization=norm,
        layernorm_epsilon=float(_get(args, "layernorm_epsilon", _get(args, "norm_epsilon", 1e-5))),
        activation=activation,
        untie_embeddings_and_output_weights=bool(_get(args, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bias, hidden_dropout=float(_get(args, "hidden_dropout", 0.1)),
        attention_dropout=float(_get(args, "attention_dropout", 0.1)),
        init_method_std=float(_get(args, "init_method_std", 0.02)), moe=moe,
        mup=MupConfig(bool(_get(args, "use_mup", False)), _get(args, "mup_base_hidden_size"),
                      float(_get(args, "mup_embedding_mult", 1.0)), float(_get(args, "mup_output_mult", 1.0)),
                      _get(args, "mup_base_head_dim"), float(_get(args, "mup_attn_scale_power", 1.0))))


def megatron_args(config: GPTConfig, *, tp: int, pp: int, padded_vocab_size: int, divisible: int,
                  iteration: int, counters: dict, spec: str = "local", ckpt_format: str = "torch",
                  tokenizer_type: str | None = None) -> argparse.Namespace:
    """The ``args`` a Megatron-LM checkpoint of ``config`` carries: what ``--use-checkpoint-args`` and
    Megatron-LM's ``check_checkpoint_args`` read (model shape, layout, vocabulary padding, counters)."""
    c = config
    if c.activation == "gelu_tanh" and not c.add_bias_linear:
        raise ConversionError("a tanh-GeLU model without biases has no Megatron-LM equivalent: megatron-core runs "
                              "the tanh GeLU only in its bias-GeLU fusion")
    if c.window_size is not None:
        raise ConversionError(f"sliding-window attention (window_size={c.window_size}) is not written to Megatron-LM")
    if c.attention_output_gate or c.rotary_interleaved:
        raise ConversionError("--attention-output-gate and --rotary-interleaved models are not converted to "
                              "Megatron-LM yet (its linear_qkv packs the gate after each group's query heads)")
    if c.kv_share_pattern is not None:
        raise ConversionError("cross-layer KV sharing (--kv-share-pattern) has no Megatron-LM equivalent")
    if c.moe is not None and (spec != "local" or ckpt_format != "torch"):
        raise ConversionError(f"an MoE model is written to Megatron-LM in the torch format with the local spec only "
                              f"(got --ckpt-format {ckpt_format}, spec {spec}: megatron-core's sharded expert keys "
                              f"and its Transformer-Engine MoE layer are not written here)")
    return argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, kv_channels=c.kv_channels,
        group_query_attention=c.num_query_groups != c.num_attention_heads, num_query_groups=c.num_query_groups,
        seq_length=c.seq_length, max_position_embeddings=c.max_position_embeddings,
        position_embedding_type=c.position_embedding_type,
        add_position_embedding=True,  # Megatron-LM's default whatever the type (--no-position-embedding is deprecated)
        use_rotary_position_embeddings=c.position_embedding_type == "rope", rotary_base=int(c.rotary_base)
        if float(c.rotary_base).is_integer() else c.rotary_base, rotary_percent=c.rotary_percent,
        rotary_interleaved=False, normalization=c.normalization, layernorm_epsilon=c.layernorm_epsilon,
        norm_epsilon=c.layernorm_epsilon,
        apply_layernorm_1p=c.apply_layernorm_1p, layernorm_zero_centered_gamma=c.apply_layernorm_1p,
        qk_layernorm=c.qk_layernorm, swiglu=c.activation == "swiglu",
        squared_relu=c.activation == "relu2", bias_gelu_fusion=c.activation == "gelu_tanh", bias_swiglu_fusion=True,
        add_bias_linear=c.add_bias_linear, add_qkv_bias=c.qkv_bias, use_rope_scaling=c.rope_scaling,
        rope_scaling_factor=c.rope_scaling_factor,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        apply_query_key_layer_scaling=False, hidden_dropout=c.hidden_dropout, attention_dropout=c.attention_dropout,
        init_method_std=c.init_method_std, padded_vocab_size=padded_vocab_size, make_vocab_size_divisible_by=divisible,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, transformer_impl=spec, ckpt_format=ckpt_format,
        params_dtype=torch.float32, tokenizer_type=tokenizer_type, **megatron_moe_args(c),
        use_mup=c.mup.enabled, mup_base_hidden_size=c.mup.base_hidden_size, mup_embedding_mult=c.mup.embedding_mult,
        mup_output_mult=c.mup.output_mult, mup_base_head_dim=c.mup.base_head_dim,
        mup_attn_scale_power=c.mup.attn_scale_power,
        data_parallel_random_init=False,
        iteration=iteration, consumed_train_samples=int(counters.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(counters.get("consumed_valid_samples", 0)))


# -------------------------------------------------------------------------------- tensor mapping
def _suffix_dim(name: str) -> int | None:
    for suffix, dim in _TP_DIM.items():
        if name.endswith(suffix):
            return dim
    return None


def _qkv_to_ours(shards: list[torch.Tensor], c: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's per-group interleaved [q_g heads, k_g, v_g] rows (TP shards) -> (linear_q, linear_kv)."""
    d, per_group = c.kv_channels, c.num_attention_heads // c.num_query_groups
    full = torch.cat(shards, 0)  # TP ranks hold whole groups, in order
    grouped = full.reshape(c.num_query_groups, (per_group + 2) * d, *full.shape[1:])
    q = grouped[:, : per_group * d].reshape(-1, *full.shape[1:])
    k = grouped[:, per_group * d: (per_group + 1) * d].reshape(-1, *full.shape[1:])
    v = grouped[:, (per_group + 1) * d:].reshape(-1, *full.shape[1:])
    return q, torch.cat([k, v], 0)


def _qkv_to_megatron(q: torch.Tensor, kv: torch.Tensor, c: GPTConfig, tp: int) -> list[torch.Tensor]:
    d, per_group, groups = c.kv_channels, c.num_attention_heads // c.num_query_groups, c.num_query_groups
    rest = q.shape[1:]
    k, v = kv.chunk(2, 0)
    fused = torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], 1).reshape(-1, *rest)
    return list(fused.chunk(tp, 0))


def _fc1_to_ours(shards: list[torch.Tensor]) -> torch.Tensor:
    """SwiGLU: each TP rank's [gate_t; up_t] -> [gate_0 .. gate_T; up_0 .. up_T]."""
    halves = [s.chunk(2, 0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)


def _fc1_to_megatron(fc1: torch.Tensor, tp: int) -> list[torch.Tensor]:
    gate, up = fc1.chunk(2, 0)
    return [torch.cat([g, u], 0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]


def from_megatron_state_dict(config: GPTConfig, shards: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Our full tensors from Megatron-LM tensors (global names, one entry per TP rank).

    Accepts the local spec's and the Transformer-Engine spec's names; ``_extra_state`` entries and the
    last pipeline stage's copy of tied embeddings are dropped."""
    c, out, moe = config, {}, {}
    tied = not c.untie_embeddings_and_output_weights
    for name, ts in shards.items():
        if name.endswith("._extra_state") or (tied and name == OUTPUT_WEIGHT):
            continue
        if is_megatron_moe_tensor(name):
            moe[name] = ts
            continue
        for te, ours in _TE_NORMS.items():
            if te in name:
                name = name.replace(te, ours)
        if name.endswith("self_attention.linear_qkv.weight") or name.endswith("self_attention.linear_qkv.bias"):
            base, suffix = name.rsplit(".linear_qkv.", 1)
            out[f"{base}.linear_q.{suffix}"], out[f"{base}.linear_kv.{suffix}"] = _qkv_to_ours(ts, c)
        elif c.activation == "swiglu" and ".mlp.linear_fc1." in name:
            out[name] = _fc1_to_ours(ts)
        else:
            dim = _suffix_dim(name)
            out[name] = torch.cat(ts, dim) if dim is not None and len(ts) > 1 else ts[0]
    out.update(moe_from_megatron(moe, c, _fc1_to_ours))
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def to_megatron_state_dict(config: GPTConfig, model: dict[str, torch.Tensor], tp: int,
                           spec: str = "local") -> list[dict[str, Any]]:
    """Megatron-LM state dicts (global layer numbers, whole model) for each of ``tp`` ranks, from our full
    tensors (vocabulary rows already padded for Megatron). ``spec``: ``local`` or ``transformer_engine``."""
    if spec not in SPECS:
        raise ConversionError(f"unknown megatron-core layer spec {spec!r}; choose one of {SPECS}")
    c = config
    ranks: list[dict[str, Any]] = [{} for _ in range(tp)]

    def put(name: str, tensors: list[torch.Tensor]) -> None:
        for t in range(tp):
            ranks[t][name] = tensors[t].contiguous().clone()

    for name, full in model.items():
        if ".self_attention.linear_kv." in name:
            continue  # written with linear_q
        if ".self_attention.linear_q." in name:
            base, suffix = name.rsplit(".linear_q.", 1)
            put(f"{base}.linear_qkv.{suffix}", _qkv_to_megatron(full, model[f"{base}.linear_kv.{suffix}"], c, tp))
            continue
        if is_moe_tensor(name):
            for theirs, parts in moe_to_megatron(name, full, c, tp, _fc1_to_megatron).items():
                put(theirs, parts)
            continue
        if c.activation == "swiglu" and ".mlp.linear_fc1." in name:
            put(name, _fc1_to_megatron(full, tp))
            continue
        dim = _suffix_dim(name)
        put(name, list(full.chunk(tp, dim)) if dim is not None else [full] * tp)
    if spec == "transformer_engine":
        for r in ranks:
            for name in list(r):
                for te, ours in _TE_NORMS.items():
                    if "." + ours in name:
                        r[name.replace(ours, te)] = r.pop(name)
    extra = [n.rsplit(".", 1)[0] + "._extra_state" for n in ranks[0]
             if n.endswith(".weight") and _is_linear(n)]
    if spec == "transformer_engine":
        extra += [f"decoder.layers.{i}.self_attention.core_attention._extra_state" for i in range(c.num_layers)]
    for r in ranks:
        r.update({n: None for n in extra})
    return ranks


def _is_linear(name: str) -> bool:
    return any(f".{m}." in name or name.startswith(f"{m}.") for m in
               ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"))


# ------------------------------------------------------------------------------------ legacy files
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


@dataclass
class MegatronCheckpoint:
    """A Megatron-LM checkpoint read into global names (per TP rank)."""

    args: Any
    iteration: int
    tp: int
    pp: int
    shards: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    ckpt_format: str = "torch"


def read_tracker_or_step(root: str, step: int | None) -> tuple[str, int]:
    """The iteration directory and number (``release`` is iteration 0)."""
    if step is not None:
        return iteration_dir(root, step), step
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        raise ConversionError(f"{path} is missing: not a Megatron-LM checkpoint directory (or pass --ckpt-step)")
    text = open(path).read().strip()
    if text == "release":
        return os.path.join(root, "release"), 0
    try:
        return iteration_dir(root, int(text)), int(text)
    except ValueError:
        raise ConversionError(f"{path} holds {text!r}, not an iteration number") from None


def _load_pickle(path, trust_pickle: bool, what: str | None = None) -> Any:
    """A Megatron-LM rank file: ``weights_only`` with Megatron's own safe classes (argparse.Namespace for
    ``args``, and megatron-core's enums when it is installed); arbitrary pickles only with ``trust_pickle``."""
    safe = [argparse.Namespace]
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS

        safe += list(SAFE_GLOBALS)
    except Exception:  # noqa: BLE001 - megatron-core is optional
        pass
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        if hasattr(path, "seek"):
            path.seek(0)
        if not trust_pickle:
            raise ConversionError(f"{what or path}: cannot be read as weights only ({str(e).splitlines()[0]}); if you "
                                  "trust this file, pass --megatron-trust-pickle") from None
    return torch.load(path, map_location="cpu", weights_only=False)


def read_megatron_checkpoint(root: str, step: int | None = None, *, trust_pickle: bool = False) -> MegatronCheckpoint:
    """Read a Megatron-LM checkpoint in the ``torch`` (legacy) or ``torch_dist`` format."""
    it_dir, iteration = read_tracker_or_step(root, step)
    if not os.path.isdir(it_dir):
        raise ConversionError(f"{it_dir} is missing")
    if os.path.exists(os.path.join(it_dir, ".metadata")):
        trust = current_trust()  # --megatron-trust-pickle also admits DCP metadata that is not plain data
        with checkpoint_trust(CheckpointTrust(trust.trust_code or trust_pickle, trust.allow_unverified,
                                              trust.signing_key), log=lambda *_: None):
            return read_torch_dist(it_dir, iteration, trust_pickle=trust_pickle)
    ranks = {}
    for d in sorted(os.listdir(it_dir)):
        m = _RANK_DIR.match(d)
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(it_dir, d, "model_optim_rng.pt")
    if not ranks:
        raise ConversionError(f"{it_dir} has no mp_rank_* directories and no .metadata: not a Megatron-LM checkpoint")
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in ranks or not os.path.exists(ranks[(t, p)])]
    if missing:
        raise ConversionError(f"{it_dir}: incomplete checkpoint, missing {missing[:4]} (TP={tp}, PP={pp})")
    shards: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    args = None
    for (t, p), path in sorted(ranks.items()):
        payload = _load_pickle(path, trust_pickle)
        if "args" not in payload or not any(k == "model" or re.fullmatch(r"model\d+", k) for k in payload):
            raise ConversionError(f"{path} has no 'args' or 'model': not a Megatron-LM model checkpoint")
        args = payload["args"] if args is None else args
        num_layers = _get(args, "num_layers")
        chunks = sorted((k for k in payload if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        vpp = len(chunks) if len(chunks) > 1 else None
        for v, key in enumerate(chunks):
            layers = stage_layer_numbers(num_layers, p, pp, v, vpp, _pipeline_split(args))
            for name, tensor in payload[key].items():
                shards[_global_name(name, layers)][t] = tensor
        if (_get(args, "tensor_model_parallel_size", tp), _get(args, "pipeline_model_parallel_size", pp)) != (tp, pp):
            raise ConversionError(f"{path}: args say TP={_get(args, 'tensor_model_parallel_size')}, "
                                  f"PP={_get(args, 'pipeline_model_parallel_size')} but the directory holds "
                                  f"TP={tp}, PP={pp}")
    iteration = int(payload.get("iteration", iteration))
    out = {}
    for name, by_rank in shards.items():
        gaps = [t for t in range(tp) if t not in by_rank]
        if gaps:
            raise ConversionError(f"{name} is missing on tensor-parallel ranks {gaps}")
        out[name] = [by_rank[t] for t in range(tp)]
    return MegatronCheckpoint(args=args, iteration=iteration, tp=tp, pp=pp, shards=out)


def _pipeline_split(args) -> PipelineSplit:
    """The checkpoint's uneven pipeline split (Megatron-LM's args; even when they say nothing)."""
    return PipelineSplit(_get(args, "decoder_first_pipeline_num_layers"),
                         _get(args, "decoder_last_pipeline_num_layers"),
                         bool(_get(args, "account_for_embedding_in_pipeline_split", False)),
                         bool(_get(args, "account_for_loss_in_pipeline_split", False)))


def _global_name(name: str, layers: list[int]) -> str:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name
    return f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}"


def _local_name(name: str, first_layer: int) -> str:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) - first_layer}.{m.group(2)}"


_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_TORCH_DIST_META = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
_COMMON_KEY = "common_state/shard_0_1"  # megatron-core's ShardedObject of the non-tensor state


def _safe_planner(trust_pickle: bool):
    """A DCP load planner whose byte objects (megatron-core's common state) load as weights only."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = _load_pickle(value, trust_pickle, "common_state")

    return Planner(flatten_state_dict=False)


def read_torch_dist(it_dir: str, iteration: int, *, trust_pickle: bool = False) -> MegatronCheckpoint:
    """A ``torch_dist`` checkpoint (megatron.core.dist_checkpointing), read with
    ``torch.distributed.checkpoint`` alone (megatron-core is not needed): DCP shards of *global* tensors
    as megatron-core's ``sharded_state_dict`` declares them, plus the common state (``args``,
    ``iteration``) as a byte object ``common_state`` (or a legacy ``common.pt``). Optimizer and RNG
    entries are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeFileSystemReader(it_dir)  # DCP's .metadata through the restricted unpickler
    md = reader.read_metadata().state_dict_metadata
    legacy_common = os.path.join(it_dir, "common.pt")
    if os.path.exists(legacy_common):
        common = _load_pickle(legacy_common, trust_pickle)
    elif _COMMON_KEY in md:
        state: dict[str, Any] = {_COMMON_KEY: None}
        dcp.load(state, storage_reader=reader, planner=_safe_planner(trust_pickle), no_dist=True)
        common = state[_COMMON_KEY]
        common = common[0] if isinstance(common, list) and common else common  # megatron-core wraps it in a list
    else:
        raise ConversionError(f"{it_dir}: no common state (common.pt or {_COMMON_KEY}): not a megatron-core "
                              "torch_dist checkpoint")
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        raise ConversionError(f"{it_dir}: the common state has no 'args'")
    wanted = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
              if isinstance(v, TensorStorageMetadata) and k.startswith(("embedding.", "decoder.", "output_layer."))}
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    shards: dict[str, list[torch.Tensor]] = {}
    for key, tensor in wanted.items():
        m = re.match(r"^decoder\.layers\.(?!\d)(.*)$", key)
        if m:  # layers stacked along a leading dimension
            shards.update({f"decoder.layers.{i}.{m.group(1)}": [tensor[i]] for i in range(tensor.shape[0])})
        else:
            shards[key] = [tensor]
    return MegatronCheckpoint(args=args, iteration=int(common.get("iteration", iteration)), tp=1, pp=1,
                              shards=shards, ckpt_format="torch_dist")


def write_torch_dist(it_dir: str, config: GPTConfig, full: dict[str, Any], common: dict, spec: str) -> None:
    """Write a megatron-core ``torch_dist`` checkpoint with ``torch.distributed.checkpoint`` (one writer):
    the global tensors under megatron-core's ``sharded_state_dict`` keys (norms under the fused names,
    layers stacked along a leading dimension, SwiGLU's fc1 as [gate; up] over the whole ffn dimension,
    i.e. the TP = 1 tensors), the modules' ``_extra_state`` objects per layer, the common state and
    ``metadata.json``. ``full``: a TP = 1 megatron state dict (:func:`to_megatron_state_dict`)."""
    import torch.distributed.checkpoint as dcp

    L = config.num_layers
    state: dict[str, Any] = {}
    per_layer: dict[str, list] = defaultdict(lambda: [None] * L)
    for name, value in full.items():
        if name.endswith("._extra_state"):
            continue
        for te, ours in _TE_NORMS.items():
            name = name.replace("." + ours, "." + te)  # megatron-core's sharded keys: the fused names
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if m:
            per_layer[m.group(2)][int(m.group(1))] = value
        else:
            state[name] = value
    for suffix, layers in per_layer.items():
        state[f"decoder.layers.{suffix}"] = torch.stack(layers)
    linears = _LINEARS + (("self_attention.core_attention",) if spec == "transformer_engine" else ())
    for module in linears:
        for i in range(L):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{L}"] = [None]
    state[_COMMON_KEY] = [common]  # megatron-core stores a ShardedObject as torch.save([data, ...])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(it_dir), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))  # keys exactly as megatron-core's
    write_text(os.path.join(it_dir, "metadata.json"), json.dumps(_TORCH_DIST_META))


# ------------------------------------------------------------------------------------------ import
def import_from_megatron(root: str, save: str, *, tp: int | None = None, pp: int | None = None,
                         vp_layers: int | None = None, step: int | None = None, trust_pickle: bool = False,
                         log=print) -> str:
    """Write the Megatron-LM checkpoint in ``root`` as ours in ``save`` (weights, iteration, counters)."""
    mck = read_megatron_checkpoint(root, step, trust_pickle=trust_pickle)
    config = config_from_megatron_args(mck.args)
    model = from_megatron_state_dict(config, mck.shards)
    check_shapes(root, {k: v.shape for k, v in model.items()}, _our_shapes(config), saved_params=model,
                 hint="; the Megatron-LM weights do not match the architecture in its args", collective=False,
                 error=ConversionError)
    divisible = int(_get(mck.args, "make_vocab_size_divisible_by", 128) or 128)
    from .hf import param_layout, pretrain_flags

    counters = {"iteration": mck.iteration, "skipped_iterations": 0,
                "consumed_train_samples": int(_get(mck.args, "consumed_train_samples", 0) or 0),
                "consumed_valid_samples": int(_get(mck.args, "consumed_valid_samples", 0) or 0)}
    args = {"make_vocab_size_divisible_by": divisible, "pretrain_flags": pretrain_flags(config),
            "tokenizer_type": _get(mck.args, "tokenizer_type"), "tokenizer_model": _get(mck.args, "tokenizer_model"),
            "seq_length": config.seq_length}
    ck = CanonicalCheckpoint(config=config, iteration=mck.iteration, model=model, layout_meta=param_layout(config),
                             counters=counters, args=args, source=Layout(mck.tp, mck.pp, None, None),
                             notes=[f"imported from Megatron-LM ({mck.ckpt_format}) {root}"])
    if mck.ckpt_format == "torch_dist":  # global tensors: default to the layout it was trained with
        src_tp = int(_get(mck.args, "tensor_model_parallel_size", 1) or 1)
        src_pp = int(_get(mck.args, "pipeline_model_parallel_size", 1) or 1)
    else:
        src_tp, src_pp = mck.tp, mck.pp
    if config.moe is not None and (tp or src_tp) > 1:
        raise ConversionError(f"{root}: an MoE model is imported at --target-tensor-parallel-size 1 only here (the "
                              f"source has TP={src_tp}); resume at other layouts with --ckpt-format torch_dist")
    target = target_layout(config, tp or src_tp, pp or src_pp, vp_layers)
    out = save_resharded(ck, save, target, make_vocab_size_divisible_by=divisible, with_optimizer=False, log=log)
    log(f" imported Megatron-LM iteration {mck.iteration} ({mck.ckpt_format}, TP={mck.tp}, PP={mck.pp}) into {out} "
        f"at (TP, PP) = ({target.tp}, {target.pp}); vocabulary {config.vocab_size} (Megatron's padded rows); "
        f"optimizer state not carried. Continue with\n   pretrain_gpt.py --load {save} --no-load-optim "
        f"--no-load-rng {' '.join(args['pretrain_flags'])} --vocab-size {config.vocab_size} "
        f"--make-vocab-size-divisible-by {divisible} ...")
    return out


def _our_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """The parameters' full shapes, and the MoE routers' expert bias (a buffer megatron-core keeps too)."""
    from .hf import param_layout

    with torch.device("meta"):
        state = GPTModel(config).state_dict()
    names = set(param_layout(config)) | {n for n in state if n.endswith(".mlp.router.expert_bias")}
    return {n: state[n].shape for n in names}


# ------------------------------------------------------------------------------------------ export
def export_to_megatron(load: str, save: str, *, tp: int | None = None, pp: int | None = None,
                       step: int | None = None, spec: str = "local", make_vocab_size_divisible_by: int | None = None,
                       ckpt_format: str = "torch", log=print) -> str:
    """Write our checkpoint in ``load`` as a Megatron-LM checkpoint in ``save``: ``torch`` (legacy
    ``mp_rank_*`` files for TP x PP ranks; megatron-core's GPTModel loads each rank's ``model``) or
    ``torch_dist`` (global tensors; megatron-core's ``dist_checkpointing.load`` reads them into any
    layout; TP sets the vocabulary padding recorded in ``args``)."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise ConversionError(f"unknown Megatron-LM checkpoint format {ckpt_format!r} (torch or torch_dist)")
    ck = load_canonical(load, step, load_optimizer=False)
    c = ck.config
    tp = tp or ck.source.tp
    pp = pp or ck.source.pp
    target_layout(c, tp, pp)  # the same divisibility rules
    if c.num_query_groups % tp:
        raise ConversionError(f"Megatron-LM needs the query groups ({c.num_query_groups}) divisible by TP={tp}")
    divisible = make_vocab_size_divisible_by or int(ck.args.get("make_vocab_size_divisible_by") or 128)
    padded = vocab_size_with_padding(c.vocab_size, divisible, tp)
    # parameters (no QAT buffers), and the MoE routers' expert bias (a buffer megatron-core keeps too)
    model = {n: t for n, t in ck.model.items() if n in ck.layout_meta or n.endswith(".mlp.router.expert_bias")}
    for name in (WORD_EMBEDDINGS, OUTPUT_WEIGHT):
        if name in model:
            model[name] = fit_vocab_rows(model[name][: c.vocab_size], padded)
    args = megatron_args(c, tp=tp, pp=pp, padded_vocab_size=padded, divisible=divisible, iteration=ck.iteration,
                         counters=ck.counters, spec=spec, ckpt_format=ckpt_format,
                         tokenizer_type=ck.args.get("tokenizer_type"))
    final = iteration_dir(save, ck.iteration)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if ckpt_format == "torch_dist":
        common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": ck.iteration,
                  "num_floating_point_operations_so_far": 0}
        write_torch_dist(tmp, c, to_megatron_state_dict(c, model, 1, spec)[0], common, spec)
        return _publish(tmp, final, save, ck.iteration, log,
                        f"a Megatron-LM torch_dist checkpoint ({spec} spec, padded vocabulary {padded})",
                        megatron_load_flags(c, spec, ckpt_format))
    ranks = to_megatron_state_dict(c, model, tp, spec)
    tied = not c.untie_embeddings_and_output_weights
    for t in range(tp):
        for p in range(pp):
            layers = stage_layer_numbers(c.num_layers, p, pp)
            sd = {}
            for name, value in ranks[t].items():
                layer = re.match(r"^decoder\.layers\.(\d+)\.", name)
                if layer:
                    keep = int(layer.group(1)) in layers
                elif name.startswith("embedding."):
                    keep = p == 0
                else:  # final norm, output layer
                    keep = p == pp - 1
                if keep:
                    sd[_local_name(name, layers[0])] = value
            if tied and pp > 1 and p == pp - 1:
                sd[OUTPUT_WEIGHT] = ranks[t][WORD_EMBEDDINGS]  # megatron-core's last-stage copy
                sd["output_layer._extra_state"] = None
            payload = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": ck.iteration,
                       "model": sd, "num_floating_point_operations_so_far": 0}
            rdir = os.path.join(tmp, rank_dir_name(t, p, pp))
            os.makedirs(rdir, exist_ok=True)
            save_torch(payload, os.path.join(rdir, "model_optim_rng.pt"))
    return _publish(tmp, final, save, ck.iteration, log,
                    f"a Megatron-LM torch checkpoint ({spec} spec, TP={tp}, PP={pp}, padded vocabulary {padded})",
                    megatron_load_flags(c, spec, ckpt_format))


def megatron_load_flags(config: GPTConfig, spec: str, ckpt_format: str) -> list[str]:
    """What Megatron-LM's ``pretrain_gpt.py`` needs besides ``--load DIR --use-checkpoint-args`` to rebuild this
    model: the options that its ``load_args_from_checkpoint`` does not restore from the checkpoint's args
    (megatron-core 0.19.2 restores the sizes, positions, RoPE base and percent, biases, SwiGLU / squared ReLU,
    untied embeddings, the norm type and dropouts), and the format and layer implementation."""
    c = config
    flags = ["--no-load-optim", "--no-load-rng", "--use-checkpoint-args", "--ckpt-format", ckpt_format]
    if spec == "local":
        flags += ["--transformer-impl", "local"]
    if c.qk_layernorm:
        flags.append("--qk-layernorm")
    if c.apply_layernorm_1p:  # 0.19.2 restores args.apply_layernorm_1p, no longer the flag's destination
        flags.append("--apply-layernorm-1p")
    if c.layernorm_epsilon != 1e-5:
        flags += ["--norm-epsilon", repr(c.layernorm_epsilon)]
    if c.activation in ("gelu_erf", "relu2") and c.add_bias_linear:  # (without biases the fusion is turned off)
        flags.append("--no-bias-gelu-fusion")  # its fused kernel is the tanh GeLU, and refuses squared ReLU
    if c.rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(c.rope_scaling_factor)]
    return flags + megatron_moe_flags(c.moe)


def _publish(tmp: str, final: str, save: str, iteration: int, log, what: str, flags: list[str]) -> str:
    if os.path.exists(final):  # only with --overwrite (tools/convert_checkpoint.py checks --save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text(os.path.join(save, TRACKER), str(iteration), fsync=True)
    log(f" wrote iteration {iteration} as {what} to {final}; continue in Megatron-LM with\n"
        f"   pretrain_gpt.py --load {save} {' '.join(flags)} ...")
    return final


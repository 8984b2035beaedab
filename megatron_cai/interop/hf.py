"""Hugging Face interop: export a checkpoint of any layout to a ``transformers`` model directory, and
initialise a training checkpoint from one.

Architectures (``choose_architecture`` picks the first that represents the model exactly):

=============  =======================================================================================
``llama``      LlamaForCausalLM: RMSNorm, SwiGLU, RoPE, GQA/MQA, tied or untied; biases on all linear
               layers or none (``attention_bias`` = ``mlp_bias``).
``gpt2``       GPT2LMHeadModel: LayerNorm, tanh GeLU, learned positions, head_dim x heads = hidden; GPT-2
               has biases (zeros when the model has none) and no GQA (KV heads are repeated). Its Conv1D
               weights are stored transposed ([in, out]).
``nemotron``   NemotronForCausalLM: LayerNorm (stored as ``LayerNorm1P``: weight - 1), squared ReLU, RoPE
               on the whole head (``partial_rotary_factor`` 1.0), GQA/MQA, tied or untied, biases.
``megatron_cai``  anything else (e.g. RMSNorm + squared ReLU, sliding windows): the model class in
               ``hf_remote/`` is copied into the export; load it with ``trust_remote_code=True``.
=============  =======================================================================================

Padded vocabulary rows are trimmed on export. Quantization-aware training (``--qat``) is not part of
any export: the weights are exported in high precision and the fake quantization is not applied.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from ..core.models.gpt.config import LEGACY_ACTIVATIONS, GPTConfig
from ..core.models.gpt.model import WORD_EMBEDDINGS, GPTModel
from ..core.transformer.rope import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
from ..training.checkpoint import (
    OUTPUT_WEIGHT,
    CanonicalCheckpoint,
    CheckpointError,
    ConversionError,
    Layout,
    load_canonical,
    load_weights,
    save_resharded,
    target_layout,
)
from .megatron_moe import moe_pretrain_flags

ARCHITECTURES = ("llama", "gpt2", "nemotron", "megatron_cai")
HF_CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "nemotron": "NemotronForCausalLM",
              "megatron_cai": "MegatronCaiForCausalLM"}
REMOTE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_remote")
REMOTE_FILES = ("configuration_megatron_cai.py", "modeling_megatron_cai.py")


# ---------------------------------------------------------------------------------- architecture
def unsupported_reasons(config: GPTConfig, arch: str) -> list[str]:
    """Why ``arch`` cannot represent ``config`` exactly (empty: it can)."""
    c, why = config, []
    need = {"llama": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope"},
            "gpt2": {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute"},
            "nemotron": {"normalization": "LayerNorm", "activation": "relu2", "position_embedding_type": "rope"},
            "megatron_cai": {}}
    if arch not in need:
        raise ConversionError(f"unknown Hugging Face architecture {arch!r}; choose one of {ARCHITECTURES} or auto")
    for field_name, value in need[arch].items():
        if getattr(c, field_name) != value:
            why.append(f"{arch} needs {field_name}={value}, the model has {getattr(c, field_name)}")
    if arch == "gpt2" and c.activation not in ("gelu_tanh", "gelu_erf"):
        why.append(f"gpt2 needs a GeLU activation, the model has {c.activation}")
    if arch == "gpt2" and c.kv_channels * c.num_attention_heads != c.hidden_size:
        why.append("gpt2 needs kv_channels x num_attention_heads = hidden_size")
    if arch != "megatron_cai" and c.window_size is not None:
        why.append(f"{arch} has no sliding-window attention (window_size={c.window_size})")
    # options no exported architecture (nor the megatron_cai remote code) implements
    if c.mup.enabled:
        why.append(f"{arch} has no MuP multipliers (the model was trained with --use-mup)")
    if c.position_embedding_type == "none":
        why.append(f"{arch} needs position embeddings (the model has --position-embedding-type none)")
    if c.rotary_percent != 1.0:
        why.append(f"{arch} rotates whole heads (the model has --rotary-percent {c.rotary_percent})")
    if c.qk_layernorm:
        why.append(f"{arch} has no query/key layernorm (the model has --qk-layernorm)")
    if c.window_attn_skip_freq is not None or c.kv_share_pattern is not None:  # one window for all layers there
        why.append(f"{arch} has no per-layer windows or cross-layer KV sharing (the model has "
                   f"--window-attn-skip-freq / --kv-share-pattern)")
    if c.add_qkv_bias and not c.add_bias_linear:
        why.append(f"{arch} has no query/key/value-only biases (the model has --add-qkv-bias)")
    if c.rope_scaling and arch != "llama":
        why.append(f"{arch} has no Llama 3 RoPE scaling (the model has --use-rope-scaling)")
    if c.apply_layernorm_1p:
        why.append(f"{arch} stores plain norm weights (the model has --apply-layernorm-1p)")
    if c.rotary_interleaved:
        why.append(f"{arch} rotates the two halves of each head (the model has --rotary-interleaved)")
    if c.attention_output_gate:
        why.append(f"{arch} has no attention output gate (the model has --attention-output-gate)")
    if c.moe is not None:
        why.append(f"{arch} has no Mixture-of-Experts layers (the model has --num-experts {c.moe.num_experts}); the "
                   f"Mixtral / Qwen-MoE layouts are not written here: export it to Megatron-LM with --to-megatron")
    return why


def choose_architecture(config: GPTConfig, requested: str = "auto") -> str:
    if requested != "auto":
        why = unsupported_reasons(config, requested)
        if why:
            raise ConversionError(f"--hf-architecture {requested} cannot represent this model: " + "; ".join(why))
        return requested
    fits = [a for a in ARCHITECTURES if not unsupported_reasons(config, a)]
    if not fits:
        raise ConversionError("no Hugging Face architecture can represent this model: "
                              + "; ".join(unsupported_reasons(config, "megatron_cai")))
    return fits[0]


# ------------------------------------------------------------------------------------ weights out
def _split_kv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[0] // 2
    return t[:half], t[half:]


def to_hf_state_dict(config: GPTConfig, model: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (names and layout of ``arch``) from canonical weights; vocabulary rows trimmed."""
    c, V = config, config.vocab_size
    out: dict[str, torch.Tensor] = {}
    tied = not c.untie_embeddings_and_output_weights
    if arch == "gpt2":
        return _to_gpt2(c, model)
    offset = -1.0 if arch == "nemotron" else 0.0  # LayerNorm1P stores weight - 1
    out["model.embed_tokens.weight"] = model[WORD_EMBEDDINGS][:V]
    if c.position_embedding_type == "learned_absolute":
        out["model.embed_positions.weight"] = model["embedding.position_embeddings.weight"]
    for i in range(c.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm")):
            out[dst + theirs + ".weight"] = model[src + ours + ".weight"] + offset
            if src + ours + ".bias" in model:
                out[dst + theirs + ".bias"] = model[src + ours + ".bias"]
        a = src + "self_attention."
        for suffix in ("weight", "bias"):
            if a + f"linear_q.{suffix}" not in model:
                continue
            k, v = _split_kv(model[a + f"linear_kv.{suffix}"])
            out[dst + f"self_attn.q_proj.{suffix}"] = model[a + f"linear_q.{suffix}"]
            out[dst + f"self_attn.k_proj.{suffix}"] = k
            out[dst + f"self_attn.v_proj.{suffix}"] = v
            out[dst + f"self_attn.o_proj.{suffix}"] = model[a + f"linear_proj.{suffix}"]
            fc1 = model[src + f"mlp.linear_fc1.{suffix}"]
            if c.activation == "swiglu":
                gate, up = fc1.chunk(2, dim=0)
                out[dst + f"mlp.gate_proj.{suffix}"] = gate
                out[dst + f"mlp.up_proj.{suffix}"] = up
            else:
                out[dst + f"mlp.up_proj.{suffix}"] = fc1
            out[dst + f"mlp.down_proj.{suffix}"] = model[src + f"mlp.linear_fc2.{suffix}"]
    out["model.norm.weight"] = model["decoder.final_layernorm.weight"] + offset
    if "decoder.final_layernorm.bias" in model:
        out["model.norm.bias"] = model["decoder.final_layernorm.bias"]
    if not tied:
        out["lm_head.weight"] = model[OUTPUT_WEIGHT][:V]
    return {k: v.contiguous() for k, v in out.items()}


def _to_gpt2(c: GPTConfig, model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    V, h = c.vocab_size, c.hidden_size
    rep = c.num_attention_heads // c.num_query_groups
    out = {"transformer.wte.weight": model[WORD_EMBEDDINGS][:V],
           "transformer.wpe.weight": model["embedding.position_embeddings.weight"]}

    def bias(name: str, size: int) -> torch.Tensor:
        return model[name] if name in model else torch.zeros(size, dtype=model[WORD_EMBEDDINGS].dtype)

    def heads(t: torch.Tensor) -> torch.Tensor:  # repeat each KV head for the query heads that share it
        return t.reshape(c.num_query_groups, c.kv_channels, *t.shape[1:]).repeat_interleave(rep, 0).flatten(0, 1)

    for i in range(c.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[dst + theirs + ".weight"] = model[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = model[src + ours + ".bias"]
        a = src + "self_attention."
        k, v = _split_kv(model[a + "linear_kv.weight"])
        out[dst + "attn.c_attn.weight"] = torch.cat([model[a + "linear_q.weight"], heads(k), heads(v)], 0).t()
        kv_size = c.num_query_groups * c.kv_channels
        kb, vb = _split_kv(bias(a + "linear_kv.bias", 2 * kv_size))
        out[dst + "attn.c_attn.bias"] = torch.cat([bias(a + "linear_q.bias", h), heads(kb), heads(vb)])
        out[dst + "attn.c_proj.weight"] = model[a + "linear_proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = bias(a + "linear_proj.bias", h)
        out[dst + "mlp.c_fc.weight"] = model[src + "mlp.linear_fc1.weight"].t()
        out[dst + "mlp.c_fc.bias"] = bias(src + "mlp.linear_fc1.bias", c.ffn_hidden_size)
        out[dst + "mlp.c_proj.weight"] = model[src + "mlp.linear_fc2.weight"].t()
        out[dst + "mlp.c_proj.bias"] = bias(src + "mlp.linear_fc2.bias", h)
    out["transformer.ln_f.weight"] = model["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = model["decoder.final_layernorm.bias"]
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = model[OUTPUT_WEIGHT][:V]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(config: GPTConfig, arch: str, special: dict | None = None):
    """The ``transformers`` config object (or, for ``megatron_cai``, the config.json dict)."""
    c, special = config, dict(special or {})
    common = {"vocab_size": c.vocab_size, "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
              "bos_token_id": special.get("bos_token_id"), "eos_token_id": special.get("eos_token_id"),
              "pad_token_id": special.get("pad_token_id")}
    rope = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
    if c.rope_scaling:  # megatron-core's constants (rope.py)
        rope = {"rope_type": "llama3", "rope_theta": float(c.rotary_base), "factor": float(c.rope_scaling_factor),
                "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    if arch == "llama":
        from transformers import LlamaConfig

        cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                          num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels, hidden_act="silu",
                          max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
                          rope_parameters=rope, attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear,
                          attention_dropout=0.0, **common)
    elif arch == "gpt2":
        from transformers import GPT2Config

        cfg = GPT2Config(n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
                         n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                         activation_function="gelu_new" if c.activation == "gelu_tanh" else "gelu",
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=c.layernorm_epsilon,
                         **common)
    elif arch == "nemotron":
        from transformers import NemotronConfig

        cfg = NemotronConfig(hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                             num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                             num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels, hidden_act="relu2",
                             max_position_embeddings=c.max_position_embeddings, norm_eps=c.layernorm_epsilon,
                             rope_parameters={**rope, "partial_rotary_factor": 1.0},
                             attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear, attention_dropout=0.0,
                             **common)
    else:
        return {"model_type": "megatron_cai", "architectures": [HF_CLASSES[arch]],
                "auto_map": {"AutoConfig": "configuration_megatron_cai.MegatronCaiConfig",
                             "AutoModelForCausalLM": "modeling_megatron_cai.MegatronCaiForCausalLM"},
                "hidden_size": c.hidden_size, "ffn_hidden_size": c.ffn_hidden_size, "num_layers": c.num_layers,
                "num_attention_heads": c.num_attention_heads, "num_query_groups": c.num_query_groups,
                "kv_channels": c.kv_channels, "max_position_embeddings": c.max_position_embeddings,
                "position_embedding_type": c.position_embedding_type, "rotary_base": float(c.rotary_base),
                "normalization": c.normalization, "layernorm_epsilon": c.layernorm_epsilon,
                "activation": c.activation, "add_bias_linear": c.add_bias_linear, "window_size": c.window_size,
                "use_cache": True, **common}
    cfg.architectures = [HF_CLASSES[arch]]
    return cfg


# ------------------------------------------------------------------------------------- weights in
def config_from_hf(cfg: dict) -> GPTConfig:
    """Our GPTConfig from a Hugging Face config.json (Llama, GPT-2, Nemotron or an export of ours)."""
    mt = cfg.get("model_type")

    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))

    def rope_theta() -> float:
        if rope_type not in ("default", None, "llama3"):
            raise ConversionError(f"RoPE scaling {rope_type!r} is not supported")
        if rope_type == "llama3":
            fixed = (LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT)
            given = (rp.get("low_freq_factor"), rp.get("high_freq_factor"), rp.get("original_max_position_embeddings"))
            if tuple(map(float, given)) != tuple(map(float, fixed)):
                raise ConversionError(f"llama3 RoPE scaling with (low_freq_factor, high_freq_factor, "
                                      f"original_max_position_embeddings) = {given}: only megatron-core's {fixed} is "
                                      f"supported")
        return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    def rope_scaling() -> dict:
        return {"rope_scaling": True, "rope_scaling_factor": float(rp["factor"])} if rope_type == "llama3" else {}

    def bias(att: str, mlp: str) -> bool:
        if bool(cfg.get(att, False)) != bool(cfg.get(mlp, cfg.get(att, False))):
            raise ConversionError(f"{att} and {mlp} differ; this codebase has one --disable-bias-linear switch")
        return bool(cfg.get(att, False))

    common = {"vocab_size": cfg["vocab_size"], "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", mt == "gpt2")}
    if mt in ("llama", "nemotron"):
        heads = cfg["num_attention_heads"]
        act = cfg.get("hidden_act", "silu" if mt == "llama" else "relu2")
        if (mt, act) not in (("llama", "silu"), ("nemotron", "relu2")):
            raise ConversionError(f"{mt} with hidden_act={act!r} is not supported")
        if mt == "nemotron":
            prf = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
            if prf not in (None, 1.0):
                raise ConversionError(f"nemotron partial_rotary_factor={prf}: only full rotary (1.0) is supported")
        mp = cfg.get("max_position_embeddings", 2048)
        return GPTConfig(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                         num_attention_heads=heads, ffn_hidden_size=cfg["intermediate_size"],
                         num_query_groups=cfg.get("num_key_value_heads") or heads,
                         kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads, seq_length=mp,
                         max_position_embeddings=mp, position_embedding_type="rope", rotary_base=rope_theta(),
                         normalization="RMSNorm" if mt == "llama" else "LayerNorm",
                         layernorm_epsilon=cfg.get("rms_norm_eps" if mt == "llama" else "norm_eps", 1e-5),
                         activation="swiglu" if mt == "llama" else "relu2",
                         add_bias_linear=bias("attention_bias", "mlp_bias"), **rope_scaling(), **common)
    if mt == "gpt2":
        gelu = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_erf"}
        if cfg.get("activation_function", "gelu_new") not in gelu:
            raise ConversionError(f"GPT-2 activation {cfg['activation_function']!r} is not a GeLU")
        if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
            raise ConversionError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
        h, heads = cfg["n_embd"], cfg["n_head"]
        return GPTConfig(num_layers=cfg["n_layer"], hidden_size=h, num_attention_heads=heads,
                         ffn_hidden_size=cfg.get("n_inner") or 4 * h, seq_length=cfg["n_positions"],
                         max_position_embeddings=cfg["n_positions"], position_embedding_type="learned_absolute",
                         normalization="LayerNorm", layernorm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
                         activation=gelu[cfg.get("activation_function", "gelu_new")], add_bias_linear=True,
                         **common)
    if mt == "megatron_cai":
        keys = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
                "normalization", "layernorm_epsilon", "activation", "add_bias_linear", "window_size")
        kw = {k: cfg[k] for k in keys if k in cfg}
        if "activation" in kw:  # exports made before erf GeLU existed called the tanh GeLU "gelu"
            kw["activation"] = LEGACY_ACTIVATIONS.get(kw["activation"], kw["activation"])
        return GPTConfig(seq_length=cfg["max_position_embeddings"], **kw, **common)
    raise ConversionError(f"model_type {mt!r} is not supported for import (llama, gpt2, nemotron, megatron_cai)")


def from_hf_state_dict(config: GPTConfig, hf: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Canonical weights (our names, vocabulary rows unpadded) from Hugging Face tensors."""
    c = config
    tied = not c.untie_embeddings_and_output_weights
    out: dict[str, torch.Tensor] = {}
    take = _taker(hf)
    if model_type == "gpt2":
        h = c.hidden_size
        out[WORD_EMBEDDINGS] = take("transformer.wte.weight")
        out["embedding.position_embeddings.weight"] = take("transformer.wpe.weight")
        for i in range(c.num_layers):
            src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[dst + ours + ".weight"] = take(src + theirs + ".weight")
                out[dst + ours + ".bias"] = take(src + theirs + ".bias")
            w, b = take(src + "attn.c_attn.weight").t(), take(src + "attn.c_attn.bias")
            a = dst + "self_attention."
            out[a + "linear_q.weight"], out[a + "linear_kv.weight"] = w[:h], w[h:]
            out[a + "linear_q.bias"], out[a + "linear_kv.bias"] = b[:h], b[h:]
            out[a + "linear_proj.weight"] = take(src + "attn.c_proj.weight").t()
            out[a + "linear_proj.bias"] = take(src + "attn.c_proj.bias")
            out[dst + "mlp.linear_fc1.weight"] = take(src + "mlp.c_fc.weight").t()
            out[dst + "mlp.linear_fc1.bias"] = take(src + "mlp.c_fc.bias")
            out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.c_proj.weight").t()
            out[dst + "mlp.linear_fc2.bias"] = take(src + "mlp.c_proj.bias")
        out["decoder.final_layernorm.weight"] = take("transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = take("transformer.ln_f.bias")
        if not tied:
            out[OUTPUT_WEIGHT] = take("lm_head.weight")
        return {k: v.contiguous().clone() for k, v in out.items()}
    offset = 1.0 if model_type == "nemotron" else 0.0
    out[WORD_EMBEDDINGS] = take("model.embed_tokens.weight")
    if c.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = take("model.embed_positions.weight")
    suffixes = ("weight", "bias") if c.add_bias_linear else ("weight",)
    for i in range(c.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm")):
            out[dst + ours + ".weight"] = take(src + theirs + ".weight") + offset
            if c.normalization == "LayerNorm":
                out[dst + ours + ".bias"] = take(src + theirs + ".bias")
        a = dst + "self_attention."
        for s in suffixes:
            out[a + f"linear_q.{s}"] = take(src + f"self_attn.q_proj.{s}")
            out[a + f"linear_kv.{s}"] = torch.cat([take(src + f"self_attn.k_proj.{s}"),
                                                   take(src + f"self_attn.v_proj.{s}")])
            out[a + f"linear_proj.{s}"] = take(src + f"self_attn.o_proj.{s}")
            up = take(src + f"mlp.up_proj.{s}")
            out[dst + f"mlp.linear_fc1.{s}"] = (torch.cat([take(src + f"mlp.gate_proj.{s}"), up])
                                                if c.activation == "swiglu" else up)
            out[dst + f"mlp.linear_fc2.{s}"] = take(src + f"mlp.down_proj.{s}")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight") + offset
    if c.normalization == "LayerNorm":
        out["decoder.final_layernorm.bias"] = take("model.norm.bias")
    if not tied:
        out[OUTPUT_WEIGHT] = take("lm_head.weight")
    return {k: v.contiguous().clone() for k, v in out.items()}


def _taker(hf: dict[str, torch.Tensor]):
    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"the Hugging Face weights lack {name!r}")
        return hf[name].float()

    return take


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a local model directory (model.safetensors, sharded safetensors or pytorch_model.bin)."""
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
        out = {}
        for f in files:
            out.update(load_file(os.path.join(hf_dir, f)))
        return out
    bin_path = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(bin_path):
        try:
            return load_weights(bin_path, bin_path)  # weights only: a pickle that would run code is refused
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - the weights-only unpickler fails on damage in many ways
            raise ConversionError(f"cannot read {bin_path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") \
                from None
    raise ConversionError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def param_layout(config: GPTConfig) -> dict[str, dict]:
    """tp_dim / tp_sections of every canonical parameter (from a TP = 1 model built on the meta device)."""
    with torch.device("meta"):
        model = GPTModel(config)
    return {n: {"tp_dim": getattr(p, "tp_dim", None), "tp_sections": getattr(p, "tp_sections", None)}
            for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------- export/import
def export_to_hf(load: str, save: str, *, step: int | None = None, architecture: str = "auto",
                 dtype: str = "float32", tokenizer_model: str | None = None, tokenizer_type: str | None = None,
                 log=print) -> str:
    """Write ``config.json``, ``model.safetensors`` and the run's tokenizer to ``save``; returns the architecture."""
    from safetensors.torch import save_file

    ck = load_canonical(load, step, load_optimizer=False)
    arch = choose_architecture(ck.config, architecture)
    if ck.config.qat.enabled:
        log(" warning: the model was trained with quantization-aware training; the export holds the "
            "high-precision weights without fake quantization")
    os.makedirs(save, exist_ok=True)
    special = _export_tokenizer(ck, save, tokenizer_model, tokenizer_type, log)
    cfg = hf_config(ck.config, arch, special)
    if isinstance(cfg, dict):
        for name in REMOTE_FILES:
            shutil.copy2(os.path.join(REMOTE_DIR, name), save)
        with open(os.path.join(save, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    else:
        cfg.save_pretrained(save)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tensors = {k: v.to(torch_dtype) for k, v in to_hf_state_dict(ck.config, ck.model, arch).items()}
    save_file(tensors, os.path.join(save, "model.safetensors"), metadata={"format": "pt"})
    log(f" exported iteration {ck.iteration} as {HF_CLASSES[arch]} ({sum(t.numel() for t in tensors.values()):,} "
        f"parameters, {dtype}) to {save}" + ("; load it with trust_remote_code=True" if arch == "megatron_cai" else ""))
    return arch


def _export_tokenizer(ck: CanonicalCheckpoint, save: str, tokenizer_model, tokenizer_type, log) -> dict:
    from ..inference.generation import checkpoint_tokenizer
    from ..training.tokenizer import NullTokenizer
    from .hf_tokenizer import compare_encodings, save_hf_tokenizer

    try:
        ours = checkpoint_tokenizer(ck, tokenizer_model, tokenizer_type)
    except FileNotFoundError as e:
        log(f" warning: {e}; no tokenizer written")
        return {}
    if isinstance(ours, NullTokenizer):
        log(" note: the run had no tokenizer (mock data / NullTokenizer): no tokenizer files written")
        return {}
    source = getattr(ours, "model_file", None) or getattr(ours, "path", None)
    ttype = "SentencePieceTokenizer" if hasattr(ours, "model_file") else "HuggingFaceTokenizer"
    learned = ck.config.position_embedding_type == "learned_absolute"  # a hard length limit only then
    special = save_hf_tokenizer(ttype, source, save, ck.config.max_position_embeddings if learned else None)
    bad = compare_encodings(ours, save)
    if bad:
        log(f" warning: the exported tokenizer encodes {len(bad)} sample texts differently, e.g. {bad[0][:40]!r}")
    return special


def import_from_hf(hf_dir: str, save: str, *, tp: int = 1, pp: int = 1, vp_layers: int | None = None,
                   make_vocab_size_divisible_by: int = 128, log=print) -> str:
    """Initialise a training checkpoint (iteration 0, no optimizer state) from a local Hugging Face model."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConversionError(f"{path} is missing: not a Hugging Face model directory")
    with open(path) as f:
        cfg = json.load(f)
    config = config_from_hf(cfg)
    model = from_hf_state_dict(config, read_hf_weights(hf_dir), cfg["model_type"])
    layout = param_layout(config)
    extra = sorted(set(model) - set(layout))
    if extra:
        raise ConversionError(f"unexpected parameters {extra[:5]}")
    args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_dir,
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
            "pretrain_flags": pretrain_flags(config)}
    ck = CanonicalCheckpoint(config=config, iteration=0, model=model, layout_meta=layout, args=args,
                             counters={"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0,
                                       "skipped_iterations": 0}, source=Layout(1, 1, None, None),
                             notes=[f"imported from {hf_dir} ({cfg.get('model_type')})"])
    target = target_layout(config, tp, pp, vp_layers)
    with tempfile.TemporaryDirectory() as tok_dir:
        copied = [n for n in os.listdir(hf_dir) if n.startswith(("tokenizer", "special_tokens_map", "vocab",
                                                                     "merges", "added_tokens"))]
        for name in copied:
            shutil.copy2(os.path.join(hf_dir, name), tok_dir)
        ck.tokenizer_dir = tok_dir if copied else None
        out = save_resharded(ck, save, target, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             with_optimizer=False, log=log)
    log(f" imported {cfg.get('model_type')} from {hf_dir} into {out} at (TP, PP) = ({tp}, {pp}); train from it with\n"
        f"   pretrain_gpt.py --load {save} --finetune {' '.join(args['pretrain_flags'])} ...")
    return out


def pretrain_flags(c: GPTConfig) -> list[str]:
    """The pretrain_gpt.py flags that rebuild ``c``'s function: every architecture field (what --load checks) and
    the other options that change the outputs (norm epsilon, RoPE base, window)."""
    activation = {"gelu_erf": "gelu", "gelu_tanh": "gelu_tanh"}.get(c.activation, c.activation)
    flags = ["--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size), "--ffn-hidden-size",
             str(c.ffn_hidden_size), "--num-attention-heads", str(c.num_attention_heads), "--kv-channels",
             str(c.kv_channels), "--max-position-embeddings", str(c.max_position_embeddings),
             "--position-embedding-type", c.position_embedding_type, "--normalization", c.normalization,
             "--norm-epsilon", repr(c.layernorm_epsilon), "--activation", activation]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.position_embedding_type == "rope":
        flags += ["--rotary-base", repr(c.rotary_base), "--rotary-percent", repr(c.rotary_percent)]
    if c.rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(c.rope_scaling_factor)]
    if c.qk_layernorm:
        flags.append("--qk-layernorm")
    if c.apply_layernorm_1p:
        flags.append("--apply-layernorm-1p")
    if c.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if not c.add_bias_linear:
        flags.append("--disable-bias-linear")
    if c.add_qkv_bias and not c.add_bias_linear:
        flags.append("--add-qkv-bias")
    if c.window_size is not None:
        flags += ["--window-size", str(c.window_size)]
    return flags + moe_pretrain_flags(c.moe)

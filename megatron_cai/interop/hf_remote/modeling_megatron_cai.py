"""MegatronCaiForCausalLM: megatron-cai's GPT as a Hugging Face model (load with trust_remote_code=True).

Same computation as megatron_cai.core.models.gpt.GPTModel (TP = PP = 1, eval): embedding (+ learned
positions) -> pre-norm layers [x + attn(norm(x)); x + mlp(norm(x))] -> final norm -> output layer.
Attention: softmax(q k^T / sqrt(head_dim)) with causal masking (and the sliding window on token
distance when configured), RoPE in the rotate-half convention, KV heads shared by groups of query heads.
"""
import math
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from .configuration_megatron_cai import MegatronCaiConfig
except ImportError:  # loaded as a plain module
    from configuration_megatron_cai import MegatronCaiConfig

_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


def _norm(config: MegatronCaiConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MegatronCaiAttention(nn.Module):
    def __init__(self, config: MegatronCaiConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
        bias = config.add_bias_linear
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.groups * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.groups * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x, rotary, mask, cache):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MegatronCaiMLP(nn.Module):
    def __init__(self, config: MegatronCaiConfig) -> None:
        super().__init__()
        self.activation = config.activation
        bias = config.add_bias_linear
        if self.activation == "swiglu":
            self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=bias)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=bias)

    def forward(self, x):
        h = self.up_proj(x)
        if self.activation == "swiglu":
            h = F.silu(self.gate_proj(x)) * h
        elif self.activation == "relu2":
            h = F.relu(h).square()
        else:  # gelu_erf; gelu_tanh (called "gelu" by exports made before erf GeLU existed)
            h = F.gelu(h, approximate="none" if self.activation == "gelu_erf" else "tanh")
        return self.down_proj(h)


class MegatronCaiLayer(nn.Module):
    def __init__(self, config: MegatronCaiConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = MegatronCaiAttention(config, layer_idx)
        self.post_attention_layernorm = _norm(config)
        self.mlp = MegatronCaiMLP(config)

    def forward(self, x, rotary, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MegatronCaiPreTrainedModel(PreTrainedModel):
    config_class = MegatronCaiConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegatronCaiLayer"]
    _supports_cache_class = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class MegatronCaiModel(MegatronCaiPreTrainedModel):
    def __init__(self, config: MegatronCaiConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                if config.position_embedding_type == "learned_absolute" else None)
        self.layers = nn.ModuleList([MegatronCaiLayer(config, i) for i in range(config.num_layers)])
        self.norm = _norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _rotary(self, position_ids, dtype):
        d = self.config.kv_channels
        inv_freq = 1.0 / (self.config.rotary_base ** (torch.arange(0, d, 2, device=position_ids.device,
                                                                   dtype=torch.float32) / d))
        emb = position_ids.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((emb, emb), dim=-1).unsqueeze(1)  # [b, 1, s, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _mask(self, attention_mask, past, q_len, device, batch):
        total = past + q_len
        qi = torch.arange(past, total, device=device)[:, None]
        kj = torch.arange(total, device=device)[None, :]
        mask = (kj <= qi).expand(batch, 1, q_len, total)
        if self.config.window_size is not None:
            mask = mask & ((qi - kj) < self.config.window_size)
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = mask & attention_mask[:, None, None, :total].bool()
            mask = mask | (kj == qi)  # padded queries attend to themselves only (their outputs are unused)
        return mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=x.device).unsqueeze(0).expand(b, -1)
        if self.embed_positions is not None:
            x = x + self.embed_positions(position_ids)
        rotary = self._rotary(position_ids, x.dtype) if self.config.position_embedding_type == "rope" else None
        mask = self._mask(attention_mask, past, s, x.device, b)
        for layer in self.layers:
            x = layer(x, rotary, mask, cache)
        return self.norm(x), cache


class MegatronCaiForCausalLM(MegatronCaiPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegatronCaiConfig) -> None:
        super().__init__(config)
        self.model = MegatronCaiModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, past_key_values=None, logits_to_keep=0, **kwargs):
        hidden, cache = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                                   past_key_values)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


__all__ = ["MegatronCaiForCausalLM", "MegatronCaiModel", "MegatronCaiPreTrainedModel"]

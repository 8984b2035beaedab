"""Configuration of MegatronCaiForCausalLM (exported by megatron-cai's tools/convert_checkpoint.py --to hf).

Fields mirror megatron-cai's GPTConfig: pre-norm decoder with LayerNorm or RMSNorm, squared-ReLU, SwiGLU
or tanh-GeLU MLP, RoPE (rotate-half) or learned absolute positions, GQA/MQA, optional biases on every
linear layer, optional sliding window, tied or untied output embeddings.
"""
from transformers import PretrainedConfig


class MegatronCaiConfig(PretrainedConfig):
    model_type = "megatron_cai"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {"num_hidden_layers": "num_layers", "intermediate_size": "ffn_hidden_size",
                     "num_key_value_heads": "num_query_groups", "head_dim": "kv_channels"}

    vocab_size: int = 32000
    hidden_size: int = 256
    ffn_hidden_size: int = 1024
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 4
    kv_channels: int = 64
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rope"   # rope | learned_absolute
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"        # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1e-5
    activation: str = "relu2"               # relu2 | swiglu | gelu_erf | gelu_tanh ("gelu" in older exports)
    add_bias_linear: bool = True
    window_size: int | None = None
    tie_word_embeddings: bool = True
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None


__all__ = ["MegatronCaiConfig"]

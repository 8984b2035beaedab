"""A small Kaiju-style GPTModel for cache and generation tests: MQA, 5-token-scale windows on two of three layers,
K/V shared across layers, RMSNorm, squared ReLU; fp64, dropout off."""
from __future__ import annotations


def kaiju_model(seed: int = 0, **kw):
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.inference.generation import ensure_single_process

    cfg = dict(num_layers=6, hidden_size=32, num_attention_heads=4, num_query_groups=1, vocab_size=50,
               padded_vocab_size=56, seq_length=64, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
               position_embedding_type="rope", normalization="RMSNorm", activation="relu2", add_bias_linear=False,
               window_size=8, window_attn_skip_freq=3, kv_share_pattern=[0, 0, 2, 3, 3, 5])
    cfg.update(kw)
    ensure_single_process()
    model = GPTModel(GPTConfig(**cfg))
    model.initialize(seed)
    return model.double().eval()

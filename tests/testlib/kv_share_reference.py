"""An explicit reference GPT for cross-layer KV sharing, written from the parameters alone (fp64).

Embedding -> per layer: RMSNorm -> attention whose K/V are *handed over* from the source layer (the source's
normed input through the source's K/V weights) -> residual -> RMSNorm -> squared-ReLU MLP -> residual ->
final RMSNorm -> tied output layer -> per-token cross entropy. Attention is ``layer_attention.reference_attention``
(fp64 softmax over the brute-force mask). No library module is called.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import interval_mask
from .layer_attention import reference_attention


def reference_losses(params: dict[str, torch.Tensor], cfg, tokens: torch.Tensor, labels: torch.Tensor,
                     pos: torch.Tensor, visibility: tuple[torch.Tensor, torch.Tensor], sources: list[int],
                     windows: list[int | None]) -> torch.Tensor:
    """Per-token losses ``[b, s]``. ``params``: the model's parameters by name (no biases, RMSNorm, relu2,
    tied embeddings); ``sources[l]``: the layer whose K/V layer ``l`` uses; ``windows[l]``: its window."""
    eps, d = cfg.layernorm_epsilon, cfg.kv_channels
    x = params["embedding.word_embeddings.weight"][tokens]
    normed: dict[int, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        p = f"decoder.layers.{layer}."
        h = F.rms_norm(x, x.shape[-1:], params[p + "input_layernorm.weight"], eps)
        normed[layer] = h
        src = sources[layer]
        weights = {"q": params[p + "self_attention.linear_q.weight"],
                   "kv": params[f"decoder.layers.{src}.self_attention.linear_kv.weight"],
                   "proj": params[p + "self_attention.linear_proj.weight"]}
        mask = interval_mask(*visibility, windows[layer], pos)
        x = x + reference_attention(weights, h, pos, mask, cfg.num_attention_heads, cfg.num_query_groups, d,
                                    kv_x=normed[src])
        h = F.rms_norm(x, x.shape[-1:], params[p + "pre_mlp_layernorm.weight"], eps)
        x = x + F.relu(h @ params[p + "mlp.linear_fc1.weight"].T).square() @ params[p + "mlp.linear_fc2.weight"].T
    x = F.rms_norm(x, x.shape[-1:], params["decoder.final_layernorm.weight"], eps)
    logits = x @ params["embedding.word_embeddings.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)

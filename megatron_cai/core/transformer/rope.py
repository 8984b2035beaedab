"""Rotary position embeddings (rotate-half convention, as in Megatron and Hugging Face Llama)."""
from __future__ import annotations

import torch


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [batch, seq, head_dim] for integer positions [batch, seq]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim))
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by cos/sin [batch, seq, rot_dim]; with rot_dim < head_dim
    (--rotary-percent) only the first rot_dim dims rotate, the rest pass through (Megatron's rule)."""
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot_dim], cos, sin), x[..., rot_dim:]), dim=-1)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""Rotary position embeddings (rotate-half convention, as in Megatron and Hugging Face Llama), with
Llama 3.x frequency scaling (``--use-rope-scaling``, megatron-core's ``RotaryEmbedding._apply_scaling``)."""
from __future__ import annotations

import math

import torch

# Llama 3.1's constants, as megatron-core 0.19.2 fixes them (only the factor is a flag there)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x RoPE scaling: wavelengths beyond the original context / low-freq factor are stretched by
    ``factor``, those below the original context / high-freq factor are kept, and the band between is
    interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_inv_freq(head_dim: int, base: float = 10000.0, scaling_factor: float | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The [head_dim / 2] inverse frequencies (Llama 3.x-scaled by ``scaling_factor`` when given)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    return inv_freq if scaling_factor is None else llama3_scaled_inv_freq(inv_freq, scaling_factor)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                   dtype: torch.dtype = torch.float32, scaling_factor: float | None = None,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [batch, seq, head_dim] for integer positions [batch, seq]: each frequency for the two
    halves (f0 .. fn, f0 .. fn), or ``interleaved`` for each (even, odd) pair (f0 f0 f1 f1 ..., --rotary-interleaved,
    as megatron-core's RotaryEmbedding)."""
    inv_freq = rotary_inv_freq(head_dim, base, scaling_factor, position_ids.device)
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by cos/sin [batch, seq, rot_dim]; with rot_dim < head_dim
    (--rotary-percent) only the first rot_dim dims rotate, the rest pass through (Megatron's rule). The pairs
    rotated together are (i, i + rot_dim / 2), or (2i, 2i + 1) when ``interleaved``."""
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot_dim], cos, sin, interleaved), x[..., rot_dim:]), dim=-1)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    if interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

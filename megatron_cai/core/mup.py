"""Maximal Update Parameterization (``--use-mup``), as megatron-core 0.19.2 applies it.

With width multiplier ``m = hidden_size / mup_base_hidden_size`` (megatron-core's ``TransformerConfig``
``__post_init__``, ``LanguageModule`` and ``get_mup_config_overrides``):

- initialisation: hidden matrices ``N(0, std / sqrt(m))``, the output projections of attention and MLP
  ``N(0, std / (sqrt(2 L) sqrt(m)))``; embeddings and an untied output layer keep ``N(0, std)``;
- attention: softmax scale ``base / d_head ** p`` with ``base = sqrt(mup_base_head_dim)`` (1 when unset) and
  ``p = mup_attn_scale_power`` (1: MuP's ``1/d``; 0.5: the standard ``1/sqrt(d)``);
- the embedding output is multiplied by ``mup_embedding_mult``, the logits by ``mup_output_mult`` (``1/m`` when
  left at 1 and ``m != 1``);
- the optimizer (nothing when ``m == 1``): Adam gives the hidden (matrix-like) parameters peak and minimum
  learning rate ``/ m`` and epsilon ``/ m``; vector-like parameters (1-D, and every embedding parameter and the
  output layer) keep the base values. SGD instead gives the vector-like parameters learning rates ``x m``.

``--mup-width-mult`` is recomputed from the two widths, as megatron-core overwrites it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MupConfig", "is_embedding_class", "mup_lr_scaled"]

_EMBEDDING_PARAM = re.compile(r"(^|\.)embedding\.|(^|\.)output_layer\.weight$")


@dataclass(frozen=True)
class MupConfig:
    """megatron-core's MuP fields of ``TransformerConfig`` (flags ``--use-mup``, ``--mup-*``)."""

    enabled: bool = False
    base_hidden_size: int | None = None   # None: the model's own width (m = 1)
    embedding_mult: float = 1.0
    output_mult: float = 1.0              # 1.0: 1 / m (megatron-core's auto value)
    base_head_dim: float | None = None
    attn_scale_power: float = 1.0

    def __post_init__(self) -> None:
        if self.base_hidden_size is not None and self.base_hidden_size <= 0:
            raise ValueError(f"--mup-base-hidden-size must be positive, got {self.base_hidden_size}")
        if self.base_head_dim is not None and self.base_head_dim <= 0:
            raise ValueError(f"--mup-base-head-dim must be positive, got {self.base_head_dim}")

    def width_mult(self, hidden_size: int) -> float:
        """m = hidden_size / mup_base_hidden_size (1 when MuP is off)."""
        if not self.enabled or self.base_hidden_size is None:
            return 1.0
        return hidden_size / self.base_hidden_size

    def softmax_scale(self, head_dim: int) -> float:
        """The attention softmax scale (``1 / sqrt(head_dim)`` when MuP is off)."""
        if not self.enabled:
            return 1.0 / math.sqrt(head_dim)
        base = 1.0 if self.base_head_dim is None else self.base_head_dim ** 0.5
        return base / head_dim ** self.attn_scale_power

    def q_scale(self, head_dim: int) -> float:
        """The factor on queries that turns the backends' ``1 / sqrt(head_dim)`` into :meth:`softmax_scale`
        (exactly 1 when MuP is off)."""
        return self.softmax_scale(head_dim) * math.sqrt(head_dim) if self.enabled else 1.0

    def logit_mult(self, hidden_size: int) -> float:
        """What the logits are multiplied by."""
        if not self.enabled:
            return 1.0
        m = self.width_mult(hidden_size)
        return 1.0 / m if self.output_mult == 1.0 and m != 1.0 else self.output_mult

    def input_mult(self) -> float:
        """What the embedding output is multiplied by."""
        return self.embedding_mult if self.enabled else 1.0

    def init_stds(self, std: float, num_layers: int, hidden_size: int) -> tuple[float, float]:
        """(hidden matrices, attention / MLP output projections) init stds; embeddings and the output layer
        keep ``std``."""
        m = self.width_mult(hidden_size)
        return std / math.sqrt(m), std / (math.sqrt(2.0 * num_layers) * math.sqrt(m))

    @classmethod
    def from_dict(cls, d: dict) -> MupConfig:
        return cls(**d)


def is_embedding_class(name: str) -> bool:
    """megatron-core's ``is_embedding_parameter`` under MuP: every parameter of the embedding, and the output
    layer's weight (also the last pipeline stage's copy of tied embeddings)."""
    return bool(_EMBEDDING_PARAM.search(name))


def mup_lr_scaled(name: str, ndim: int, optimizer: str) -> bool:
    """Whether MuP rescales this parameter's learning rate: Adam's hidden matrix-like parameters (also their
    epsilon), SGD's vector-like ones (1-D or embedding-class)."""
    vector_like = ndim <= 1 or is_embedding_class(name)
    return vector_like if optimizer == "sgd" else not vector_like

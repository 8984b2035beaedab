"""Per-layer attention patterns: which layers attend locally (sliding window) and whose K/V each layer uses.

Both are properties of a layer, decided once from the model config (layer numbers are 0-based here, as in the
parameter names ``decoder.layers.N``; megatron-core numbers layers from 1):

- **local or global** (``--window-size W --window-attn-skip-freq F``), megatron-core 0.19.2's rule
  (``is_layer_window_attention``): no window -> every layer global; no F -> every layer local; an int F ->
  layer ``n`` (1-based) is global iff ``n % F == 0`` (F = 6: five local layers, then one global); a list F ->
  layer ``n`` is local iff ``F[n - 1]`` is non-zero (1 = sliding window, 0 = full attention).
- **K/V source** (``--kv-share-pattern``, ours): layer ``i`` attends with the keys and values computed by
  layer ``source[i] <= i``; a layer that is its own source computes them. An int N shares within consecutive
  groups of N layers (the first of each group computes); a list names each layer's source.

Flag values use megatron-core's list-pattern language (``"([1]*5+[0])*2"``): integers, lists, ``+`` and
``*``, parsed here as data (never evaluated as code).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from ..parallel_state import ParallelLayoutError

__all__ = ["LayerPatternError", "check_stage_kv_sources", "group_sources", "is_local_layer", "kv_source",
           "kv_sources", "layer_window", "parse_int_or_pattern", "validate_patterns"]

_TOKEN = re.compile(r"(\d+|[\[\]()+*,])")


class LayerPatternError(ValueError):
    """A pattern flag that cannot be read or does not fit the model (the message names the flag)."""


def parse_int_or_pattern(text: str | int | list) -> int | list[int]:
    """An int (``"6"``) or megatron-core's list pattern (``"[1,1,0]*2"``, ``"([1]*5+[0])*4"``) as data.

    Grammar: ``expr := term ('+' term)*``, ``term := atom ('*' atom)*``, ``atom := INT | '[' [expr (',' expr)*]
    ']' | '(' expr ')'``; ``+`` adds ints or concatenates lists, ``*`` multiplies ints or repeats a list."""
    if isinstance(text, (int, list)):
        return text
    tokens = _tokens(text)
    parser = _Parser(tokens, text)
    value = parser.expr()
    if parser.pos != len(tokens):
        raise LayerPatternError(f"invalid pattern {text!r}: unexpected {tokens[parser.pos]!r}")
    if isinstance(value, list) and not all(isinstance(v, int) for v in value):
        raise LayerPatternError(f"invalid pattern {text!r}: a flat list of integers is expected")
    return value


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise LayerPatternError(f"invalid pattern {text!r}: only digits, ',', '[', ']', '(', ')', '+' and '*' "
                                     f"(no spaces)")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.pos = tokens, text, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (expected is not None and tok != expected):
            raise LayerPatternError(f"invalid pattern {self.text!r}: expected {expected or 'more'}, got {tok!r}")
        self.pos += 1
        return tok

    def expr(self):
        value = self.term()
        while self._peek() == "+":
            self._take()
            right = self.term()
            if isinstance(value, list) != isinstance(right, list):
                raise LayerPatternError(f"invalid pattern {self.text!r}: '+' of a list and an int")
            value = value + right
        return value

    def term(self):
        value = self.atom()
        while self._peek() == "*":
            self._take()
            right = self.atom()
            if isinstance(value, list) and isinstance(right, list):
                raise LayerPatternError(f"invalid pattern {self.text!r}: '*' of two lists")
            value = value * right
        return value

    def atom(self):
        tok = self._take()
        if tok.isdigit():
            return int(tok)
        if tok == "(":
            value = self.expr()
            self._take(")")
            return value
        if tok == "[":
            items = []
            if self._peek() != "]":
                items.append(self.expr())
                while self._peek() == ",":
                    self._take()
                    items.append(self.expr())
            self._take("]")
            return items
        raise LayerPatternError(f"invalid pattern {self.text!r}: unexpected {tok!r}")


def is_local_layer(window_size: int | None, skip_freq: int | Sequence[int] | None, layer: int) -> bool:
    """Whether 0-based ``layer`` uses the sliding window (megatron-core's ``is_layer_window_attention``)."""
    if not window_size:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return (layer + 1) % skip_freq != 0
    return bool(skip_freq[layer])


def layer_window(config, layer: int) -> int | None:
    """The window of 0-based ``layer`` (None: global attention)."""
    local = is_local_layer(config.window_size, config.window_attn_skip_freq, layer)
    return config.window_size if local else None


def kv_sources(pattern: int | Sequence[int] | None, num_layers: int) -> list[int]:
    """Each layer's K/V source layer (itself when it computes its own)."""
    if pattern is None:
        return list(range(num_layers))
    if isinstance(pattern, int):
        return [i - i % pattern for i in range(num_layers)]
    return list(pattern)


def kv_source(config, layer: int) -> int:
    """The layer whose K/V 0-based ``layer`` attends with (``layer`` itself: it computes them)."""
    return kv_sources(config.kv_share_pattern, config.num_layers)[layer]


def group_sources(config) -> list[int]:
    """The layers that compute K/V (one per sharing group), in order: what a KV cache stores."""
    return sorted(set(kv_sources(config.kv_share_pattern, config.num_layers)))


def validate_patterns(num_layers: int, window_size: int | None, skip_freq, kv_share_pattern) -> list[int] | None:
    """The K/V sources as a list (None: no layer shares); raise :class:`LayerPatternError` naming the flag when
    a pattern does not fit ``num_layers`` layers."""
    if window_size is not None and window_size < 1:
        raise LayerPatternError(f"--window-size must be >= 1, got {window_size}")
    if isinstance(skip_freq, int):
        if skip_freq < 1:
            raise LayerPatternError(f"--window-attn-skip-freq must be >= 1, got {skip_freq}")
    elif skip_freq is not None:
        if len(skip_freq) != num_layers or any(v not in (0, 1) for v in skip_freq):
            raise LayerPatternError(f"--window-attn-skip-freq: the list pattern must hold {num_layers} entries "
                                    f"(--num-layers), each 1 (sliding window) or 0 (full attention); got {skip_freq}")
    if skip_freq is not None and window_size is None:
        raise LayerPatternError("--window-attn-skip-freq needs --window-size")
    if isinstance(kv_share_pattern, int):
        if kv_share_pattern < 1:
            raise LayerPatternError(f"--kv-share-pattern must be >= 1, got {kv_share_pattern}")
        kv_share_pattern = kv_sources(kv_share_pattern, num_layers)
    if kv_share_pattern is None:
        return None
    if len(kv_share_pattern) != num_layers:
        raise LayerPatternError(f"--kv-share-pattern: the list must hold {num_layers} entries (--num-layers), "
                                f"got {len(kv_share_pattern)}")
    for layer, src in enumerate(kv_share_pattern):
        if not 0 <= src <= layer:
            raise LayerPatternError(f"--kv-share-pattern: layer {layer} takes K/V from layer {src}; a source must "
                                    f"be an earlier layer or the layer itself")
        if kv_share_pattern[src] != src:
            raise LayerPatternError(f"--kv-share-pattern: layer {layer} takes K/V from layer {src}, which itself "
                                    f"takes them from layer {kv_share_pattern[src]}; name the computing layer")
    return None if kv_share_pattern == list(range(num_layers)) else list(kv_share_pattern)


def check_stage_kv_sources(config, layer_numbers: Sequence[int]) -> None:
    """Refuse a pipeline stage (or virtual chunk) holding a layer whose K/V source sits in another stage: K/V do
    not travel between stages with the activations. Raises :class:`ParallelLayoutError` naming both layers."""
    held = set(layer_numbers)
    for layer in layer_numbers:
        src = kv_source(config, layer)
        if src not in held:
            raise ParallelLayoutError(
                f"--kv-share-pattern: layer {layer} takes K/V from layer {src}, which is in another pipeline stage "
                f"(this stage holds layers {min(held)}-{max(held)}); a sharing group must lie within one stage: "
                f"change the pattern or --pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage")

"""``--compile``: ``torch.compile`` applied to each transformer layer, as torchtitan applies it per block.

Inductor fuses a layer's elementwise work (norms, activations, RoPE, residual adds, dropout, the QAT
fake-quantization) around the GEMMs; the kernels that Dynamo cannot trace run as ``torch.library`` custom
ops (the blocked and Triton interval attention, the real QAT GEMM, the Squinch codec), so a layer compiles
to one graph. Each layer is compiled in place (``nn.Module.compile``): parameter names, state dicts and
checkpoints are those of the eager model, and the layers share one compiled graph (nothing in a layer's
forward depends on its index). The embedding, the output layer, the loss and the schedules stay eager.
"""
from __future__ import annotations

from torch import nn

__all__ = ["compile_transformer_layers"]


def compile_transformer_layers(model: nn.Module, *, backend: str = "inductor") -> int:
    """Compile every ``TransformerLayer`` of a GPT model chunk in place; returns how many.

    Call before wrapping the chunk (DDP, FSDP2). ``backend``: a ``torch.compile`` backend ("eager" and
    "aot_eager" trace without generating code, for tests)."""
    layers = list(model.decoder.layers.values())
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)

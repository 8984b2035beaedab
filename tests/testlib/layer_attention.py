"""Per-layer attention against a brute-force reference (Kaiju: local/global layers, KV sharing).

The reference recomputes one attention layer from its weights in fp64 with a textbook softmax over the
brute-force mask of the definition (``testlib.attention.interval_mask``, the window on position ids where the
layer is local) and the rotate-half RoPE of ``testlib.attention.rope``: no library attention code.
Used in-process for the CPU kernels and by a worker under the Triton interpreter.
"""
from __future__ import annotations

import random

import torch

from .attention import interval_mask, random_forest, ref_attention


def layouts(seq: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Two rows each of causal text, packed documents and packed trees: ``(start, limit, position_ids)``."""
    from megatron_cai.core.transformer import visibility as V

    idx = torch.arange(seq).expand(2, seq)
    causal = (idx.clone(), torch.full((2, seq), seq), idx.clone())
    rng = random.Random(seed)
    doc_rows = []
    for _ in range(2):
        lengths, left = [], seq
        while left:
            n = min(left, rng.randint(3, seq // 2))
            lengths.append(n)
            left -= n
        start, limit = V.from_document_lengths(lengths)
        doc_rows.append((start, limit, V.document_position_ids(lengths)))
    tree_rows = []
    while len(tree_rows) < 2:  # trees packed until the next would not fit; at least two trees per row
        trees = []
        while True:
            tree = V.from_tree(*random_forest(rng, max_nodes=5, max_len=4, p_bidir=0.0))
            if sum(t.start.numel() for t in trees) + tree.start.numel() > seq:
                break
            trees.append(tree)
        if len(trees) >= 2:
            lay = V.concat_layouts(trees)
            tree_rows.append((lay.start, lay.limit, lay.position_ids))
    return {"causal": causal, "documents": V.batch(doc_rows, seq), "trees": V.batch(tree_rows, seq)}


def reference_attention(weights: dict[str, torch.Tensor], x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                        heads: int, kv_heads: int, head_dim: int, kv_x: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 attention layer output from its weights (no biases): ``proj(softmax(q k^T) v)``.

    ``weights``: ``q`` [heads*d, hidden], ``kv`` [2*kv_heads*d, hidden] (K rows then V rows), ``proj``;
    ``kv_x``: the input K/V are computed from (another layer's input for a sharing layer; default ``x``)."""
    b, s, _ = x.shape
    kv_x = x if kv_x is None else kv_x
    q = (x @ weights["q"].T).view(b, s, heads, head_dim).transpose(1, 2)
    kv = kv_x @ weights["kv"].T
    k = kv[..., : kv_heads * head_dim].reshape(b, s, kv_heads, head_dim).transpose(1, 2)
    v = kv[..., kv_heads * head_dim:].reshape(b, s, kv_heads, head_dim).transpose(1, 2)
    q, k = rope_fp32_angles(q, pos[:, None]), rope_fp32_angles(k, pos[:, None])
    out, _ = ref_attention(q, k, v, mask)
    return out.transpose(1, 2).reshape(b, s, heads * head_dim) @ weights["proj"].T


def rope_fp32_angles(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE with angles, cos and sin computed in fp32 (the model's precision for positions), applied
    in x's dtype."""
    dim = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = pos.to(torch.float32).unsqueeze(-1) * inv
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def check_every_layer(model, seq: int, expected_windows: list[int | None], tol: float, seed: int = 0,
                      normwise: bool = False) -> int:
    """Each attention layer of ``model`` (fp64, no biases) on each layout, forward and backward (input and
    weight gradients), against :func:`reference_attention` with the window ``expected_windows[layer]``.
    ``normwise``: the tolerance is relative to each reference tensor's largest magnitude (kernels that compute
    fp64 inputs in fp32). Returns the number of (layer, layout) pairs checked."""

    def close(got, want, what):
        atol = tol * float(want.abs().max()) if normwise else tol
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")

    from megatron_cai.core.transformer.rope import rotary_cos_sin

    checked = 0
    gen = torch.Generator().manual_seed(seed)
    for name, (start, limit, pos) in layouts(seq, seed).items():
        for layer, window in enumerate(expected_windows):
            attn = model.decoder.layers[str(layer)].self_attention
            hidden = attn.linear_q.weight.shape[1]
            x = torch.randn(2, seq, hidden, dtype=torch.float64, generator=gen, requires_grad=True)
            dout = torch.randn(2, seq, hidden, dtype=torch.float64, generator=gen)
            attn.zero_grad()
            rotary = rotary_cos_sin(pos, attn.head_dim, dtype=torch.float64)
            out = attn(x, rotary, (start, limit), pos)
            (out * dout).sum().backward()
            weights = {"q": attn.linear_q.weight, "kv": attn.linear_kv.weight, "proj": attn.linear_proj.weight}
            ref_w = {k: w.detach().clone().requires_grad_(True) for k, w in weights.items()}
            x_ref = x.detach().clone().requires_grad_(True)
            mask = interval_mask(start, limit, window, pos)
            ref = reference_attention(ref_w, x_ref, pos, mask, attn.num_heads, attn.num_groups, attn.head_dim)
            (ref * dout).sum().backward()
            where = f"layer {layer} ({'window ' + str(window) if window else 'global'}), {name}"
            close(out, ref, f"{where}: output")
            close(x.grad, x_ref.grad, f"{where}: dx")
            for key, w in weights.items():
                close(w.grad, ref_w[key].grad, f"{where}: d{key}")
            checked += 1
    return checked


def megatron_windows(window: int, skip_freq, num_layers: int) -> list[int | None]:
    """Each 0-based layer's window as megatron-core 0.19.2 decides (``is_layer_window_attention``, 1-based)."""
    typing_shim()
    from megatron.core.transformer.utils import is_layer_window_attention

    return [window if is_layer_window_attention(window, skip_freq, n + 1) else None for n in range(num_layers)]


def typing_shim() -> None:
    """megatron-core 0.19.2 targets Python >= 3.12 (``typing.override``)."""
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda f: f


def megatron_freq(text: str):
    """Megatron-LM's own reading of a --window-attn-skip-freq value (``moe_freq_type``)."""
    typing_shim()
    from megatron.training.arguments import moe_freq_type

    return moe_freq_type(text)

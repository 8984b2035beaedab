"""Visibility intervals: an O(T) attention mask for packed, bidirectional and tree-structured documents.

Semantics (key-side; see docs/design.md, "Key decisions"): every key token j carries two ints,
``start[j]`` and ``limit[j]``; query i may attend key j iff ``start[j] <= i < limit[j]``.

- causal packed document [a, b): key j -> (j, b);
- bidirectional document or span [a, b): key j -> (a, b);
- tree in DFS preorder: key j of node n -> (j, subtree_end(n)), or (node_start(n), subtree_end(n))
  for a bidirectional node, so a query sees exactly its ancestors' tokens and its own node's earlier
  (or, bidirectional, all) tokens;
- padding token j -> (j, j + 1): it sees (and is seen by) only itself.

Optional sliding window W, measured on ``position_ids`` (logical positions, e.g. depth along a
tree branch): query i may additionally only see key j when ``|pos[i] - pos[j]| < W``. Every
interval-visible key of a causal token sits at ``pos[j] <= pos[i]``, so this is the usual causal
window ``0 <= pos[i] - pos[j] < W``; inside a bidirectional span the window is symmetric.

Block summaries (:func:`block_map`) decide for each (query block, key block) whether it may hold a
visible pair and whether all its pairs are visible, from per-block min/max of start/limit/position
in O(T / block) memory per block row: the fast paths never evaluate T x T pairs.

This module is the public face of the mask API: it re-exports the data-side builders of
:mod:`.visibility_layouts` and the kernel-side tiling of :mod:`.attention_tiling`. Code inside the
package imports the module it needs directly.
"""
from __future__ import annotations

from .attention_tiling import block_indices, block_map, dense_mask, key_positions
from .visibility_layouts import (
    INDEX_DTYPE,
    TreeLayout,
    batch,
    concat_layouts,
    document_position_ids,
    from_document_lengths,
    from_tree,
    pad,
    prefix_lm,
    validate,
)

__all__ = [
    "INDEX_DTYPE", "TreeLayout", "batch", "block_indices", "block_map", "concat_layouts", "dense_mask",
    "document_position_ids", "from_document_lengths", "from_tree", "key_positions", "pad", "prefix_lm", "validate",
]

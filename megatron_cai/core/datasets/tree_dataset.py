"""Tree dataset: whole trees packed first-fit into rows of ``seq_length`` tokens, with visibility intervals.

Reads a prefix written by ``tools/preprocess_data.py --tree`` (``.bin/.idx`` token stream + ``.tree``
sidecar, see :mod:`tree_format`). Per split and epoch the trees are shuffled
(``numpy.random.RandomState(seed)``) and packed first fit: each tree goes into the first row with
room for it, a new row otherwise. A tree longer than ``seq_length`` is cut by dropping its last
subtrees (its longest preorder prefix of whole nodes that fits; a root longer than a row keeps its
first ``seq_length`` tokens); cut trees, dropped nodes and tokens are counted in :attr:`stats`.
The index arrays are cached like :class:`GPTDataset`'s.

``dataset[i]`` (the batch contract, all ``[seq_length]``)::

    tokens            int64   the packed trees, nodes in DFS preorder; padding = pad id
    position_ids      int64   depth: index of the token along its root-to-token path (drives RoPE)
    visibility_start, visibility_limit  int32   key-side intervals (``visibility.from_tree``);
                                        padding token j gets (j, j + 1)
    labels            int64   labels[t] = tokens[t + 1]
    label_positions   int64   the position whose hidden state predicts labels[t]
    loss_mask         float32 weight of slot t (0 = no prediction)

**Labels ("next token on the same branch").** Slot t predicts the token u = t + 1 from the hidden
state of u's predecessor on u's root-to-token path: ``label_positions[t] = t`` inside a node and
for a node's first child, and the parent node's last token for every later child (the nearest
ancestor with tokens, for children of empty nodes). So the last token of a node with k children
predicts each child's first token once per child, every token is predicted exactly once, and from
exactly the context it has when its branch is fed alone as a causal sequence: the per-token
losses of a packed tree equal those of its root-to-leaf branches (``GPTModel(...,
label_positions=)`` gathers the hidden states before the output layer). A slot is masked (0)
when u is padding or a root's first token (no predecessor), lies in a ``"loss": false`` node, or
lies in a bidirectional node (bidirectional nodes are context: their tokens see each other).

**branch_weight.** ``tree_loss_weighting="token"`` (default) weights every predicted token 1:
shared prefixes count once. ``"branch"`` weights slot t by ``branch_weight`` of u (the fraction of
the tree's leaves below u's node). The masked mean ``sum(w l) / sum(w)`` over one tree then equals
*exactly* the token-mean loss of its root-to-leaf branches flattened as separate sequences (a
prefix shared by k branches counts k times); over packed trees, numerator and denominator are each
the expectation of picking one branch per tree uniformly at random, so every tree weighs as one
branch, not as all of them.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_cai.core.datasets.fingerprint import cached_file_fingerprint, prefix_fingerprint
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
from megatron_cai.core.datasets.tree_format import TreeNodes, TreeSidecar, tree_path
from megatron_cai.core.datasets.utils import description_hash, load_or_build_indices, to_json
from megatron_cai.core.transformer import visibility_layouts as V

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("bin_offsets", "bin_trees", "shuffle_index")
LOSS_WEIGHTINGS = ("token", "branch")
DATA_FORMATS = ("auto", "plain", "tree")

__all__ = ["TreeDatasetConfig", "TreeDataset", "TreeDoc", "build_tree_sample", "first_fit", "cut_tree",
           "LOSS_WEIGHTINGS", "DATA_FORMATS"]


@dataclass
class TreeDatasetConfig(GPTDatasetConfig):
    """:class:`GPTDatasetConfig` plus the tree options (``--data-format``, ``--tree-loss-weighting``).

    ``data_format``: ``tree`` reads every prefix as trees, ``plain`` as documents, ``auto`` as trees
    when the prefix has a ``.tree`` sidecar. Padding uses ``eod_token_id`` (0 when it is None).
    """

    data_format: str = "auto"
    tree_loss_weighting: str = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"--data-format must be one of {DATA_FORMATS}, got {self.data_format!r}")
        if self.tree_loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"--tree-loss-weighting must be one of {LOSS_WEIGHTINGS}, got "
                             f"{self.tree_loss_weighting!r}")


@dataclass
class TreeDoc:
    """One tree ready for packing: its token stream (nodes in preorder) and its nodes."""

    tokens: np.ndarray
    nodes: TreeNodes
    name: str = "tree"


@dataclass
class PackingStats:
    trees: int = 0
    tokens: int = 0
    trees_cut: int = 0
    nodes_dropped: int = 0
    tokens_dropped: int = 0
    rows_per_epoch: int = 0
    epochs: int = 0
    fill: float = 0.0
    extra: dict = field(default_factory=dict)

    def summary(self, name: str) -> str:
        return (f"{name}: {self.trees} trees, {self.tokens} tokens -> {self.rows_per_epoch} rows per epoch "
                f"({self.fill:.1%} filled), {self.epochs} epoch(s); {self.trees_cut} trees longer than a row cut "
                f"({self.nodes_dropped} nodes, {self.tokens_dropped} tokens dropped)")


# ----------------------------------------------------------------------------------------- packing
def first_fit(sizes: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Bin of each item, in order, by first fit: the lowest-numbered bin with room (O(n log n)).

    Every size must be in ``[0, capacity]``. Bins are numbered in the order they are opened.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    if n and (sizes.min() < 0 or sizes.max() > capacity):
        raise ValueError(f"item sizes must be in [0, {capacity}]")
    width = 1
    while width < max(n, 1):
        width *= 2
    room = [capacity] * (2 * width)  # segment tree: max remaining room per range of bins
    out = np.empty(n, dtype=np.int64)
    for i, s in enumerate(sizes.tolist()):
        node = 1
        while node < width:  # descend to the leftmost leaf with room >= s
            node = 2 * node if room[2 * node] >= s else 2 * node + 1
        out[i] = node - width
        room[node] -= s
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return out


def cut_tree(lengths: np.ndarray, capacity: int) -> tuple[int, int]:
    """``(kept nodes, kept tokens)`` of a tree (node lengths in preorder) cut to fit ``capacity``.

    Keeps the longest preorder prefix of whole nodes that fits (dropping the last subtrees); a root
    longer than ``capacity`` keeps its first ``capacity`` tokens.
    """
    cs = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if len(cs) == 0 or cs[-1] <= capacity:
        return len(cs), int(cs[-1]) if len(cs) else 0
    k = int(np.searchsorted(cs, capacity, side="right"))
    if k == 0:
        return 1, capacity
    return k, int(cs[k - 1])


# ------------------------------------------------------------------------------------------ sample
def build_tree_sample(docs: Sequence[TreeDoc], seq_length: int, pad_id: int = 0,
                      loss_weighting: str = "token") -> dict[str, torch.Tensor]:
    """Pack ``docs`` back to back into one row of ``seq_length`` tokens (see the module docstring)."""
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}")
    layouts, tokens, sources, targets_ok = [], [], [], []
    offset = 0
    for doc in docs:
        nodes = doc.nodes
        lay = V.from_tree(nodes.parents, nodes.lengths, nodes.bidirectional)
        if not torch.equal(lay.order, torch.arange(len(nodes.parents))):
            raise ValueError(f"{doc.name}: nodes are not in DFS preorder (every subtree must be contiguous)")
        toks = np.asarray(doc.tokens, dtype=np.int64)
        if len(toks) != lay.num_tokens:
            raise ValueError(f"{doc.name}: {len(toks)} tokens but the nodes hold {lay.num_tokens}")
        src, ok = _predecessors(nodes, offset)
        layouts.append(lay)
        tokens.append(toks)
        sources.append(src)
        targets_ok.append(ok)
        offset += len(toks)
    if offset > seq_length:
        raise ValueError(f"the trees hold {offset} tokens, more than seq_length {seq_length}")
    n = offset
    row = np.full(seq_length, pad_id, dtype=np.int64)
    pred = np.arange(seq_length, dtype=np.int64) - 1  # predecessor of each position's token (-1: none)
    weight = np.zeros(seq_length, dtype=np.float32)  # weight of each position's token as a target
    if layouts:
        lay = V.concat_layouts(layouts)
        row[:n] = np.concatenate(tokens)
        pred[:n] = np.concatenate(sources)
        w = lay.branch_weight.numpy() if loss_weighting == "branch" else np.ones(n, dtype=np.float32)
        weight[:n] = np.where(np.concatenate(targets_ok) & (pred[:n] >= 0), w, 0.0)
        start, limit, pos = V.pad(lay.start, lay.limit, seq_length, lay.position_ids)
    else:
        start, limit, pos = V.pad(torch.zeros(0, dtype=V.INDEX_DTYPE), torch.zeros(0, dtype=V.INDEX_DTYPE),
                                  seq_length, torch.zeros(0, dtype=torch.int64))
    # Slot t predicts the token at t + 1 from its predecessor's hidden state.
    label_positions = np.arange(seq_length, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    labels = np.full(seq_length, pad_id, dtype=np.int64)
    labels[:-1] = row[1:]
    live = weight[1:] > 0
    label_positions[:-1] = np.where(live, pred[1:], label_positions[:-1])
    loss_mask[:-1] = weight[1:]
    return {"tokens": torch.from_numpy(row), "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask), "position_ids": pos.to(torch.int64),
            "visibility_start": start.to(torch.int32), "visibility_limit": limit.to(torch.int32),
            "label_positions": torch.from_numpy(label_positions)}


def _predecessors(nodes: TreeNodes, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token of one tree (layout = preorder): the row position of its predecessor on its branch
    (-1 for none) and whether it may be a target (loss node, not bidirectional)."""
    lengths = nodes.lengths
    pred, ok = [], []
    last_tok = [-1] * len(lengths)  # row position of the last token on the path ending with each node
    pos = offset
    for n, (p, length) in enumerate(zip(nodes.parents, lengths)):
        before = last_tok[p] if p >= 0 else -1
        pred.extend([before] + list(range(pos, pos + length - 1)) if length else [])
        ok.extend([bool(nodes.loss[n]) and not bool(nodes.bidirectional[n])] * length)
        last_tok[n] = pos + length - 1 if length else before
        pos += length
    return np.asarray(pred, dtype=np.int64), np.asarray(ok, dtype=bool)


# ----------------------------------------------------------------------------------------- dataset
class TreeDataset(torch.utils.data.Dataset):
    """Rows of first-fit packed trees over a contiguous tree range of a ``--tree`` prefix.

    Same constructor as :class:`GPTDataset` (``indexed_indices`` are tree = document ids);
    ``config`` is a :class:`TreeDatasetConfig` (a plain :class:`GPTDatasetConfig` means token
    weighting). ``num_samples=None``: one epoch of rows.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: np.ndarray,
                 num_samples: int | None, index_split: str, config: GPTDatasetConfig) -> None:
        self.dataset, self.dataset_path, self.index_split, self.config = (indexed_dataset, dataset_path,
                                                                          index_split, config)
        self.loss_weighting = getattr(config, "tree_loss_weighting", "token")
        self.pad_id = int(config.eod_token_id) if config.eod_token_id is not None else 0
        self.sidecar = TreeSidecar(dataset_path, indexed_dataset.sequence_lengths)
        self.indices = np.asarray(indexed_indices, dtype=np.int64)
        seq = int(config.sequence_length)
        sizes = indexed_dataset.sequence_lengths[self.indices].astype(np.int64)
        self.indices, sizes = self.indices[sizes > 0], sizes[sizes > 0]
        if len(self.indices) == 0:
            raise ValueError(f"{dataset_path}: the {index_split} split has no non-empty trees")
        self.kept: dict[int, tuple[int, int]] = {}  # tree -> (kept nodes, kept tokens), for cut trees
        stats = PackingStats(trees=len(self.indices), tokens=int(sizes.sum()))
        for i in np.flatnonzero(sizes > seq).tolist():
            tree = int(self.indices[i])
            lengths = self.sidecar.node_lengths(tree)
            k, tok = cut_tree(lengths, seq)
            self.kept[tree] = (k, tok)
            stats.trees_cut += 1
            stats.nodes_dropped += len(lengths) - k
            stats.tokens_dropped += int(sizes[i]) - tok
            sizes[i] = tok
        self.sizes = sizes
        self.num_samples = num_samples
        description = to_json({
            "class": type(self).__name__, "dataset_path": os.path.abspath(dataset_path),
            **prefix_fingerprint(dataset_path),  # "idx", "bin": content, never size + mtime
            "tree": cached_file_fingerprint(tree_path(dataset_path), sampled=True).digest, "index_split": index_split,
            "documents": [int(indexed_indices[0]), int(indexed_indices[-1]) + 1] if len(indexed_indices) else [0, 0],
            "num_documents": len(indexed_indices), "num_samples": num_samples,
            "random_seed": int(config.random_seed), "sequence_length": seq, "format": 1,
        })
        cache_dir = config.path_to_cache or os.path.join(os.path.dirname(os.path.abspath(dataset_path)), "cache",
                                                         f"{type(self).__name__}_indices")
        base = f"{description_hash(description)}-{type(self).__name__}-{index_split}"
        arrays, _ = load_or_build_indices(cache_dir, base, description, _INDEX_NAMES, self._build_indices)
        self.bin_offsets, self.bin_trees, self.shuffle_index = (arrays[k] for k in _INDEX_NAMES)
        n_rows = len(self.bin_offsets) - 1
        stats.epochs = int(np.ceil(len(self.bin_trees) / len(self.indices)))
        stats.rows_per_epoch = n_rows // max(stats.epochs, 1)
        stats.fill = float(self.sizes.sum()) * stats.epochs / max(n_rows * seq, 1)
        self.stats = stats
        logger.info(stats.summary(f"{dataset_path} [{index_split}]"))

    def _build_indices(self) -> dict[str, np.ndarray]:
        t0 = time.time()
        seq = int(self.config.sequence_length)
        rng = np.random.RandomState(self.config.random_seed)
        offsets, trees = [np.zeros(1, dtype=np.int64)], []
        n_rows = 0
        while True:
            perm = rng.permutation(len(self.indices))
            bins = first_fit(self.sizes[perm], seq)
            order = np.argsort(bins, kind="stable")  # rows in opening order, trees in packing order
            counts = np.bincount(bins)
            trees.append(self.indices[perm][order])
            offsets.append(np.cumsum(counts) + (offsets[-1][-1] if n_rows else 0))
            n_rows += len(counts)
            if self.num_samples is None or n_rows >= self.num_samples:
                break
        shuffle = rng.permutation(n_rows).astype(np.int64)
        logger.info("built %s %s packing for %s: %d rows in %.2f s", type(self).__name__, self.index_split,
                    self.dataset_path, n_rows, time.time() - t0)
        return {"bin_offsets": np.concatenate(offsets), "bin_trees": np.concatenate(trees),
                "shuffle_index": shuffle}

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def tree_doc(self, tree: int) -> TreeDoc:
        """Tree ``tree`` (a document id) as packed: tokens and nodes, cut when longer than a row."""
        nodes = self.sidecar.tree(tree)
        tokens = self.dataset[tree]
        if tree in self.kept:
            k, tok = self.kept[tree]
            lengths = nodes.lengths[:k]
            lengths[-1] -= sum(lengths) - tok  # only a truncated root loses tokens inside a node
            nodes = TreeNodes(nodes.parents[:k], nodes.bidirectional[:k], nodes.loss[:k], lengths=lengths)
            tokens = tokens[:tok]
        return TreeDoc(np.asarray(tokens, dtype=np.int64), nodes, name=f"{self.dataset_path} tree {tree}")

    def trees_of_sample(self, idx: int) -> list[int]:
        """Tree (document) ids packed into sample ``idx``, in row order."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples ({self.index_split})")
        j = int(self.shuffle_index[idx])
        return [int(t) for t in self.bin_trees[int(self.bin_offsets[j]):int(self.bin_offsets[j + 1])]]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        docs = [self.tree_doc(t) for t in self.trees_of_sample(int(idx))]
        return build_tree_sample(docs, int(self.config.sequence_length), self.pad_id, self.loss_weighting)

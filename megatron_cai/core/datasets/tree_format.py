"""Tree-structured documents on disk: the JSONL node format and the ``.tree`` structure sidecar.

Input (``tools/preprocess_data.py --tree``): one tree per JSONL line, each node an object ::

    {"text": "...", "children": [<node>, ...], "bidirectional": false, "loss": true}

``children`` (default ``[]``), ``bidirectional`` (default ``false``: causal) and ``loss`` (default
``true``) are optional; other keys are ignored. Children are kept in their order.

Output: ``<prefix>.bin/.idx`` is a normal Megatron MMIDIDX pair (readable by any plain reader): one
sequence = one document per tree, holding the tree's tokens with the nodes in DFS preorder (children
in order), each node's tokens contiguous. ``<prefix>.tree`` holds the per-node structure,
little-endian::

    offset       size      field
    0            8         magic b"MCAITREE"
    8            8         version, <Q, always 1
    16           8         tree count N, <Q (= sequences in the .idx)
    24           8         node count M, <Q
    32           8         token count, <Q (= tokens in the .bin)
    40           8(N+1)    node_offsets  int64[N+1]: tree i owns nodes [node_offsets[i], node_offsets[i+1])
    40+8(N+1)    4M        parent        int32[M]: parent's index *within the tree*, -1 for the root
    40+8(N+1)+4M 4M        length        int32[M]: tokens of the node
    40+8(N+1)+8M M         flags         uint8[M]: bit 0 = bidirectional, bit 1 = loss

A tree's nodes are stored in DFS preorder, so its root is node 0, every other node's parent has a
smaller index, and the node lengths sum to the tree's sequence length in the ``.idx``. Per-token
structure follows from this (see :func:`megatron_cai.core.transformer.visibility.from_tree`). The
sidecar is written before the ``.idx`` (which is written last), and loading checks it against the
``.idx``: tree count, token count and every tree's token sum, so a stale sidecar never pairs with
a new token stream. This module needs only numpy (preprocessing workers start fast).
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_cai.core.datasets.temp_files import remove_quietly, temp_path

MAGIC = b"MCAITREE"
VERSION = 1
HEADER_SIZE = 40
FLAG_BIDIRECTIONAL = 1
FLAG_LOSS = 2

__all__ = ["TreeNodes", "TreeSidecarBuilder", "TreeSidecar", "TreeFormatError", "flatten_tree", "tree_path",
           "tree_exists", "encode_tree"]


class TreeFormatError(ValueError):
    """A tree node or a ``.tree`` sidecar is malformed; the message names the node or file."""


def tree_path(prefix: str) -> str:
    """``<prefix>.tree``."""
    return prefix + ".tree"


def tree_exists(prefix: str) -> bool:
    """True when the dataset prefix has a tree sidecar."""
    return os.path.isfile(tree_path(prefix))


@dataclass
class TreeNodes:
    """One tree, nodes in DFS preorder: local parent indices (-1 for the root), flags, per-node payload."""

    parents: list[int]
    bidirectional: list[bool]
    loss: list[bool]
    texts: list[str] | None = None
    lengths: list[int] | None = None


def flatten_tree(obj: object, text_key: str = "text") -> TreeNodes:
    """Parse one JSONL tree into preorder nodes; raises TreeFormatError naming the offending node."""
    parents: list[int] = []
    texts: list[str] = []
    bidir: list[bool] = []
    loss: list[bool] = []
    stack: list[tuple[object, int, str]] = [(obj, -1, "root")]
    while stack:
        node, parent, where = stack.pop()
        if not isinstance(node, dict):
            raise TreeFormatError(f"node {where}: expected a JSON object, got {type(node).__name__}")
        if text_key not in node:
            raise TreeFormatError(f"node {where}: missing key {text_key!r}")
        text = node[text_key]
        if not isinstance(text, str):
            raise TreeFormatError(f"node {where}: key {text_key!r} holds {type(text).__name__}, expected a string")
        children = node.get("children", [])
        if not isinstance(children, list):
            raise TreeFormatError(f"node {where}: 'children' holds {type(children).__name__}, expected a list")
        flags = []
        for key, default in (("bidirectional", False), ("loss", True)):
            value = node.get(key, default)
            if not isinstance(value, bool):
                raise TreeFormatError(f"node {where}: {key!r} holds {value!r}, expected true or false")
            flags.append(value)
        me = len(parents)
        parents.append(parent)
        texts.append(text)
        bidir.append(flags[0])
        loss.append(flags[1])
        for i in range(len(children) - 1, -1, -1):
            stack.append((children[i], me, f"{where}.children[{i}]"))
    return TreeNodes(parents, bidir, loss, texts=texts)


def encode_tree(nodes: TreeNodes, tokenize: Callable[[str], list[int]], eod: int | None = None,
                ) -> tuple[list[int], TreeNodes]:
    """Tokenize every node (``eod`` appended to each leaf, so every branch ends like a document).

    Returns the tree's token stream (nodes in preorder) and the nodes with ``lengths`` filled in.
    """
    has_child = [False] * len(nodes.parents)
    for p in nodes.parents:
        if p >= 0:
            has_child[p] = True
    stream: list[int] = []
    lengths = []
    for n, text in enumerate(nodes.texts or []):
        ids = list(tokenize(text))
        if eod is not None and not has_child[n]:
            ids.append(eod)
        stream.extend(ids)
        lengths.append(len(ids))
    return stream, TreeNodes(nodes.parents, nodes.bidirectional, nodes.loss, lengths=lengths)


def _flags(bidir: Sequence[bool], loss: Sequence[bool]) -> np.ndarray:
    b = np.asarray(bidir, dtype=np.uint8) * FLAG_BIDIRECTIONAL
    return (b | (np.asarray(loss, dtype=np.uint8) * FLAG_LOSS)).astype(np.uint8)


class TreeSidecarBuilder:
    """Collects trees (in the order their token streams go to the ``.bin``) and writes ``<prefix>.tree``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._parents: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._flags: list[np.ndarray] = []
        self._offsets = [0]
        self.tokens = 0

    def add_tree(self, nodes: TreeNodes) -> None:
        """Append one tree (nodes in preorder with ``lengths``)."""
        par = np.asarray(nodes.parents, dtype=np.int64)
        n = len(par)
        if n == 0 or par[0] != -1 or (n > 1 and not ((par[1:] >= 0) & (par[1:] < np.arange(1, n))).all()):
            raise TreeFormatError("tree nodes must be in preorder: root first (parent -1), parents before children")
        self._parents.append(par.astype(np.int32))
        self._lengths.append(np.asarray(nodes.lengths, dtype=np.int32))
        self._flags.append(_flags(nodes.bidirectional, nodes.loss))
        self._offsets.append(self._offsets[-1] + n)
        self.tokens += int(self._lengths[-1].astype(np.int64).sum())

    def finalize(self) -> None:
        """Write the sidecar atomically (temporary file + rename)."""
        self.prepare()
        self.publish()

    def prepare(self) -> None:
        """Write the sidecar under its temporary name (:meth:`publish` renames it; :meth:`abort` removes it)."""
        def cat(xs: list[np.ndarray], dt) -> np.ndarray:
            return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt)

        parents, lengths, flags = cat(self._parents, "<i4"), cat(self._lengths, "<i4"), cat(self._flags, np.uint8)
        offsets = np.asarray(self._offsets, dtype="<i8")
        tmp = temp_path(self.path)
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<QQQQ", VERSION, len(offsets) - 1, len(parents), self.tokens))
                for arr in (offsets, parents, lengths, flags):
                    f.write(arr.tobytes(order="C"))
        except BaseException:
            remove_quietly(tmp)
            raise

    def publish(self) -> None:
        os.replace(temp_path(self.path), self.path)

    def abort(self) -> None:
        remove_quietly(temp_path(self.path))


class TreeSidecar:
    """Read-only view of ``<prefix>.tree``, validated against the token stream's sequence lengths."""

    def __init__(self, prefix: str, sequence_lengths: np.ndarray | None = None, validate: bool = True) -> None:
        self.prefix = prefix
        self.path = tree_path(prefix)
        if not os.path.isfile(self.path):
            raise TreeFormatError(f"{self.path}: tree sidecar not found (write it with tools/preprocess_data.py "
                                  f"--tree)")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:8] != MAGIC:
            raise TreeFormatError(f"{self.path}: not a tree sidecar (magic {header[:8]!r}, expected {MAGIC!r})")
        version, n, m, tokens = struct.unpack("<QQQQ", header[8:HEADER_SIZE])
        if version != VERSION:
            raise TreeFormatError(f"{self.path}: unsupported version {version} (expected {VERSION})")
        expected = HEADER_SIZE + 8 * (n + 1) + 9 * m
        if size != expected:
            raise TreeFormatError(f"{self.path}: size mismatch: {n} trees and {m} nodes need {expected} bytes, the "
                                  f"file has {size} (truncated or corrupt)")
        self.tree_count, self.node_count, self.token_count = int(n), int(m), int(tokens)
        mm = np.memmap(self.path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.node_offsets = np.frombuffer(mm, dtype="<i8", count=n + 1, offset=off)
        off += 8 * (n + 1)
        self.parents = np.frombuffer(mm, dtype="<i4", count=m, offset=off)
        self.lengths = np.frombuffer(mm, dtype="<i4", count=m, offset=off + 4 * m)
        self.flags = np.frombuffer(mm, dtype=np.uint8, count=m, offset=off + 8 * m)
        if validate:
            self._validate(sequence_lengths)

    # Pickling (DataLoader workers) reopens the memory map by path instead of copying the arrays.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], validate=False)

    def _validate(self, sequence_lengths: np.ndarray | None) -> None:
        off, n, m = self.node_offsets, self.tree_count, self.node_count
        if off[0] != 0 or off[-1] != m or (np.diff(off) < 1).any():
            raise TreeFormatError(f"{self.path}: node offsets must start at 0, end at {m} and give every tree "
                                  f"at least one node")
        if (self.lengths < 0).any():
            raise TreeFormatError(f"{self.path}: negative node length at node {int(np.argmax(self.lengths < 0))}")
        tree_of = np.repeat(np.arange(n), np.diff(off))
        local = np.arange(m) - off[tree_of]
        ok = np.where(local == 0, self.parents == -1, (self.parents >= 0) & (self.parents < local))
        if not ok.all():
            i = int(np.argmax(~ok))
            raise TreeFormatError(f"{self.path}: tree {int(tree_of[i])}, node {int(local[i])}: parent "
                                  f"{int(self.parents[i])} breaks preorder (root first, parents before children)")
        sums = np.add.reduceat(self.lengths.astype(np.int64), off[:-1]) if n else np.zeros(0, np.int64)
        if int(sums.sum()) != self.token_count:
            raise TreeFormatError(f"{self.path}: node lengths sum to {int(sums.sum())}, header says "
                                  f"{self.token_count} tokens")
        if sequence_lengths is None:
            return
        if len(sequence_lengths) != n:
            raise TreeFormatError(f"{self.path}: {n} trees but the .idx has {len(sequence_lengths)} sequences "
                                  f"(stale sidecar? rerun tools/preprocess_data.py --tree)")
        bad = sums != np.asarray(sequence_lengths, dtype=np.int64)
        if bad.any():
            i = int(np.argmax(bad))
            raise TreeFormatError(f"{self.path}: tree {i} has {int(sums[i])} tokens in its nodes but the .idx "
                                  f"sequence has {int(sequence_lengths[i])} (stale sidecar?)")

    def __len__(self) -> int:
        return self.tree_count

    def tree(self, i: int) -> TreeNodes:
        """Nodes of tree ``i`` (preorder; local parent indices; ``lengths`` in tokens)."""
        a, b = int(self.node_offsets[i]), int(self.node_offsets[i + 1])
        flags = self.flags[a:b]
        return TreeNodes(parents=self.parents[a:b].tolist(),
                         bidirectional=((flags & FLAG_BIDIRECTIONAL) != 0).tolist(),
                         loss=((flags & FLAG_LOSS) != 0).tolist(), lengths=self.lengths[a:b].tolist())

    def node_lengths(self, i: int) -> np.ndarray:
        """int32 token counts of tree ``i``'s nodes (preorder)."""
        return self.lengths[int(self.node_offsets[i]):int(self.node_offsets[i + 1])]

"""Independent helpers for the tree-data tests: random JSON trees and brute-force branch views.

Nothing here uses the library's tree code: preorder, branches and predecessors are recomputed from
the nested JSON (or from ``parents``) by plain recursion.
"""
from __future__ import annotations

import json
import random


def random_json_tree(rng: random.Random, vocab: int, max_nodes: int = 7, max_len: int = 5, p_bidir: float = 0.0,
                     p_noloss: float = 0.0, p_empty: float = 0.0) -> dict:
    """A nested ``{"text", "children", ...}`` tree whose texts are whitespace-separated ids (NullTokenizer)."""
    n = rng.randint(1, max_nodes)
    nodes = []
    for i in range(n):
        length = 0 if (i > 0 and rng.random() < p_empty) else rng.randint(1, max_len)
        node = {"text": " ".join(str(rng.randrange(vocab)) for _ in range(length)), "children": []}
        if rng.random() < p_bidir:
            node["bidirectional"] = True
        if rng.random() < p_noloss:
            node["loss"] = False
        if i:
            nodes[rng.randrange(i)]["children"].append(node)
        nodes.append(node)
    return nodes[0]


def preorder(tree: dict) -> list[tuple[dict, int, int]]:
    """``(node, parent index, depth)`` in DFS preorder, children in order (recursive)."""
    out: list[tuple[dict, int, int]] = []

    def visit(node, parent, depth):
        me = len(out)
        out.append((node, parent, depth))
        for c in node.get("children", []):
            visit(c, me, depth + 1)

    visit(tree, -1, 0)
    return out


def node_ids(node: dict) -> list[int]:
    return [int(w) for w in node["text"].split()]


def tree_tokens(tree: dict, eod: int | None = None) -> tuple[list[int], list[list[int]], list[int]]:
    """(token stream in preorder, per-node ids, parents); ``eod`` ends every leaf."""
    nodes = preorder(tree)
    per_node = []
    for node, _, _ in nodes:
        ids = node_ids(node)
        if eod is not None and not node.get("children"):
            ids = ids + [eod]
        per_node.append(ids)
    return [t for ids in per_node for t in ids], per_node, [p for _, p, _ in nodes]


def branches(parents: list[int], lengths: list[int]) -> list[list[int]]:
    """For every leaf (preorder), the layout positions of its root-to-leaf tokens (preorder layout)."""
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n
    leaves = [n for n in range(len(parents)) if n not in parents]
    out = []
    for leaf in leaves:
        path, n = [], leaf
        while n != -1:
            path.append(n)
            n = parents[n]
        out.append([starts[m] + t for m in reversed(path) for t in range(lengths[m])])
    return out


def dumps(tree: dict, **extra) -> str:
    return json.dumps({**tree, **extra})


# ------------------------------------------------------------------------------ model-level helpers
def tiny_gpt(backend: str | None = None, seed: int = 0, lse_stats=None, **kw):
    """A small fp32 GPTModel (RoPE, GQA) with dropout off, for per-token loss comparisons."""
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.models.gpt.model import GPTModel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=51,
               padded_vocab_size=56, seq_length=64, max_position_embeddings=64, hidden_dropout=0.0,
               attention_dropout=0.0, init_method_std=0.2, attention_backend=backend)
    cfg.update(kw)
    model = GPTModel(GPTConfig(**cfg), lse_stats=lse_stats)
    model.initialize(seed)
    return model


def tree_rows(rng: random.Random, n_rows: int, seq: int, vocab: int, trees_per_row: int = 3, **tree_kw):
    """Rows of packed random trees: (per row: list of (stream, parents, lengths, bidir) per tree, batch)."""
    import numpy as np
    import torch

    from megatron_cai.core.datasets.tree_dataset import TreeDoc, build_tree_sample
    from megatron_cai.core.datasets.tree_format import TreeNodes

    rows, samples = [], []
    for _ in range(n_rows):
        trees, docs, used = [], [], 0
        while len(trees) < trees_per_row:
            t = random_json_tree(rng, vocab, **tree_kw)
            stream, per_node, parents = tree_tokens(t)
            if used + len(stream) > seq:
                break
            used += len(stream)
            bidir = [bool(n.get("bidirectional", False)) for n, _, _ in preorder(t)]
            lengths = [len(x) for x in per_node]
            trees.append((stream, parents, lengths, bidir))
            docs.append(TreeDoc(np.array(stream), TreeNodes(parents, bidir, [True] * len(parents), lengths=lengths)))
        rows.append(trees)
        samples.append(build_tree_sample(docs, seq, pad_id=0))
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return rows, batch


def branch_views(trees):
    """For each branch of each packed tree: (row positions of its tokens, bidirectional flag per token,
    node index per token within the branch)."""
    out, off = [], 0
    for stream, parents, lengths, bidir in trees:
        node_of = [n for n, length in enumerate(lengths) for _ in range(length)]
        for path in branches(parents, lengths):
            out.append(([off + p for p in path], [bidir[node_of[p]] for p in path], [node_of[p] for p in path]))
        off += len(stream)
    return out


def branch_visibility(bidir: list[bool], nodes: list[int]):
    """Key-side intervals of one branch fed alone (a chain of nodes), written out by hand: key j -> (j, n),
    or (first token of its node, n) inside a bidirectional node."""
    import torch

    n = len(nodes)
    start = [min(i for i in range(n) if nodes[i] == nodes[j]) if bidir[j] else j for j in range(n)]
    return torch.tensor([start], dtype=torch.int32), torch.full((1, n), n, dtype=torch.int32)


def causal_losses(model, tokens, visibility=None):
    """Per-token losses of one sequence fed alone from position 0 (slot p predicts token p + 1)."""
    import torch

    ids = torch.as_tensor(tokens).view(1, -1)
    pos = torch.arange(ids.shape[1]).view(1, -1)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    return model(ids, pos, labels=labels, visibility=visibility)[0, :-1]


def branches_alone(model, seqs: list[list[int]], bidirs: list[list[bool]], nodes: list[list[int]]):
    """Per-token losses of every branch fed alone, batched: the causal branches in one plain forward
    (right padding cannot affect earlier causal positions), the others in one forward with their
    hand-written intervals (padding keys see only themselves). Returns one loss tensor per branch."""
    import torch

    out: list = [None] * len(seqs)
    causal = [i for i, b in enumerate(bidirs) if not any(b)]
    other = [i for i, b in enumerate(bidirs) if any(b)]
    for group, plain in ((causal, True), (other, False)):
        if not group:
            continue
        width = max(len(seqs[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        start = torch.arange(width).repeat(len(group), 1)
        limit = start + 1
        for r, i in enumerate(group):
            n = len(seqs[i])
            ids[r, :n] = torch.as_tensor(seqs[i])
            if not plain:
                s, lim = branch_visibility(bidirs[i], nodes[i])
                start[r, :n], limit[r, :n] = s[0], lim[0]
        pos = torch.arange(width).repeat(len(group), 1)
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        vis = None if plain else (start.int(), limit.int())
        losses = model(ids, pos, labels=labels, visibility=vis)
        for r, i in enumerate(group):
            out[i] = losses[r, :len(seqs[i]) - 1]
    return out

"""Context parallelism's data side against independent expectations: Megatron-LM's zig-zag
(megatron-core's own get_batch_on_this_cp_rank), brute-force visible-pair counts and needed keys, and
the tree loss slots re-derived by hand."""
from __future__ import annotations

import random
import typing

import pytest
import torch

from megatron_cai.core.context_parallel.batch import shard_batch
from megatron_cai.core.context_parallel.exchange import Peers
from megatron_cai.core.context_parallel.plan import needed_keys
from megatron_cai.core.context_parallel.split import (
    balanced_split,
    imbalance,
    rank_work,
    visible_keys_per_query,
    zigzag_split,
)
from megatron_cai.core.transformer import visibility_layouts as V


def _docs(rng: random.Random, seq: int, mean: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens, total = [], 0
    while total < seq:
        n = min(max(1, int(rng.expovariate(1 / mean))), seq - total)
        lens.append(n)
        total += n
    return V.from_document_lengths(lens)


def _trees(rng: random.Random, seq: int, mean: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layouts, total = [], 0
    while True:
        n = rng.randint(2, 8)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        lengths = [max(1, int(rng.expovariate(n / mean))) for _ in range(n)]
        if total + sum(lengths) > seq:
            break
        layouts.append(V.from_tree(parents, lengths))
        total += sum(lengths)
    lay = V.concat_layouts(layouts)
    return V.pad(lay.start, lay.limit, seq, lay.position_ids)


def _tree_batch(rng: random.Random, rows: int, seq: int) -> dict[str, torch.Tensor]:
    """Rows of packed random trees through the dataset's sample builder (labels, label_positions, mask)."""
    import numpy as np

    from megatron_cai.core.datasets.tree_dataset import TreeDoc, build_tree_sample
    from megatron_cai.core.datasets.tree_format import TreeNodes

    samples = []
    for _ in range(rows):
        docs, used = [], 0
        while True:
            n = rng.randint(2, 6)
            parents, path = [-1], [0]  # preorder: a node's parent is on the path to the previous node
            for i in range(1, n):
                path = path[:rng.randint(1, len(path))]
                parents.append(path[-1])
                path.append(i)
            lengths = [rng.randint(1, 4) for _ in range(n)]
            if used + sum(lengths) > seq:
                break
            used += sum(lengths)
            nodes = TreeNodes(parents, [False] * n, [True] * n, lengths=lengths)
            docs.append(TreeDoc(np.array([rng.randrange(50) for _ in range(sum(lengths))]), nodes))
        samples.append(build_tree_sample(docs, seq, pad_id=0))
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _brute_visible(start: torch.Tensor, limit: torch.Tensor, window=None, pos=None) -> torch.Tensor:
    """[T, T] bool by explicit loops over (query i, key j)."""
    seq = start.numel()
    out = torch.zeros(seq, seq, dtype=torch.bool)
    for i in range(seq):
        for j in range(seq):
            ok = int(start[j]) <= i < int(limit[j])
            if window is not None:
                ok = ok and abs(int(pos[i]) - int(pos[j])) < window
            out[i, j] = ok
    return out


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_is_megatrons_split(cp, monkeypatch):
    typing.override = getattr(typing, "override", lambda f: f)  # megatron-core 0.19.2 targets Python >= 3.12
    mutils = pytest.importorskip("megatron.core.utils")
    seq = 8 * cp
    tokens = torch.arange(3 * seq).view(3, seq)
    split = zigzag_split(seq, cp)
    for rank in range(cp):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        theirs = mutils._get_batch_on_this_cp_rank_per_sequence_balancing({"tokens": tokens.clone()}, None)
        assert torch.equal(tokens[:, split.token_index(rank)], theirs["tokens"])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_balanced_split_of_a_causal_sequence_is_the_zigzag(cp):
    seq = 16 * cp
    start, limit = torch.arange(seq), torch.full((seq,), seq)
    assert balanced_split(start, limit, cp).chunk_owner == zigzag_split(seq, cp).chunk_owner
    work = visible_keys_per_query(start, limit)
    assert imbalance(rank_work(work, zigzag_split(seq, cp))) == 1.0  # each pair of chunks carries equal work


@pytest.mark.parametrize("kind", ["docs", "trees"])
def test_visible_pairs_per_query_match_brute_force(kind):
    rng = random.Random(3)
    start, limit = (_docs(rng, 48, 6) if kind == "docs" else _trees(rng, 48, 10)[:2])
    assert torch.equal(visible_keys_per_query(start, limit), _brute_visible(start, limit).sum(1))


@pytest.mark.parametrize("kind,cp", [("docs", 2), ("docs", 4), ("trees", 2), ("trees", 4)])
def test_balanced_split_partitions_the_sequence_and_balances_visible_pairs(kind, cp):
    rng = random.Random(cp)
    seq = 2048
    rows = [_docs(rng, seq, seq // 16) if kind == "docs" else _trees(rng, seq, seq // 16)[:2] for _ in range(2)]
    start, limit = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    split = balanced_split(start, limit, cp)
    held = torch.cat([split.token_index(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))  # every token on exactly one rank
    assert all(split.token_index(r).numel() == seq // cp for r in range(cp))
    per_query = sum(visible_keys_per_query(s, lim) for s, lim in rows)
    loads = [int(per_query[split.token_index(r)].sum()) for r in range(cp)]
    assert max(loads) / (sum(loads) / cp) <= 1.05
    assert balanced_split(start, limit, cp) == split  # deterministic


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kind", ["docs", "trees"])
def test_needed_keys_are_exactly_the_visible_remote_keys(kind, window):
    rng = random.Random(11)
    seq, cp = 32, 4
    if kind == "docs":
        start, limit = _docs(rng, seq, 5)
        pos = torch.arange(seq)
    else:
        start, limit, pos = _trees(rng, seq, 9)
    split = balanced_split(start, limit, cp)
    need = needed_keys(split, start.unsqueeze(0), limit.unsqueeze(0), window=window, position_ids=pos.unsqueeze(0))
    vis = _brute_visible(start, limit, window, pos)
    owner = split.owner_of_token
    for r in range(cp):
        queries = split.token_index(r)
        exact = vis[queries].any(0) & (owner != r)
        if window is None:
            assert torch.equal(need[r, 0], exact)
        else:  # the window test is per query block: never misses a visible key
            assert bool((need[r, 0] | ~exact).all())


def test_tree_loss_slots_follow_the_predicting_hidden_state():
    """Each slot lands on the rank that holds label_positions[t]; together the ranks hold every slot once."""
    batch = _tree_batch(random.Random(5), rows=2, seq=32)
    cp = 4
    per_rank = [shard_batch(batch, r, cp, Peers(None, tuple(range(cp)))) for r in range(cp)]
    seen = []
    for local in per_rank:
        idx = local["visibility"].local_index
        for b in range(2):
            for t in range(local["labels"].shape[1]):
                if local["loss_mask"][b, t] == 0:
                    continue
                g = int(idx[local["label_positions"][b, t]])  # global position of the predicting hidden state
                seen.append((b, g, int(local["labels"][b, t])))
    expected = [(b, int(batch["label_positions"][b, t]), int(batch["labels"][b, t]))
                for b in range(2) for t in range(32) if batch["loss_mask"][b, t] > 0]
    assert sorted(seen) == sorted(expected)
    split = per_rank[0]["visibility"].split
    t = torch.arange(32).expand(2, 32)
    moved = (split.owner_of_token[t] != split.owner_of_token[batch["label_positions"]]) & (batch["loss_mask"] > 0)
    assert bool(moved.any())  # some slot is computed away from its own position
    total = batch["loss_mask"].sum() / cp
    assert all(float(local["loss_normalizer"]) == pytest.approx(float(total)) for local in per_rank)

"""Visibility intervals: builders vs brute force, validation, block summaries."""
from __future__ import annotations

import random

import pytest
import torch
from testlib.attention import ancestors, interval_mask, random_forest, tree_truth

from megatron_cai.core.transformer import visibility as V


def _mask_1d(start, limit):
    return V.dense_mask(start.unsqueeze(0), limit.unsqueeze(0))[0]


def test_tree_fuzz_interval_mask_equals_ancestor_mask():
    """Acceptance 1: hundreds of random forests with bidirectional (and empty) nodes."""
    rng = random.Random(1234)
    n_tokens = 0
    for _ in range(400):
        parents, lengths, bidir = random_forest(rng, max_nodes=10, max_len=4, p_bidir=0.25, p_zero=0.1,
                                                max_roots=2)
        lay = V.from_tree(parents, lengths, bidir)
        order, node_of, truth, depth = tree_truth(parents, lengths, bidir)
        assert lay.order.tolist() == order
        assert lay.node_of_token.tolist() == node_of
        V.validate(lay.start, lay.limit)
        assert torch.equal(_mask_1d(lay.start, lay.limit), truth)
        assert torch.equal(interval_mask(lay.start[None], lay.limit[None])[0], truth)
        assert lay.position_ids.tolist() == depth
        n_tokens += lay.num_tokens
    assert n_tokens > 1000


def test_tree_branch_weight_and_branch_tokens():
    rng = random.Random(7)
    for _ in range(100):
        parents, lengths, bidir = random_forest(rng, max_nodes=9, max_len=3, max_roots=2)
        lay = V.from_tree(parents, lengths, bidir)
        n = len(parents)
        is_leaf = [all(parents[c] != m for c in range(n)) for m in range(n)]

        below = [sum(1 for x in range(n) if is_leaf[x] and (x == m or m in ancestors(parents, x)))
                 for m in range(n)]
        root = [m if parents[m] == -1 else [a for a in ancestors(parents, m) if parents[a] == -1][0]
                for m in range(n)]
        for t, m in enumerate(lay.node_of_token.tolist()):
            expect = below[m] / below[root[m]]
            assert abs(float(lay.branch_weight[t]) - expect) < 1e-6
        assert sorted(lay.leaves.tolist()) == [m for m in range(n) if is_leaf[m]]
        for leaf in lay.leaves.tolist():
            path = {leaf} | ancestors(parents, leaf)
            expect = [t for t, m in enumerate(lay.node_of_token.tolist()) if m in path]
            assert lay.branch_tokens(leaf).tolist() == expect


def test_tree_hand_example():
    # root(2 tokens) -> a(1, bidirectional: 2 tokens) and b(1 token); a -> c(1 token)
    lay = V.from_tree([-1, 0, 0, 1], [2, 2, 1, 1], [False, True, False, False])
    assert lay.order.tolist() == [0, 1, 3, 2]
    # tokens: r0 r1 a0 a1 c0 b0 ; subtree ends: root 6, a 5, c 5, b 6
    assert lay.start.tolist() == [0, 1, 2, 2, 4, 5]
    assert lay.limit.tolist() == [6, 6, 5, 5, 5, 6]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 2]
    assert lay.branch_weight.tolist() == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5]


def test_concat_layouts_and_pad():
    a = V.from_tree([-1, 0, 0], [2, 1, 1])
    b = V.from_tree([-1, 0], [1, 2], [True, False])
    packed = V.concat_layouts([a, b])
    s, lim, pos = V.pad(packed.start, packed.limit, 10, packed.position_ids)
    V.validate(s, lim)
    mask = _mask_1d(s, lim)
    truth = torch.zeros(10, 10, dtype=torch.bool)
    truth[:4, :4] = tree_truth([-1, 0, 0], [2, 1, 1], [False] * 3)[2]
    truth[4:7, 4:7] = tree_truth([-1, 0], [1, 2], [True, False])[2]
    for j in range(7, 10):  # padding sees only itself
        truth[j, j] = True
    assert torch.equal(mask, truth)
    assert pos.tolist() == [0, 1, 2, 2, 0, 1, 2, 0, 0, 0]
    assert packed.parents.tolist() == [-1, 0, 0, -1, 3]


def test_document_lengths_and_prefix_lm_brute_force():
    lens, bid = [3, 1, 4, 2], [False, True, True, False]
    s, lim = V.from_document_lengths(lens, bid)
    doc = [d for d, n in enumerate(lens) for _ in range(n)]
    truth = torch.tensor([[doc[i] == doc[j] and (j <= i or bid[doc[i]]) for j in range(10)]
                          for i in range(10)])
    assert torch.equal(_mask_1d(s, lim), truth)
    assert s.dtype == torch.int32 and lim.dtype == torch.int32
    assert V.document_position_ids(lens).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]

    s, lim = V.prefix_lm([2, 0, 3], [4, 2, 3])
    doc = [0] * 4 + [1] * 2 + [2] * 3
    first = [0, 4, 6]
    prefix = [2, 0, 3]
    in_pre = [i - first[doc[i]] < prefix[doc[i]] for i in range(9)]
    truth = torch.tensor(
        [[doc[i] == doc[j] and (j <= i or (in_pre[i] and in_pre[j])) for j in range(9)] for i in range(9)]
    )
    assert torch.equal(_mask_1d(s, lim), truth)
    s1, l1 = V.prefix_lm(2, 5)
    assert s1.tolist() == [0, 0, 2, 3, 4] and l1.tolist() == [5] * 5


def test_batch_pads_rows():
    r1 = V.from_document_lengths([2, 2])
    r2 = V.from_document_lengths([3])
    s, lim = V.batch([r1, r2])
    assert s.shape == (2, 4)
    assert s[1].tolist() == [0, 1, 2, 3] and lim[1].tolist() == [3, 3, 3, 4]
    V.validate(s, lim)


@pytest.mark.parametrize(
    "start,limit,needle",
    [
        ([0, 2, 2], [3, 3, 3], "position (1,)"),  # key 1 not visible to itself (start > j)
        ([0, 1, 2], [1, 1, 3], "position (1,)"),  # limit <= j
        ([-1, 1, 2], [3, 3, 3], "position (0,)"),
        ([0, 1, 2], [3, 3, 4], "position (2,)"),  # limit > seq
    ],
)
def test_validate_errors(start, limit, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        V.validate(torch.tensor(start), torch.tensor(limit))


def test_validate_batch_and_shape_errors():
    s = torch.tensor([[0, 1], [0, 2]])
    lim = torch.tensor([[2, 2], [2, 2]])
    with pytest.raises(ValueError, match=r"position \(1, 1\)"):
        V.validate(s, lim)
    with pytest.raises(ValueError, match="shape"):
        V.validate(s, lim[:, :1])
    with pytest.raises(ValueError, match="cycle"):
        V.from_tree([1, 0], [1, 1])
    with pytest.raises(ValueError, match="parents"):
        V.from_tree([-1, 5], [1, 1])


def test_window_dense_mask_brute_force():
    rng = random.Random(3)
    for _ in range(30):
        parents, lengths, bidir = random_forest(rng, max_nodes=8, max_len=4, p_bidir=0.3)
        lay = V.from_tree(parents, lengths, bidir)
        w = rng.randint(1, 6)
        args = (lay.start[None], lay.limit[None])
        got = V.dense_mask(*args, window=w, position_ids=lay.position_ids[None])
        assert torch.equal(got, interval_mask(*args, window=w, pos=lay.position_ids[None]))


def _tile_truth(mask, bq, bk):
    bsz, t, _ = mask.shape
    nq, nk = -(-t // bq), -(-t // bk)
    has = torch.zeros(bsz, nq, nk, dtype=torch.bool)
    allv = torch.zeros(bsz, nq, nk, dtype=torch.bool)
    for qb in range(nq):
        for kb in range(nk):
            tile = mask[:, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            has[:, qb, kb] = tile.flatten(1).any(1)
            allv[:, qb, kb] = tile.flatten(1).all(1)
    return has, allv


def test_block_map_sound_on_random_layouts():
    rng = random.Random(11)
    for _ in range(60):
        rows = []
        for _ in range(2):
            lays = [V.from_tree(*random_forest(rng, max_nodes=6, max_len=5, p_bidir=0.3)) for _ in range(3)]
            lay = V.concat_layouts(lays)
            rows.append((lay.start, lay.limit, lay.position_ids))
        s, lim, pos = V.batch(rows)
        bq, bk = rng.choice([(4, 4), (8, 4), (3, 5), (16, 16)])
        window = rng.choice([None, 3, 7])
        mask = interval_mask(s, lim, window, pos)
        any_, full = V.block_map(s, lim, bq, bk, window, pos)
        has, allv = _tile_truth(mask, bq, bk)
        assert torch.all(any_ | ~has), "a tile with a visible pair was skipped"
        assert torch.all(~full | allv), "a tile marked full has masked pairs"


def test_block_map_exact_for_causal_and_documents():
    s, lim = V.from_document_lengths([64])
    any_, full = V.block_map(s[None], lim[None], 16, 16)
    idx = torch.arange(4)
    assert torch.equal(any_[0], idx[:, None] >= idx[None, :])
    assert torch.equal(full[0], idx[:, None] > idx[None, :])
    s, lim = V.from_document_lengths([32, 32])
    any_, full = V.block_map(s[None], lim[None], 16, 16)
    expect = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(any_[0], expect)


def test_block_indices():
    tiles = torch.tensor([[[False, True, False, True], [False, False, False, False]]])
    num, idx = V.block_indices(tiles)
    assert num.tolist() == [[2, 0]]
    assert idx[0, 0, :2].tolist() == [1, 3]

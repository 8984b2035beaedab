"""Tree data: JSONL -> preprocess --tree -> sidecar -> first-fit packing -> samples (labels, masks, weights)."""
import os
import random
import sys

import numpy as np
import pytest
import torch
from testlib import ROOT
from testlib.tree import branches, dumps, preorder, random_json_tree, tree_tokens

from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetError
from megatron_cai.core.datasets.tree_dataset import (
    TreeDataset,
    TreeDatasetConfig,
    TreeDoc,
    build_tree_sample,
    cut_tree,
    first_fit,
)
from megatron_cai.core.datasets.tree_format import (
    TreeFormatError,
    TreeNodes,
    TreeSidecar,
    flatten_tree,
    tree_exists,
    tree_path,
)
from megatron_cai.core.transformer import visibility as V

sys.path.insert(0, os.path.join(ROOT, "tools"))

from preprocess_data import PreprocessError, preprocess  # noqa: E402

VOCAB = 50
EOD = VOCAB  # NullTokenizer's EOD


def _preprocess(tmp_path, lines, name="trees", **kw):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "data" / name)
    kw.setdefault("append_eod", True)
    stats = preprocess(str(path), out, "NullTokenizer", vocab_size=VOCAB, progress=False, log=lambda m: None, **kw)
    return stats, out + "_text_document"


def test_flatten_tree_preorder_flags_and_errors():
    tree = {"text": "r", "children": [{"text": "a", "children": [{"text": "a1"}, {"text": "a2", "loss": False}]},
                                      {"text": "b", "bidirectional": True}]}
    nodes = flatten_tree(tree)
    assert nodes.texts == ["r", "a", "a1", "a2", "b"]
    assert nodes.parents == [-1, 0, 1, 1, 0]
    assert nodes.bidirectional == [False, False, False, False, True]
    assert nodes.loss == [True, True, True, False, True]
    for bad, needle in [({"children": []}, "missing key 'text'"),
                        ({"text": "x", "children": [{"text": 3}]}, "root.children[0]: key 'text' holds int"),
                        ({"text": "x", "children": {"text": "y"}}, "'children' holds dict"),
                        ({"text": "x", "children": [{"text": "y", "loss": "no"}]}, "'loss' holds 'no'")]:
        with pytest.raises(TreeFormatError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            flatten_tree(bad)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_tree_roundtrip(tmp_path, workers):
    rng = random.Random(0)
    trees = [random_json_tree(rng, VOCAB, p_bidir=0.2, p_noloss=0.2, p_empty=0.1) for _ in range(40)]
    stats, prefix = _preprocess(tmp_path, [dumps(t, path=f"f{i}.py") for i, t in enumerate(trees)], tree=True,
                                workers=workers)
    plain = IndexedDataset(prefix)  # the plain reader sees one document per tree, nodes in preorder
    side = TreeSidecar(prefix, plain.sequence_lengths)
    assert len(plain) == len(side) == 40 and stats.documents["text"] == 40
    for i, t in enumerate(trees):
        stream, per_node, parents = tree_tokens(t, eod=EOD)
        assert plain[i].tolist() == stream
        got = side.tree(i)
        order = preorder(t)
        assert got.parents == parents and got.lengths == [len(x) for x in per_node]
        assert got.bidirectional == [bool(n.get("bidirectional", False)) for n, _, _ in order]
        assert got.loss == [bool(n.get("loss", True)) for n, _, _ in order]
    assert stats.nodes["text"] == sum(len(preorder(t)) for t in trees)
    assert "40 trees" in stats.summary("x")


def test_preprocess_tree_errors_and_stale_sidecar(tmp_path):
    with pytest.raises(PreprocessError, match=r"trees.jsonl:2: node root.children\[0\]: missing key 'text'"):
        _preprocess(tmp_path, [dumps({"text": "1 2"}), dumps({"text": "3", "children": [{}]})], tree=True)
    _, prefix = _preprocess(tmp_path, [dumps({"text": "1 2", "children": [{"text": "3"}]})], name="c", tree=True)
    assert tree_exists(prefix)
    # A plain run at the same prefix removes the now stale sidecar.
    _preprocess(tmp_path, [dumps({"text": "4 5 6"})], name="c")
    assert not tree_exists(prefix)
    # A sidecar that does not match the token stream is refused with a clear message.
    _, other = _preprocess(tmp_path, [dumps({"text": "1 2", "children": [{"text": "3 4"}]})], name="d", tree=True)
    os.replace(tree_path(other), tree_path(prefix))
    with pytest.raises(TreeFormatError, match="tree 0 has 5 tokens in its nodes but the .idx sequence has 4"):
        TreeSidecar(prefix, IndexedDataset(prefix).sequence_lengths)


def _first_fit_brute(sizes, cap):
    rooms, out = [], []
    for s in sizes:
        for b, r in enumerate(rooms):
            if r >= s:
                rooms[b] -= s
                out.append(b)
                break
        else:
            rooms.append(cap - s)
            out.append(len(rooms) - 1)
    return out


def test_first_fit_and_cut_tree():
    rng = np.random.default_rng(0)
    for cap in (1, 7, 64):
        sizes = rng.integers(0, cap + 1, size=300)
        assert first_fit(sizes, cap).tolist() == _first_fit_brute(sizes.tolist(), cap)
    with pytest.raises(ValueError):
        first_fit([3, 9], 8)
    assert cut_tree(np.array([3, 4, 2]), 10) == (3, 9)
    assert cut_tree(np.array([3, 4, 2, 5]), 10) == (3, 9)  # the last subtree goes
    assert cut_tree(np.array([3, 4, 0, 2, 5]), 7) == (3, 7)  # an empty node that still fits stays
    assert cut_tree(np.array([12, 1]), 10) == (1, 10)  # an oversized root is truncated


def _expected_slots(docs, seq, weighting):
    """Brute force from the branches: slot -> (source, label, weight)."""
    slots, off = {}, 0
    for tokens, parents, lengths, bidir, loss in docs:
        node_of = [n for n, length in enumerate(lengths) for _ in range(length)]
        leaf_paths = branches(parents, lengths)
        for path in leaf_paths:
            for a, b in zip(path, path[1:]):
                n = node_of[b]
                if bidir[n] or not loss[n]:
                    continue
                share = sum(b in p for p in leaf_paths) / len(leaf_paths)
                w = share if weighting == "branch" else 1.0
                got = slots.setdefault(off + b - 1, (off + a, tokens[b], w))
                assert got == (off + a, tokens[b], w)  # the same target never gets two predictions
        off += len(tokens)
    return slots


@pytest.mark.parametrize("weighting", ["token", "branch"])
def test_sample_labels_equal_branch_predictions(weighting):
    rng = random.Random(1)
    for trial in range(30):
        docs, tree_docs = [], []
        for _ in range(rng.randint(1, 3)):
            t = random_json_tree(rng, VOCAB, p_bidir=0.15, p_noloss=0.15, p_empty=0.15)
            stream, per_node, parents = tree_tokens(t, eod=EOD if trial % 2 else None)
            order = preorder(t)
            bidir = [bool(n.get("bidirectional", False)) for n, _, _ in order]
            loss = [bool(n.get("loss", True)) for n, _, _ in order]
            lengths = [len(x) for x in per_node]
            docs.append((stream, parents, lengths, bidir, loss))
            tree_docs.append(TreeDoc(np.array(stream), TreeNodes(parents, bidir, loss, lengths=lengths)))
        n = sum(len(d[0]) for d in docs)
        seq = n + rng.randint(0, 4)
        sample = build_tree_sample(tree_docs, seq, pad_id=7, loss_weighting=weighting)
        want = _expected_slots(docs, seq, weighting)
        for t in range(seq):
            if t in want:
                src, label, w = want[t]
                assert sample["label_positions"][t] == src and sample["labels"][t] == label
                assert sample["loss_mask"][t].item() == pytest.approx(w)
            else:
                assert sample["loss_mask"][t] == 0, (trial, t)
        assert sample["tokens"][:n].tolist() == [x for d in docs for x in d[0]]
        assert (sample["tokens"][n:] == 7).all()
        assert sample["visibility_start"].dtype == torch.int32 and sample["position_ids"].dtype == torch.int64
        V.validate(sample["visibility_start"], sample["visibility_limit"])


def test_branch_weighting_is_the_flattened_branch_mean():
    """Sum(w * l) / sum(w) over one tree = token mean over its flattened root-to-leaf branches."""
    rng = random.Random(2)
    for _ in range(20):
        t = random_json_tree(rng, VOCAB, max_nodes=9)
        stream, per_node, parents = tree_tokens(t)
        lengths = [len(x) for x in per_node]
        doc = TreeDoc(np.array(stream), TreeNodes(parents, [False] * len(parents), [True] * len(parents),
                                                  lengths=lengths))
        s = build_tree_sample([doc], len(stream), loss_weighting="branch")
        losses = torch.rand(len(stream), dtype=torch.float64)  # loss of predicting token u: losses[u]
        slot_loss = torch.zeros(len(stream), dtype=torch.float64)
        slot_loss[:-1] = losses[1:]
        tree_value = (s["loss_mask"].double() * slot_loss).sum() / s["loss_mask"].double().sum()
        flat = [losses[b] for path in branches(parents, lengths) for b in path[1:]]
        if not flat:
            assert s["loss_mask"].sum() == 0
            continue
        assert tree_value.item() == pytest.approx(torch.stack(flat).mean().item(), rel=1e-6)


def _write_corpus(tmp_path, n_trees=60, seed=3, **kw):
    rng = random.Random(seed)
    trees = [random_json_tree(rng, VOCAB, max_nodes=8, max_len=6, **kw) for _ in range(n_trees)]
    _, prefix = _preprocess(tmp_path, [dumps(t) for t in trees], tree=True)
    return trees, prefix


def test_tree_dataset_packs_every_tree_once_per_epoch(tmp_path):
    trees, prefix = _write_corpus(tmp_path)
    ds_plain = IndexedDataset(prefix)
    seq = 24
    cfg = TreeDatasetConfig(sequence_length=seq, random_seed=5, eod_token_id=EOD, path_to_cache=str(tmp_path / "c"))
    docs = np.arange(len(trees))
    ds = TreeDataset(ds_plain, prefix, docs, None, "train", cfg)
    sizes = ds_plain.sequence_lengths.astype(int)
    # One epoch: every tree in exactly one row, rows within capacity, cut trees counted.
    seen = sorted(t for i in range(len(ds)) for t in ds.trees_of_sample(i))
    assert seen == list(range(len(trees)))
    cut = [i for i in range(len(trees)) if sizes[i] > seq]
    assert ds.stats.trees_cut == len(cut) and ds.stats.epochs == 1
    dropped = 0
    for i in cut:
        k, tok = cut_tree(TreeSidecar(prefix).node_lengths(i), seq)
        dropped += sizes[i] - tok
    assert ds.stats.tokens_dropped == dropped
    for i in range(len(ds)):
        row = ds.trees_of_sample(i)
        sample = ds[i]
        expect = np.concatenate([ds_plain[t][:min(sizes[t], seq)] if t not in cut else
                                 ds_plain[t][:ds.kept[t][1]] for t in row])
        assert len(expect) <= seq
        assert sample["tokens"][:len(expect)].tolist() == expect.tolist()
        assert (sample["tokens"][len(expect):] == EOD).all()
    import pickle  # DataLoader workers: the sidecar reopens by path

    clone = pickle.loads(pickle.dumps(ds))
    assert all(torch.equal(clone[3][k], ds[3][k]) for k in ds[3])
    # More samples than one epoch: more epochs; the cache returns the same arrays.
    many = TreeDataset(ds_plain, prefix, docs, 3 * len(ds), "train", cfg)
    assert len(many) >= 3 * len(ds) and many.stats.epochs >= 3
    again = TreeDataset(ds_plain, prefix, docs, 3 * len(ds), "train", cfg)
    assert np.array_equal(again.shuffle_index, many.shuffle_index)
    assert np.array_equal(again.bin_trees, many.bin_trees)


def test_builder_formats(tmp_path):
    _, prefix = _write_corpus(tmp_path)
    _, plain_prefix = _preprocess(tmp_path, [dumps({"text": "1 2 3 4 5 6 7 8"})] * 20, name="plain")
    base = dict(sequence_length=16, random_seed=1, eod_token_id=EOD, split="90,10,0")
    auto = build_train_valid_test_datasets(prefix, "90,10,0", [10, 2, 0], TreeDatasetConfig(**base))
    assert isinstance(auto[0], TreeDataset) and isinstance(auto[1], TreeDataset) and auto[2] is None
    batch = auto[0][0]
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "visibility_start",
                          "visibility_limit", "label_positions"}
    plain = build_train_valid_test_datasets(prefix, "90,10,0", [10, 2, 0],
                                            TreeDatasetConfig(**base, data_format="plain"))
    assert not isinstance(plain[0], TreeDataset) and "label_positions" not in plain[0][0]
    with pytest.raises(IndexedDatasetError, match="mixes tree prefixes"):
        build_train_valid_test_datasets([prefix, plain_prefix], "90,10,0", [10, 2, 0], TreeDatasetConfig(**base))
    with pytest.raises(IndexedDatasetError, match="--data-format tree: .*plain_text_document.tree not found"):
        build_train_valid_test_datasets(plain_prefix, "90,10,0", [10, 2, 0],
                                        TreeDatasetConfig(**base, data_format="tree"))
    blend = build_train_valid_test_datasets([prefix, prefix], "90,10,0", [10, 2, 0], TreeDatasetConfig(**base))
    assert "label_positions" in blend[0][3]


SOURCE = '''"""Module doc."""
import os

X = 1


@decorator
def f(a):
    return a


class C(Base):
    """Class doc."""
    y = 2

    def m(self):
        return 1

    async def n(self):
        pass


if __name__ == "__main__":
    f(X)
'''


def test_make_demo_corpus_tree(tmp_path):
    import json

    import make_demo_corpus

    root = tmp_path / "lib"
    root.mkdir()
    (root / "mod.py").write_text(SOURCE)
    (root / "broken.py").write_text("def (:\n")
    out = tmp_path / "trees.jsonl"
    make_demo_corpus.make_corpus(str(out), root=str(root), tree=True)
    recs = {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["broken.py"]["text"] == "def (:\n" and "children" not in recs["broken.py"]
    t = recs["mod.py"]
    lines = SOURCE.splitlines(keepends=True)
    assert t["text"] == "".join(lines[0:6] + lines[9:11] + lines[20:])  # header: all but the definitions
    f, c = t["children"]
    assert f["text"] == "".join(lines[6:9]) and "children" not in f  # decorator included
    assert c["text"] == "".join(lines[11:15]) + "\n"
    assert [m["text"] for m in c["children"]] == ["".join(lines[15:17]), "".join(lines[18:20])]
    # Every source line is in exactly one node.
    nodes = [t, f, c, *c["children"]]
    assert sorted("".join(n["text"] for n in nodes).splitlines()) == sorted(SOURCE.splitlines())


def test_split_tree_recursive():
    import make_demo_corpus

    leaf = lambda n, k: {"text": "x" * n, "tag": k}  # noqa: E731
    cls = {"text": "c" * 10, "children": [leaf(30, "m1"), leaf(30, "m2"), leaf(30, "m3")]}
    tree = {"text": "h" * 20, "children": [leaf(40, "f"), cls]}
    parts = make_demo_corpus.split_tree(tree, 85)
    sizes = [make_demo_corpus._tree_bytes(p) for p in parts]
    assert all(s <= 85 for s in sizes)
    # Every method survives once, under a copy of its class, under a copy of the header, in order.
    flat = [(p["text"], c["text"], g.get("tag")) for p in parts for c in p["children"]
            for g in (c.get("children") or [c])]
    assert [f[2] for f in flat] == ["f", "m1", "m2", "m3"]
    assert {f[0] for f in flat} == {"h" * 20}
    assert make_demo_corpus.split_tree(tree, 10) == [tree]  # the header alone exceeds the budget

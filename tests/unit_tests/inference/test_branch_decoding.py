"""Branch decoding (acceptance 4): branches sharing one prompt decode exactly as each branch alone, and
the prompt runs through the model once (forward tokens counted at the embedding)."""
import random

import pytest
import torch
from testlib import TOOLS
from testlib.kaiju_model import kaiju_model
from testlib.tree import branch_visibility, tiny_gpt

from megatron_cai.inference.branches import TreePrompt, decode_branches
from megatron_cai.inference.generation import generate

VOCAB = 51


def _count_tokens(model):
    box = {"n": 0}

    def hook(module, args):
        box["n"] += args[0].numel()

    model.embedding.register_forward_pre_hook(hook)
    return box


@pytest.mark.parametrize("kw", [dict(attention_backend="cpu"), dict(attention_backend="eager"),
                                dict(position_embedding_type="learned_absolute", num_query_groups=1)])
def test_branches_equal_separate_decoding_and_prompt_runs_once(kw):
    model = tiny_gpt(seed=1, **kw).eval()
    counter = _count_tokens(model)
    prompt = [3, 17, 5, 42, 8, 9, 1]
    suffixes = [[4, 4, 20], [], [33], [7, 8, 9, 10, 11]]
    n_new = 12
    out = decode_branches(model, prompt, n_new, branches=suffixes, temperature=0, return_logits=True)
    width = max(map(len, suffixes))
    assert counter["n"] == out.forward_tokens == len(prompt) + len(suffixes) * (width + n_new - 1)
    for b, s in enumerate(suffixes):
        alone = generate(model, prompt + s, n_new, temperature=0, return_logits=True)
        assert torch.equal(out.new_tokens[b], alone.new_tokens[0]), b
        for step in range(n_new):
            torch.testing.assert_close(out.logits[step][b], alone.logits[step][0], atol=1e-5, rtol=1e-5)
    separate = len(suffixes) * len(prompt) + sum(map(len, suffixes)) + len(suffixes) * (n_new - 1)
    assert out.forward_tokens - len(suffixes) * (width + n_new - 1) == len(prompt) < separate


def _tree_prompt(rng, bidir_p=0.0):
    parents, lengths, bidir = [-1], [rng.randint(2, 4)], [False]
    for n in range(1, 8):
        parents.append(rng.randrange(n))
        lengths.append(rng.randint(1, 4))
        bidir.append(rng.random() < bidir_p)
    # Renumber into DFS preorder (children in index order).
    order, stack = [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed([c for c in range(len(parents)) if parents[c] == n]))
    new = {old: i for i, old in enumerate(order)}
    parents = [new[parents[o]] if parents[o] >= 0 else -1 for o in order]
    lengths, bidir = [lengths[o] for o in order], [bidir[o] for o in order]
    tokens = [rng.randrange(VOCAB) for _ in range(sum(lengths))]
    return TreePrompt(tokens, parents, lengths, bidir)


def _path(tp, node):
    starts = [sum(tp.lengths[:n]) for n in range(len(tp.lengths))]
    path, n = [], node
    while n >= 0:
        path.append(n)
        n = tp.parents[n]
    nodes = [m for m in reversed(path) for _ in range(tp.lengths[m])]
    toks = [tp.tokens[starts[m] + t] for m in reversed(path) for t in range(tp.lengths[m])]
    return toks, nodes


def test_tree_prompt_branches_see_only_their_path():
    rng = random.Random(3)
    model = tiny_gpt("cpu", seed=2).eval()
    tp = _tree_prompt(rng)
    attach = [0, 3, 7, 5, 7]
    suffixes = [[1, 2], [], [9], [], [40, 41, 42]]
    counter = _count_tokens(model)
    out = decode_branches(model, tp, 10, branches=suffixes, attach=attach, temperature=0)
    assert counter["n"] == len(tp.tokens) + len(attach) * (3 + 9)  # the whole tree prompt once
    for b, (node, s) in enumerate(zip(attach, suffixes)):
        toks, _ = _path(tp, node)
        alone = generate(model, toks + s, 10, temperature=0)  # the root-to-node path as a plain prompt
        assert torch.equal(out.new_tokens[b], alone.new_tokens[0]), b


def test_tree_prompt_with_bidirectional_nodes_matches_recompute():
    """Brute force: at every step, the argmax of a full forward over [path + suffix + generated] with the
    branch's hand-written intervals (bidirectional prompt nodes) is the next decoded token."""
    rng = random.Random(4)
    model = tiny_gpt("eager", seed=3).eval()
    tp = _tree_prompt(rng, bidir_p=0.5)
    assert any(tp.bidirectional)
    attach = list(range(len(tp.parents)))
    out = decode_branches(model, tp, 6, branches=[[5]] * len(attach), attach=attach, temperature=0)
    for b, node in enumerate(attach):
        toks, nodes = _path(tp, node)
        seq = toks + [5] + out.new_tokens[b].tolist()
        bid = [tp.bidirectional[m] for m in nodes] + [False] * (len(seq) - len(toks))
        nid = nodes + [-1 - i for i in range(len(seq) - len(toks))]
        with torch.no_grad():
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None],
                           visibility=branch_visibility(bid, nid))[0]
        for i in range(6):
            assert int(logits[len(toks) + i, :VOCAB].argmax()) == seq[len(toks) + 1 + i], (b, i)


def test_sampled_branches_seed_top_k_eos_and_errors():
    model = tiny_gpt("cpu", seed=4).eval()
    prompt = [1, 2, 3]
    greedy = decode_branches(model, prompt, 8, num_branches=3)
    assert all(torch.equal(r, greedy.new_tokens[0]) for r in greedy.new_tokens)  # same prompt, same argmax
    a = decode_branches(model, prompt, 8, num_branches=4, temperature=1.0, seed=11).new_tokens
    b = decode_branches(model, prompt, 8, num_branches=4, temperature=1.0, seed=11).new_tokens
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({tuple(x.tolist()) for x in a}) > 1  # independent samples per branch
    k1 = decode_branches(model, prompt, 8, num_branches=2, temperature=2.0, top_k=1, seed=0).new_tokens
    assert all(torch.equal(x, greedy.new_tokens[0]) for x in k1)
    eos = int(greedy.new_tokens[0][2])
    stopped = decode_branches(model, prompt, 8, num_branches=2, eos_id=eos).new_tokens
    assert stopped[0].tolist() == greedy.new_tokens[0][:3].tolist()
    with pytest.raises(ValueError, match="TreePrompt"):
        decode_branches(model, prompt, 2, num_branches=2, attach=[0, 0])
    with pytest.raises(ValueError, match="preorder"):
        decode_branches(model, TreePrompt([1, 2, 3], [-1, 2, 0], [1, 1, 1]), 2, num_branches=1)


def test_windowed_shared_branches_equal_separate_decoding():
    """A Kaiju-style model (per-layer windows of 8 positions, K/V shared across layers): branches after a prompt
    longer than the window decode as each branch alone, tokens and logits; tree branches as their path alone."""
    model = kaiju_model(seed=5)
    prompt = [(7 * i + 3) % 50 for i in range(21)]
    suffixes = [[4, 4, 20], [], [7, 8, 9, 10, 11]]
    out = decode_branches(model, prompt, 10, branches=suffixes, temperature=0, return_logits=True)
    for b, s in enumerate(suffixes):
        alone = generate(model, prompt + s, 10, temperature=0, return_logits=True)
        assert torch.equal(out.new_tokens[b], alone.new_tokens[0]), b
        for step in range(10):
            torch.testing.assert_close(out.logits[step][b], alone.logits[step][0], atol=1e-10, rtol=1e-10)
    tp = _tree_prompt(random.Random(6))
    tp.tokens = [t % 50 for t in tp.tokens]
    attach = [3, 7, 5]
    out = decode_branches(model, tp, 8, branches=[[1, 2], [], [9]], attach=attach, temperature=0)
    for b, (node, s) in enumerate(zip(attach, [[1, 2], [], [9]])):
        toks, _ = _path(tp, node)
        assert torch.equal(out.new_tokens[b], generate(model, toks + s, 8, temperature=0).new_tokens[0]), b


def test_int8_branches_equal_separate_int8_decoding():
    """With the int8 cache, branches whose suffixes have one length (so the cache blocks hold the same tokens
    as when each branch runs alone) decode as ``generate(prompt + suffix, kv_cache_dtype="int8")``; the
    prompt's int8 blocks are written once and shared (views) until the branches append."""
    from megatron_cai.core.transformer.int8_kv_cache import Int8KVCache

    model = kaiju_model(seed=7)
    prompt = [(5 * i + 1) % 50 for i in range(37)]  # two full blocks of 16 and a tail of 5
    suffixes = [[4, 20], [7, 8]]
    out = decode_branches(model, prompt, 12, branches=suffixes, temperature=0, return_logits=True,
                          kv_cache_dtype="int8")
    for b, s in enumerate(suffixes):
        alone = generate(model, prompt + s, 12, temperature=0, return_logits=True, kv_cache_dtype="int8")
        assert torch.equal(out.new_tokens[b], alone.new_tokens[0]), b
        for step in range(12):
            torch.testing.assert_close(out.logits[step][b], alone.logits[step][0], atol=1e-9, rtol=1e-9)
    bf16 = decode_branches(model, prompt, 12, branches=suffixes, temperature=0, return_logits=True)
    assert max((a - b).abs().max() for a, b in zip(out.logits, bf16.logits)) > 1e-6  # the cache was int8
    cache = Int8KVCache()
    with torch.no_grad():
        model(torch.tensor([prompt]), torch.arange(37)[None], kv_cache=cache)
    cache.expand_rows(3)
    codes = cache.stored[0][0].codes
    assert codes.shape[0] == 3 and codes.stride(0) == 0  # one copy of the prompt's codes for all rows


def test_generate_cli_branches(tmp_path):
    import contextlib
    import io
    import sys

    sys.path.insert(0, TOOLS)
    import generate as generate_tool
    from testlib.train import TINY_MODEL, train

    from megatron_cai.inference.generation import load_model

    ckpt = str(tmp_path / "ckpt")
    train(TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--train-iters", "1", "--eval-interval", "0",
                        "--eval-iters", "0", "--log-interval", "100", "--save", ckpt])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = generate_tool.main(["--load", ckpt, "--prompt", "5 6 7", "--branches", "1 2", "", "9",
                                 "--max-new-tokens", "5", "--temperature", "0"])
    assert rc == 0
    lines = buf.getvalue().strip().splitlines()
    assert lines[0::2] == ["----- branch 1 -----", "----- branch 2 -----", "----- branch 3 -----"]
    model, _ = load_model(ckpt)
    for line, suffix in zip(lines[1::2], [[1, 2], [], [9]]):
        alone = generate(model, [5, 6, 7] + suffix, 5, temperature=0)
        assert [int(x) for x in line.split()] == alone.tokens[0].tolist()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = generate_tool.main(["--load", ckpt, "--prompt", "5 6 7", "--branches", "1 2", "9 4",
                                 "--max-new-tokens", "5", "--temperature", "0", "--kv-cache-dtype", "int8"])
    assert rc == 0
    for line, suffix in zip(buf.getvalue().strip().splitlines()[1::2], [[1, 2], [9, 4]]):
        alone = generate(model, [5, 6, 7] + suffix, 5, temperature=0, kv_cache_dtype="int8")
        assert [int(x) for x in line.split()] == alone.tokens[0].tolist()

"""Acceptance 2 and 3 at model level: GPTModel losses on packed trees / documents vs each branch /
document alone; Z-Reg gradients through the model; attention dropout with visibility intervals.

Triton (under the interpreter) gets the same tree check in test_tree_model_triton.py.
"""
from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from testlib.attention import interval_mask
from testlib.tree import branch_views, branches_alone, causal_losses, tiny_gpt, tree_rows

from megatron_cai.core.datasets.gpt_dataset import get_ltor_masks_and_position_ids
from megatron_cai.core.transformer import attention as attention_mod
from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import attend
from megatron_cai.core.transformer.lse_stats import LseStatsCollector

VOCAB = 50
SEQ = 64


def _tree_losses(model, batch):
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 visibility=(batch["visibility_start"], batch["visibility_limit"]),
                 label_positions=batch["label_positions"])


def _check_branches(model, rows, batch, losses, tol=1e-5, min_checked=30):
    """Every predicted token of every branch: tree loss == loss of the branch fed alone.

    Returns ``[(row, path, keep, alone losses)]`` (keep: 1 where the prediction is in the loss)."""
    checked, found = 0, []
    for b, trees in enumerate(rows):
        views = branch_views(trees)
        alones = branches_alone(model, [batch["tokens"][b, path].tolist() for path, _, _ in views],
                                [v[1] for v in views], [v[2] for v in views])
        covered = set()
        for (path, _, _), alone in zip(views, alones):
            keep = torch.zeros(len(path) - 1)
            for p in range(len(path) - 1):
                slot = path[p + 1] - 1
                if batch["loss_mask"][b, slot] > 0:
                    assert batch["label_positions"][b, slot] == path[p]
                    torch.testing.assert_close(losses[b, slot], alone[p], atol=tol, rtol=0)
                    covered.add(slot)
                    keep[p] = 1.0
                    checked += 1
            found.append((b, path, keep, alone))
        assert covered == set(torch.nonzero(batch["loss_mask"][b] > 0).flatten().tolist())
    assert checked > min_checked
    return found


@pytest.mark.parametrize("backend", ["eager", "cpu", "flex"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_tree_losses_equal_each_branch_alone(backend, bidirectional):
    torch.manual_seed(0)
    rng = random.Random(1 + bidirectional)
    model = tiny_gpt(backend).eval()
    rows, batch = tree_rows(rng, 2, SEQ, VOCAB, trees_per_row=3, max_nodes=6, max_len=5,
                            p_bidir=0.3 if bidirectional else 0.0)
    if backend == "flex":  # FlexAttention runs forward-only (unfused) on CPU
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _check_branches(model, rows, batch, _tree_losses(model, batch))
        return
    losses = _tree_losses(model, batch)
    found = _check_branches(model, rows, batch, losses)
    # Gradients too: weighting each prediction by the number of branches it lies on gives exactly the
    # gradient of the sum of every branch's own summed loss.
    counts = torch.zeros_like(losses)
    total_alone = 0.0
    for b, path, keep, alone in found:
        total_alone = total_alone + (alone * keep).sum()
        for p in range(len(path) - 1):
            counts[b, path[p + 1] - 1] += keep[p]
    params = [p for p in model.parameters() if p.requires_grad]
    g_tree = torch.autograd.grad((losses * counts).sum(), params, retain_graph=True)
    g_alone = torch.autograd.grad(total_alone, params)
    for a, e in zip(g_tree, g_alone):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "cpu"])
def test_packed_documents_equal_each_document_alone(backend):
    """--reset-attention-mask / --reset-position-ids batches: every in-document prediction as alone."""
    torch.manual_seed(1)
    model = tiny_gpt(backend).eval()
    eod = VOCAB
    lengths = [9, 17, 5, 21, 12]
    docs = [torch.cat([torch.randint(0, VOCAB, (n - 1,)), torch.tensor([eod])]) for n in lengths]
    tokens = torch.cat(docs)[:SEQ + 1]
    extra = get_ltor_masks_and_position_ids(tokens[:-1].numpy(), eod, True, True, False)
    vis = (torch.from_numpy(extra["visibility_start"])[None], torch.from_numpy(extra["visibility_limit"])[None])
    pos = torch.from_numpy(extra["position_ids"])[None]
    losses = model(tokens[None, :-1], pos, labels=tokens[None, 1:], visibility=vis)[0]
    a = 0
    for doc in docs:
        alone = causal_losses(model, doc)
        torch.testing.assert_close(losses[a:a + len(doc) - 1], alone, atol=1e-5, rtol=0)
        a += len(doc)


def _lse_capture(monkeypatch):
    """Wrap attend so each layer's differentiable lse is kept (an independent route to the Z-Reg term)."""
    captured = []
    real = attention_mod.attend

    def wrapped(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        captured.append(lse)
        return out, lse

    monkeypatch.setattr(attention_mod, "attend", wrapped)
    return captured


@pytest.mark.parametrize("backend", ["eager", "cpu"])
def test_model_zreg_changes_gradients_not_the_loss(backend, monkeypatch):
    torch.manual_seed(2)
    rows, batch = tree_rows(random.Random(3), 1, SEQ, VOCAB, max_nodes=6, max_len=5, p_bidir=0.2)
    w, scale = 0.05, 0.5  # attention_zreg_scale = 1 / num_microbatches, set by the config builder
    collector = LseStatsCollector()

    def run(coeff, capture=False):
        collector.reset()
        model = tiny_gpt(backend, lse_stats=collector, attention_zreg_coeff=coeff, attention_zreg_scale=scale).double()
        captured = _lse_capture(monkeypatch) if capture else None
        losses = _tree_losses(model, batch)
        loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        params = list(model.parameters())
        extra = 0.0
        if capture:  # the virtual term written out: w * scale * mean over query rows of lse^2, per layer
            for lse in captured:
                extra = extra + w * scale * (lse.double() ** 2).mean()
        return losses.detach(), torch.autograd.grad(loss + extra, params), model

    base_losses, base_grads, _ = run(0.0)
    z_losses, z_grads, model = run(w)
    stats = list(collector.per_layer().values())
    ref_losses, ref_grads, _ = run(0.0, capture=True)
    assert torch.equal(z_losses, base_losses)  # the reported loss never contains the term
    assert max((a - b).abs().max().item() for a, b in zip(z_grads, base_grads)) > 1e-4
    for a, e in zip(z_grads, ref_grads):
        torch.testing.assert_close(a, e, atol=1e-8, rtol=1e-6)
    assert len(stats) == 2 and all(torch.isfinite(s).all() and s[1] >= s[0] for s in stats)


def test_attention_dropout_with_visibility_intervals():
    """Each output entry is 0 or P_ij / (1 - p) (one-hot values read P back); Z-Reg composes exactly."""
    rng = random.Random(4)
    lays = [V.from_tree(*_forest(rng)) for _ in range(3)]
    lay = V.concat_layouts(lays)
    seq = lay.num_tokens
    s, lim = V.batch([(lay.start, lay.limit)])
    mask = interval_mask(s, lim)
    q = torch.randn(1, 2, seq, seq, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, seq, seq, dtype=torch.float64, requires_grad=True)
    v = torch.eye(seq, dtype=torch.float64).view(1, 1, seq, seq)  # one-hot values: out[i, j] = D_ij P_ij / (1 - p)
    p = 0.4
    scores = (q.detach() @ k.detach().transpose(-1, -2)) / math.sqrt(seq)
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1)
    torch.manual_seed(5)
    out = attend(q, k, v, s, lim, backend="cpu", dropout_p=p)
    kept = out.detach() != 0
    torch.testing.assert_close(out.detach()[kept], (probs / (1 - p))[kept])
    assert not kept[~mask[:, None].expand_as(kept)].any()
    frac = 1 - kept[mask[:, None].expand_as(kept)].double().mean().item()
    assert abs(frac - p) < 0.08
    # Z-Reg with dropout: the extra gradient is that of w * mean(lse^2) of the undropped softmax.
    dout = torch.randn_like(out)
    torch.manual_seed(6)
    g0 = torch.autograd.grad((attend(q, k, v, s, lim, dropout_p=p) * dout).sum(), [q, k])
    torch.manual_seed(6)
    g1 = torch.autograd.grad((attend(q, k, v, s, lim, dropout_p=p, zreg_coeff=0.3) * dout).sum(), [q, k])
    sc = (q @ k.transpose(-1, -2)) / math.sqrt(seq)
    lse = torch.logsumexp(sc.masked_fill(~mask[:, None], float("-inf")), -1)
    gz = torch.autograd.grad(0.3 * (lse ** 2).mean(), [q, k])
    for a, b, z in zip(g1, g0, gz):
        torch.testing.assert_close(a - b, z, atol=1e-10, rtol=1e-8)


def _forest(rng):
    n = rng.randint(2, 6)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return parents, [rng.randint(1, 4) for _ in range(n)], [rng.random() < 0.3 for _ in range(n)]


def test_self_attention_dropout_trains_on_tree_batches():
    torch.manual_seed(7)
    rows, batch = tree_rows(random.Random(8), 2, SEQ, VOCAB, max_nodes=6, max_len=5, p_bidir=0.2)
    model = tiny_gpt("cpu", attention_dropout=0.3, attention_zreg_coeff=0.01)
    model.train()
    a = _tree_losses(model, batch)
    (a * batch["loss_mask"]).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        e1, e2 = _tree_losses(model, batch), _tree_losses(model, batch)
    assert torch.equal(e1, e2) and not torch.allclose(a.detach(), e1)  # dropout only while training

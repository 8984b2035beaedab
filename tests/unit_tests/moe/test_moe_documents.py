"""seq_aux_loss on packed rows: each document, as the visibility intervals delimit it, is its own sequence.
Checked against the documents the layouts were built from (packed causal documents, bidirectional spans, a
forest of trees, padding), against a per-document brute force of megatron-core's per-sequence formula, and
against megatron-core's own rule where each row is one document."""
from __future__ import annotations

import torch

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.transformer.moe.config import MoEConfig
from megatron_cai.core.transformer.moe.documents import document_index, documents
from megatron_cai.core.transformer.moe.router import AuxLossGradScale, TopKRouter
from megatron_cai.core.transformer.visibility import batch, from_document_lengths, from_tree


def _labels(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def test_documents_of_packed_rows_spans_trees_and_padding():
    causal = from_document_lengths([3, 1, 5, 2])
    spans = from_document_lengths([4, 3], bidirectional=[True, False])
    forest = from_tree([-1, 0, 0, 1, -1, 4], [2, 3, 1, 2, 1, 2])  # two trees: nodes 0-3 and 4-5
    start, limit = batch([causal, spans, (forest.start, forest.limit)], seq_len=13)
    idx = document_index(limit)
    assert idx[0].tolist() == _labels([3, 1, 5, 2]).tolist() + [4, 5]  # each padding token alone
    assert idx[1].tolist() == _labels([4, 3]).tolist() + list(range(2, 8))
    tree_sizes = [2 + 3 + 1 + 2, 1 + 2]
    assert idx[2].tolist() == _labels(tree_sizes).tolist() + [2, 3]
    whole = torch.full((2, 6), 6)  # no resets: one document per row
    assert document_index(whole).tolist() == [[0] * 6] * 2


def _router(**kw):
    ps.initialize_model_parallel()
    cfg = MoEConfig(num_experts=6, router_topk=2, router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1,
                    **kw)
    router = TopKRouter(cfg, 8, AuxLossGradScale())
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


def _aux(router, x, seq, rows, docs):
    router.train()
    router.metrics.clear()
    router(x, seq_length=seq, sequences=rows, docs=docs)
    return router.metrics["seq_load_balancing_loss"] * router.config.aux_loss_coeff


def test_document_aux_loss_is_the_mean_of_each_documents_own_loss():
    try:
        router = _router(router_score_function="sigmoid")
        lengths = [[5, 2, 3], [4, 6]]
        limit = torch.stack([from_document_lengths(ls)[1] for ls in lengths]).long()
        rows, seq = limit.shape
        x = torch.randn(seq * rows, 8)  # [s, b] order
        ours = _aux(router, x, seq, rows, documents(limit, slice(0, seq)))
        # brute force: megatron-core's per-sequence loss on each document's tokens alone, then the mean
        per_doc = []
        for b, ls in enumerate(lengths):
            at = 0
            for n in ls:
                tokens = x.view(seq, rows, 8)[at:at + n, b]
                per_doc.append(_aux(router, tokens, n, 1, None))
                at += n
        torch.testing.assert_close(ours, torch.stack(per_doc).mean(), rtol=1e-6, atol=0)
    finally:
        ps.destroy_model_parallel()


def test_one_document_per_row_is_megatrons_per_sequence_loss():
    try:
        router = _router()
        seq, rows = 7, 3
        x = torch.randn(seq * rows, 8, requires_grad=True)
        limit = torch.full((rows, seq), seq)
        mine = _aux(router, x, seq, rows, documents(limit, slice(0, seq)))
        (g_mine,) = torch.autograd.grad(router(x, seq, rows, documents(limit, slice(0, seq)))[0].sum(), x)
        theirs = _aux(router, x, seq, rows, None)  # megatron-core's rule (tested equal to it elsewhere)
        (g_theirs,) = torch.autograd.grad(router(x, seq, rows, None)[0].sum(), x)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
        torch.testing.assert_close(g_mine, g_theirs, rtol=1e-5, atol=1e-7)
    finally:
        ps.destroy_model_parallel()


def test_the_moe_layer_hands_its_packed_documents_to_the_router():
    """Through the layer's visibility argument (what the transformer layer passes to its MLP slot)."""
    from megatron_cai.core.transformer.moe.moe_layer import DenseShape, MoELayer

    ps.initialize_model_parallel()
    try:
        cfg = MoEConfig(num_experts=6, router_topk=2, router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1)
        layer = MoELayer(cfg, DenseShape(8, 16, 2, "relu2", False, 0.02, False))
        torch.nn.init.normal_(layer.router.weight, std=0.5)
        layer.train()
        start, limit = batch([from_document_lengths([3, 4]), from_document_lengths([2, 2, 3])])
        x = torch.randn(2, 7, 8)
        layer(x, visibility=(start, limit))
        packed = layer.router.metrics.pop("seq_load_balancing_loss")
        tokens = x.transpose(0, 1).reshape(-1, 8)
        expected = _aux(layer.router, tokens, 7, 2, documents(limit.long(), slice(0, 7))) / cfg.aux_loss_coeff
        per_row = _aux(layer.router, tokens, 7, 2, None) / cfg.aux_loss_coeff
        torch.testing.assert_close(packed, expected)
        assert abs(float(packed - per_row)) > 1e-4  # the documents changed the loss
    finally:
        ps.destroy_model_parallel()

"""Acceptance 2 on the Triton backend: GPTModel losses on a packed tree == each branch alone, with the
fused kernels run by the Triton interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be
set before triton is imported and would leak into the other tests). Tiny sizes keep it fast."""
from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
from testlib.interpreted import run_interpreted


@pytest.fixture(scope="module")
def result():
    pytest.importorskip("triton")
    return run_interpreted(__file__, timeout=300)


def test_triton_tree_losses_and_gradients_equal_branches_alone(result):
    assert result["status"] == "ok", result["status"]
    assert result["checked"] > 10


def _worker() -> dict:
    import random
    import warnings

    import torch
    from test_tree_model import _check_branches, _tree_losses
    from testlib.tree import tiny_gpt, tree_rows

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = tiny_gpt("triton", num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1).eval()
    rows, batch = tree_rows(random.Random(7), 1, 48, 50, trees_per_row=3, max_nodes=6, max_len=5, p_bidir=0.3)
    losses = _tree_losses(model, batch)
    found = _check_branches(model, rows, batch, losses, min_checked=10)
    # Backward through the fused kernel: branch-count weighted tree loss == sum of the branches' losses.
    counts, total = torch.zeros_like(losses), 0.0
    for b, path, keep, alone in found:
        total = total + (alone * keep).sum()
        for p in range(len(path) - 1):
            counts[b, path[p + 1] - 1] += keep[p]
    params = list(model.parameters())
    g_tree = torch.autograd.grad((losses * counts).sum(), params, retain_graph=True)
    for a, e in zip(g_tree, torch.autograd.grad(total, params)):
        torch.testing.assert_close(a, e, atol=5e-5, rtol=1e-4)
    checked = int(sum(k.sum() for _, _, k, _ in found))
    return {"status": "ok", "checked": checked}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [tests, os.path.dirname(tests)]  # testlib, megatron_cai
    try:
        out = _worker()
    except Exception:  # reported in the parent test
        out = {"status": traceback.format_exc()[-3000:], "checked": 0}
    print("RESULT " + json.dumps(out), flush=True)

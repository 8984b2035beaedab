"""The kernels that --compile traces as torch.library custom ops pass PyTorch's own op check
(``torch.library.opcheck``: schema and mutation declarations, the fake implementation against the real one,
the autograd registration, AOTAutograd dispatch): the blocked interval attention (forward and backward) and
the Squinch C-kernel encode and decode."""
import pytest
import torch

from megatron_cai.core.squinch import cpu_kernels
from megatron_cai.core.squinch import format as fmt
from megatron_cai.core.transformer.blocked_attention import _OP as BLOCKED

ops = torch.ops.megatron_cai


def _attention_args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    start = torch.tensor([[0] * 5 + [5] * 7])  # two packed documents of 5 and 7 tokens
    limit = torch.tensor([[5] * 5 + [12] * 7])
    return q, k, v, start, limit, None, None, 0.01, 4, 4


def test_blocked_attention_ops_pass_opcheck():
    args = _attention_args()
    torch.library.opcheck(BLOCKED.forward_op, args)
    out, lse = BLOCKED.forward_op(*args)
    q, k, v, start, limit, pos, window, coeff, tq, tk = args
    grads = (torch.randn_like(out), torch.randn_like(lse))
    torch.library.opcheck(BLOCKED.backward_op, (*grads, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                                start, limit, pos, window, coeff, tq, tk))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the Squinch C kernel did not build")
def test_squinch_cpu_ops_pass_opcheck():
    n = 100
    gen = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    payload = torch.zeros(fmt.payload_nbytes(n), dtype=torch.uint8)
    torch.library.opcheck(ops.squinch_encode, (grad, residual, payload, False, None, "cpu"))
    ops.squinch_encode(grad, residual, payload, False, None, "cpu")
    out = torch.zeros(n)
    torch.library.opcheck(ops.squinch_decode, (payload.view(1, -1).repeat(2, 1), n, out, True, "cpu"))

"""GPTModel on one process: causality, the cross entropy against torch's, padded vocab, output z-loss."""
import pytest
import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def _model(**kw) -> GPTModel:
    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, padded_vocab_size=64,
               seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.update(kw)
    m = GPTModel(GPTConfig(**cfg))
    m.initialize(3)
    return m.double()


@pytest.mark.parametrize("kw", [
    {}, {"activation": "swiglu", "normalization": "RMSNorm", "num_query_groups": 1},
    {"activation": "gelu_tanh", "position_embedding_type": "learned_absolute",
     "untie_embeddings_and_output_weights": True},
    {"activation": "gelu_erf", "add_qkv_bias": True, "add_bias_linear": False, "rope_scaling": True},
])
def test_changing_a_future_token_changes_no_earlier_logit(kw):
    m = _model(**kw)
    ids = torch.randint(0, 50, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    base = m(ids, pos)
    for t in (3, 9, 15):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 7) % 50
        out = m(changed, pos)
        assert torch.equal(out[:, :t], base[:, :t]), f"logits before position {t} changed"
        assert not torch.allclose(out[:, t], base[:, t])


def test_cross_entropy_matches_torch_and_ignores_padding_rows():
    logits = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (3, 5))
    ours = vocab_parallel_cross_entropy(logits, target, vocab_size=50)
    ref = F.cross_entropy(logits[..., :50].reshape(-1, 50), target.reshape(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(ours, ref)
    g = torch.randn(3, 5, dtype=torch.float64)
    (gl,) = torch.autograd.grad((ours * g).sum(), logits)
    (gr,) = torch.autograd.grad((ref * g).sum(), logits)
    torch.testing.assert_close(gl, gr)
    assert torch.count_nonzero(gl[..., 50:]) == 0
    bumped = logits.detach().clone()
    bumped[..., 50:] += 100.0  # padding rows never change the loss
    torch.testing.assert_close(vocab_parallel_cross_entropy(bumped, target, vocab_size=50), ours.detach())


def test_output_zreg_is_an_injected_gradient():
    logits = torch.randn(2, 7, 50, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (2, 7))
    w = 0.3
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=50, output_zreg_coeff=w)
    plain = vocab_parallel_cross_entropy(logits, target, vocab_size=50)
    assert torch.equal(loss, plain)  # the reported loss is unchanged
    g = torch.rand(2, 7, dtype=torch.float64)
    (got,) = torch.autograd.grad((loss * g).sum(), logits)
    lse = torch.logsumexp(logits, dim=-1)
    ref_loss = F.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none").view(2, 7)
    (want,) = torch.autograd.grad(((ref_loss + w * lse**2) * g).sum(), logits)
    torch.testing.assert_close(got, want)


def test_per_token_loss_equals_logits_cross_entropy():
    m = _model()
    ids = torch.randint(0, 50, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    labels = torch.randint(0, 50, (2, 16))
    loss = m(ids, pos, labels=labels)
    logits = m(ids, pos)[..., :50]
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1),
                                                     reduction="none").view(2, 16))

"""--compile traces each transformer layer as one graph: no graph break inside a layer, one graph shared by
all layers, and the traced model computes what the eager one does (Dynamo's counters; the ``aot_eager``
backend traces forward and backward through AOTAutograd without generating code, so it also checks the
custom ops' fake implementations and autograd formulas)."""
import pytest
import torch
from torch._dynamo.utils import counters

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.quantization.qat_config import QATConfig
from megatron_cai.core.transformer.compile import compile_transformer_layers
from megatron_cai.core.transformer.lse_stats import LseStatsCollector

SEQ = 16
PACKED = "packed"  # key-side intervals of packed documents (lengths 5, 7, 4)

CASES = {  # each case several features at once (one trace each: a few seconds)
    "packed_blocked_zreg_window_selective_recompute": {"visibility": PACKED, "attention_backend": "blocked",
                                                       "attention_zreg_coeff": 0.05, "window_size": 6,
                                                       "recompute_granularity": "selective"},
    "qat_fp8_hybrid_static_calibrated_in_graph": {"qat": QATConfig(fmt="fp8", clamp="static", fp8_format="hybrid")},
    "causal_sdpa_gqa_swiglu_rmsnorm_qk_norm_qat_int8_real_gemm": {
        "num_query_groups": 2, "activation": "swiglu", "normalization": "RMSNorm", "qk_layernorm": True,
        "qat": QATConfig(fmt="int8", clamp="weight-rms", gemm_backend="real", granularity="block", block_size=16)},
}


@pytest.fixture(autouse=True)
def _single_process():
    torch._dynamo.reset()  # no graph cached by an earlier test (whose other shapes would make lengths dynamic)
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def _packed_visibility(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ends = torch.tensor([5] * 5 + [12] * 7 + [SEQ] * 4)
    return torch.arange(SEQ).expand(batch, SEQ).contiguous(), ends.expand(batch, SEQ).contiguous()


def _model(**kw) -> GPTModel:
    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=SEQ,
               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
    cfg.update(kw)
    model = GPTModel(GPTConfig(**cfg), lse_stats=LseStatsCollector())
    model.initialize(1)
    return model


def _loss_and_grads(model, ids, visibility):
    pos = torch.arange(SEQ).expand(ids.shape[0], SEQ)
    loss = model(ids, pos, labels=ids.roll(-1, 1), visibility=visibility).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_layer_traces_as_one_graph_and_matches_eager(name):
    kw = dict(CASES[name])
    visibility = _packed_visibility(2) if kw.pop("visibility", None) == PACKED else None
    if name.endswith("qat_int8_real_gemm"):
        from megatron_cai.core.quantization.gemm_backends import real_gemm_available

        if not real_gemm_available("int8", "cpu", require_gpu=False):
            pytest.skip("this torch has no CPU int8 GEMM")
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    eager, traced = _model(**kw), _model(**kw)
    ref_loss, ref_grads = _loss_and_grads(eager, ids, visibility)
    assert compile_transformer_layers(traced, backend="aot_eager") == 2
    counters.clear()
    for _ in range(2):  # the second step runs the cached graph (a static clamp is calibrated by then)
        loss, grads = _loss_and_grads(traced, ids, visibility)
    assert dict(counters["graph_break"]) == {}, f"graph breaks inside a layer: {dict(counters['graph_break'])}"
    graphs = counters["stats"]["unique_graphs"]
    calibrations = 2 if kw.get("qat") is not None and kw["qat"].clamp == "static" else 1
    assert graphs == calibrations, f"{graphs} graphs for 2 layers (one per layer means a layer-specific guard)"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    if visibility is not None or kw.get("attention_zreg_coeff"):  # the lse statistics still reach the collector
        stats = traced.decoder.layers["0"].self_attention.lse_slot.value
        ref = eager.decoder.layers["0"].self_attention.lse_slot.value
        torch.testing.assert_close(stats, ref)


def test_a_second_sequence_length_recompiles_without_a_graph_break():
    """A compiled model run at a second length (evaluation, generation) is retraced with dynamic lengths:
    the causal SDPA path must still make one graph, with no break on a symbolic ``is_causal``."""
    model = _model(num_query_groups=2)
    compile_transformer_layers(model, backend="aot_eager")
    counters.clear()
    for seq in (SEQ, SEQ // 2, SEQ // 4):
        ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seq))
        pos = torch.arange(seq).expand(2, seq)
        model(ids, pos, labels=ids.roll(-1, 1)).mean().backward()
    assert dict(counters["graph_break"]) == {}, f"graph breaks inside a layer: {dict(counters['graph_break'])}"

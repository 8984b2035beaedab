"""The MoE layers in the GPT model and the training loop: the aux losses' gradients are those of the loss plus
the aux losses (attached to the router, as megatron-core does, so they need not travel to the last stage); the
loop logs Megatron's MoE values on the log line and in TensorBoard (per layer with --moe-per-layer-logging)."""
from __future__ import annotations

import contextlib
import io

import torch
from testlib.train import TINY_MODEL, train

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.transformer.moe import router as router_mod
from megatron_cai.core.transformer.moe.config import MoEConfig


def _model():
    moe = MoEConfig(num_experts=4, router_topk=2, aux_loss_coeff=0.05, z_loss_coeff=0.01, layer_freq=[0, 1, 1],
                    shared_expert_intermediate_size=8, shared_expert_gate=True)
    config = GPTConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=50, ffn_hidden_size=24,
                       seq_length=8, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, moe=moe)
    model = GPTModel(config)
    model.initialize(seed=3)
    return model.train()


def test_aux_losses_have_the_gradient_of_the_loss_plus_the_aux_losses(monkeypatch):
    ps.initialize_model_parallel()
    try:
        model = _model()
        assert [type(layer.mlp).__name__ for layer in model.decoder.layers.values()] == ["MLP", "MoELayer", "MoELayer"]
        tokens = torch.randint(0, 50, (2, 8))
        pos = torch.arange(8).expand(2, 8)
        model(tokens, pos, labels=tokens).mean().backward()
        attached = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        losses = []

        def collect(output, aux_loss, scale):  # no gradient through the scaler: the aux loss joins the loss
            losses.append(aux_loss)
            return output

        monkeypatch.setattr(router_mod.AuxLossAutoScaler, "apply", collect)
        (model(tokens, pos, labels=tokens).mean() + sum(losses)).backward()
        assert len(losses) == 4  # load balancing and z-loss in each of the two MoE layers
        for name, p in model.named_parameters():
            torch.testing.assert_close(attached[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
        assert attached["decoder.layers.1.mlp.router.weight"].abs().sum() > 0
    finally:
        ps.destroy_model_parallel()


def _scalars(tb_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_moe_values_on_the_log_line_and_in_tensorboard(tmp_path):
    argv = TINY_MODEL + ["--mock-data", "--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
                         "--log-interval", "1", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
                         "--moe-z-loss-coeff", "1e-3", "--moe-layer-freq", "2", "--moe-per-layer-logging",
                         "--tensorboard-dir", str(tmp_path / "tb")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(argv)
    lines = [line for line in out.getvalue().splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 2 and all(" load_balancing_loss: " in line and " z_loss: " in line for line in lines)
    tags = _scalars(tmp_path / "tb")
    for it, h in enumerate(result["history"], start=1):
        for name in ("load_balancing_loss", "z_loss"):
            per_layer = [tags[f"moe/{name}_layer_{i}"][it - 1][1] for i in range(4)]
            assert per_layer[1] == per_layer[3] == 0.0 and min(per_layer[0], per_layer[2]) > 0  # layers 0, 2
            assert abs(h[name] - sum(per_layer) / 2) < 1e-6  # the mean over the MoE layers
            assert abs(tags[name][it - 1][1] - h[name]) < 1e-6

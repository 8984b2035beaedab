"""--decoupled-lr: the input embedding and output layer step at their own rate (Adam's first step moves each
element by about the learning rate, so the largest change per parameter reads off the rate it got), with the
DDP optimizer and with FSDP2 (the Megatron-FSDP Llama 3 script sets --decoupled-lr)."""
import pytest
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

ARGS = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
                     "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0", "--log-interval",
                     "100", "--eval-interval", "0", "--eval-iters", "0", "--train-iters", "1"]


def _worker(rank, world_size, argv):
    box = {}

    def hook(trainer):
        box["trainer"] = trainer
        box["before"] = {n: _full(p).clone() for n, p in trainer.model[0].module.named_parameters()}

    train(argv, world_size, trainer_hook=hook)
    after = dict(box["trainer"].model[0].module.named_parameters())
    return {n: (_full(after[n]) - b).abs().max().item() for n, b in box["before"].items()}


def _full(p):
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a DTensor shard


@pytest.mark.parametrize("untie, fsdp", [(False, False), (True, False), (True, True)])
def test_embedding_and_output_use_decoupled_lr(untie, fsdp):
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    extra += ["--use-torch-fsdp2"] if fsdp else []
    change = run_distributed(_worker, 1, (ARGS + extra + ["--decoupled-lr", "4e-3"],))[0]
    special = [n for n in change if "word_embeddings" in n or "output_layer" in n]
    assert len(special) == (2 if untie else 1)
    for n, d in change.items():
        assert d == pytest.approx(4e-3 if n in special else 1e-3, rel=1e-2), n
    plain = run_distributed(_worker, 1, (ARGS + extra,))[0]
    assert all(d == pytest.approx(1e-3, rel=1e-2) for d in plain.values())


@pytest.mark.parametrize("fsdp", [False, True])
def test_mup_hidden_matrices_step_at_lr_over_m(fsdp):
    """--use-mup with m = 32 / 8: Adam's first step moves every hidden matrix by about lr / 4 and the embedding,
    output layer and 1-D parameters by lr (megatron-core's get_mup_config_overrides), through the trainer, with the
    DDP optimizer and with FSDP2."""
    extra = ["--untie-embeddings-and-output-weights", "--use-mup", "--mup-base-hidden-size", "8"]
    change = run_distributed(_worker, 1, (ARGS + extra + (["--use-torch-fsdp2"] if fsdp else []),))[0]
    hidden = [n for n in change if n.endswith("weight") and "layernorm" not in n and "norm." not in n
              and "embedding" not in n and "output_layer" not in n]
    assert len(hidden) == 5 * 4  # per layer: linear_q, linear_kv, linear_proj, linear_fc1, linear_fc2
    for n, d in change.items():
        assert d == pytest.approx(1e-3 / 4 if n in hidden else 1e-3, rel=5e-2), n  # Adam eps: tiny bias grads

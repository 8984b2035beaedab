"""DistributedAdamW's fused update against torch.optim's single-tensor AdamW / SGD on the unsharded
parameters: 20 steps with a changing learning rate and --decoupled-lr (embedding and output layer), weight
decay on matrices only, at DP = 1 and DP = 2 with the distributed optimizer (several buckets), bf16
gradient buffers, and a resume from the optimizer's state dict after 10 steps; with --use-mup (m = 4) the hidden
matrix at learning rate and epsilon / m (Adam), the vector-like parameters at learning rate x m (SGD), as
megatron-core's get_mup_config_overrides sets them."""
import pytest
import torch
from testlib.distributed import run_distributed
from torch import nn

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.reducers import build_reducer
from megatron_cai.core.optimizer.config import OptimizerConfig
from megatron_cai.core.optimizer.optimizer import DistributedAdamW

STEPS, RESUME_AT, WD, EPS = 20, 10, 0.1, 1e-3  # eps large enough that its MuP scaling shows


class _Net(nn.Module):
    """Parameter kinds the groups tell apart: decoupled matrices, plain matrices, 1-D parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.output_layer = nn.Linear(24, 50, bias=False)
        self.pre_process = True


def _lrs(step: int) -> tuple[float, float]:
    return 1e-2 * (1 + step) / STEPS, 3e-3 * (STEPS - step) / STEPS


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in _Net().named_parameters()}


def _build(kind: str, distributed: bool, bf16_grads: bool, mup: float = 1.0):
    net = _Net()
    ddp_cfg = DDPConfig(reducer="reducescatter" if distributed else "allreduce", overlap_grad_reduce=True,
                        bucket_size=700, use_distributed_optimizer=distributed, grad_reduce_in_bf16=bf16_grads)
    dp = ps.get_data_parallel_world_size()
    ddp = DistributedDataParallel(net, build_reducer(ddp_cfg, ps.get_data_parallel_group(), dp), ddp_cfg,
                                  device=torch.device("cpu"))
    opt = DistributedAdamW([ddp], OptimizerConfig(lr=1e-2, weight_decay=WD, optimizer=kind, sgd_momentum=0.9,
                                                  adam_beta2=0.95, use_distributed_optimizer=distributed,
                                                  adam_eps=EPS, mup_width_mult=mup))
    return net, ddp, opt


def _reference(kind: str, bf16_grads: bool, mup: float = 1.0) -> list[dict[str, torch.Tensor]]:
    """torch.optim over the full parameters; the same groups and learning rates, step by step (MuP, written out:
    Adam's proj.weight at lr / m and eps / m; SGD's vector-like parameters (all but proj.weight) at lr x m)."""
    net = _Net()
    named = dict(net.named_parameters())
    decoupled = {"embedding.word_embeddings.weight", "output_layer.weight"}
    scaled = set() if mup == 1.0 else {"proj.weight"} if kind == "adam" else set(named) - {"proj.weight"}
    groups = [{"params": [p for n, p in named.items()
                          if (n in decoupled) == dec and (p.dim() > 1) == decay and (n in scaled) == mu],
               "weight_decay": WD if decay else 0.0, "decoupled": dec, "mup": mu,
               "eps": EPS / mup if mu and kind == "adam" else EPS}
              for dec in (False, True) for decay in (False, True) for mu in (False, True)]
    groups = [g for g in groups if g["params"]]
    if kind == "adam":
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=False)
    out = []
    for step in range(STEPS):
        lr, lr_emb = _lrs(step)
        for g in opt.param_groups:
            g["lr"] = lr_emb if g["decoupled"] and kind == "adam" else lr
            if g["mup"]:
                g["lr"] = lr / mup if kind == "adam" else lr * mup
        for n, grad in _grads(step).items():
            named[n].grad = grad.bfloat16().float() if bf16_grads else grad
        opt.step()
        out.append({n: p.detach().clone() for n, p in named.items()})
    return out


def _worker(rank, world_size, kind, distributed, bf16_grads, mup=1.0):
    ps.initialize_model_parallel()
    net, ddp, opt = _build(kind, distributed, bf16_grads, mup)
    names = [{id(p): n for n, p in net.named_parameters()}]
    out = []
    for step in range(STEPS):
        if step == RESUME_AT:  # a fresh optimizer from the state dict (the checkpoint's), same parameters
            state = opt.state_dict(names)
            params = {n: p.detach().clone() for n, p in net.named_parameters()}
            net, ddp, opt = _build(kind, distributed, bf16_grads, mup)
            with torch.no_grad():
                for n, p in net.named_parameters():
                    p.copy_(params[n])
            names = [{id(p): n for n, p in net.named_parameters()}]
            opt.load_state_dict(state, names)
        grads = _grads(step)
        for n, p in net.named_parameters():
            p.main_grad.copy_(grads[n])  # the DP-mean gradient, identical on every rank
        opt.step(*_lrs(step))
        opt.finish_param_sync()
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


@pytest.mark.parametrize("kind,world,distributed,bf16_grads,mup", [
    ("adam", 1, False, False, 1.0), ("adam", 2, True, False, 1.0), ("adam", 1, False, True, 1.0),
    ("sgd", 2, True, False, 1.0), ("adam", 1, False, False, 4.0), ("sgd", 1, False, False, 4.0),
], ids=["adam_dp1", "adam_dp2_distributed", "adam_dp1_bf16_grads", "sgd_dp2_distributed", "adam_mup", "sgd_mup"])
def test_fused_update_matches_torch_optim(kind, world, distributed, bf16_grads, mup):
    expected = _reference(kind, bf16_grads, mup)
    for rank, got in enumerate(run_distributed(_worker, world, (kind, distributed, bf16_grads, mup))):
        for step, (g, e) in enumerate(zip(got, expected)):
            for n in e:
                torch.testing.assert_close(g[n], e[n], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, n=n, s=step, r=rank: f"rank {r} step {s + 1} {n}: {m}")


def test_a_checkpoint_of_the_previous_optimizer_loads_and_steps_like_torch_adamw(tmp_path):
    """The fixture was saved by the unfused optimizer (commit db88585): its Adam state loads unchanged, and
    the next fused step equals torch.optim.AdamW continuing from that state."""
    import shutil

    import pretrain_gpt
    from megatron_cai.training.training import Trainer
    from unit_tests.training.test_config import FIXTURE, FIXTURE_FLAGS

    root = str(tmp_path / "old")
    shutil.copytree(FIXTURE, root)
    saved = torch.load(f"{root}/iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=False)["optimizer"]
    config, tokenizer = pretrain_gpt.build_run(FIXTURE_FLAGS + ["--train-iters", "3", "--load", root,
                                                                "--no-exit-signal-handler",
                                                                # it predates content hashes and plain-data saves
                                                                "--allow-unverified-checkpoint",
                                                                "--trust-checkpoint-code"], world_size=1)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    opt, module = trainer.optimizer, trainer.model[0].module
    named = dict(module.named_parameters())
    state = opt.state_dict([{id(p): n for n, p in named.items()}])
    assert state["step"] == saved["step"] == 2
    for n, s in saved["param_state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["param_state"][n][k], s[k]), f"{n} {k}"
    ref_params = {n: p.detach().clone().requires_grad_() for n, p in named.items()}
    ref = torch.optim.AdamW([{"params": [p for p in ref_params.values() if p.dim() > 1], "weight_decay": 0.01},
                             {"params": [p for p in ref_params.values() if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for n, p in named.items():
        grad = torch.randn(p.shape, generator=gen)
        p.main_grad.copy_(grad)
        ref_params[n].grad = grad.clone()
        ref.state[ref_params[n]] = {"step": torch.tensor(2.0), **{k: v.clone() for k, v in
                                                                  saved["param_state"][n].items()}}
    opt.step(1e-3, 1e-3)
    ref.step()
    for n, p in named.items():
        torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-6, atol=1e-7, msg=n)

"""LR schedules against megatron-core's own OptimizerParamScheduler (hand-computed values where not installed)."""
import math

import pytest

from megatron_cai.core.optimizer.config import SchedulerConfig
from megatron_cai.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError

BASE = ["--squared-relu", "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16",
        "--num-attention-heads", "2", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-5"]


def _megatron_mup_group(cfg: SchedulerConfig, width_mult: float) -> dict:
    """The peak and minimum rate of megatron-core's MuP group (get_mup_config_overrides, Adam)."""
    moptim = pytest.importorskip("megatron.core.optimizer")
    overrides = moptim.get_mup_config_overrides(moptim.OptimizerConfig(lr=cfg.lr, min_lr=cfg.min_lr), width_mult,
                                                "adam")
    if not overrides:  # m = 1
        return {"params": []}
    (group,) = overrides.values()
    return {"params": [], "max_lr": group["max_lr"], "min_lr": group["min_lr"]}


def _megatron_lrs(cfg: SchedulerConfig, increments: list[int], width_mult: float = 1.0
                  ) -> list[tuple[float, float, float]]:
    """The (default, decoupled, MuP) rate that megatron-core's scheduler sets for each iteration."""
    mcore = pytest.importorskip("megatron.core.optimizer_param_scheduler")

    class _Opt:
        param_groups = [{"params": []},
                        {"params": [], "max_lr": cfg.decoupled_lr if cfg.decoupled_lr is not None else cfg.lr,
                         "min_lr": cfg.decoupled_min_lr if cfg.decoupled_min_lr is not None else cfg.min_lr},
                        _megatron_mup_group(cfg, width_mult)]

    sched = mcore.OptimizerParamScheduler(
        _Opt(), init_lr=cfg.lr_warmup_init, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_samples,
        lr_decay_steps=cfg.lr_decay_samples, lr_decay_style=cfg.lr_decay_style, start_wd=0.1, end_wd=0.1,
        wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=cfg.lr_wsd_decay_samples,
        lr_wsd_decay_style=cfg.lr_wsd_decay_style)
    out = []
    for inc in increments:  # Megatron: the step uses the rate set by the previous scheduler.step(increment)
        out.append(tuple(g["lr"] for g in _Opt.param_groups))
        sched.step(increment=inc)
    return out


def _ours(cfg: SchedulerConfig, increments: list[int]) -> list[tuple[float, float]]:
    s = OptimizerParamScheduler(cfg)
    out = []
    for inc in increments:
        out.append((s.get_lr(), s.get_lr(decoupled=True), s.get_lr(mup=True)))
        s.step(inc)
    return out


CASES = {
    "linear": (["--train-iters", "40", "--lr-warmup-iters", "5", "--lr-decay-style", "linear"], 40),
    "cosine_decay_iters": (["--train-iters", "40", "--lr-warmup-iters", "4", "--lr-decay-style", "cosine",
                            "--lr-decay-iters", "30"], 40),
    "inverse_sqrt": (["--train-iters", "40", "--lr-warmup-iters", "6", "--lr-decay-style", "inverse-square-root"],
                     40),
    "wsd_exponential": (["--train-iters", "40", "--lr-warmup-iters", "4", "--lr-decay-style", "WSD",
                         "--lr-wsd-decay-iters", "10"], 40),
    "wsd_minus_sqrt_decoupled": (["--train-iters", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "12",
                                  "--lr-wsd-decay-style", "minus_sqrt", "--decoupled-lr", "3e-3",
                                  "--decoupled-min-lr", "2e-4", "--lr-warmup-fraction", "0.1"], 40),
    "samples_cosine_warmup_init": (["--train-samples", "300", "--lr-warmup-samples", "37", "--lr-decay-samples",
                                    "250", "--lr-decay-style", "cosine", "--lr-warmup-init", "1e-4"], None),
    # --use-mup, m = 16 / 4: the MuP group's peak and minimum / 4 (the warmup still starts at --lr-warmup-init)
    "mup_samples_cosine_warmup_init": (["--train-samples", "300", "--lr-warmup-samples", "37", "--lr-decay-samples",
                                        "250", "--lr-decay-style", "cosine", "--lr-warmup-init", "1e-4",
                                        "--use-mup", "--mup-base-hidden-size", "4"], None),
    "mup_linear_decoupled": (["--train-iters", "40", "--lr-warmup-iters", "5", "--lr-decay-style", "linear",
                              "--decoupled-lr", "3e-3", "--use-mup", "--mup-base-hidden-size", "8"], 40),
    "samples_wsd_linear_decoupled": (["--train-samples", "300", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples",
                                      "90", "--lr-wsd-decay-style", "linear", "--decoupled-lr", "5e-4"], None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_megatron_core(name):
    flags, _ = CASES[name]
    config = parse_config(BASE + ["--global-batch-size", "8"] + flags, world_size=1)
    cfg = config.scheduler
    increments = [8] * config.training.train_iters
    width_mult = 16 / config.flags["mup_base_hidden_size"] if config.flags["use_mup"] else 1.0
    ours, theirs = _ours(cfg, increments), _megatron_lrs(cfg, increments, width_mult)
    assert len(set(ours)) > 3  # the schedule moves
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), f"iteration {i + 1}"
    if width_mult == 1.0:  # no MuP: the MuP group is the default one
        assert all(a[2] == a[0] for a in ours)


@pytest.mark.parametrize("flags,expected", [
    (["--train-iters", "40", "--lr-warmup-iters", "5", "--lr-decay-iters", "30", "--lr-decay-style", "WSD",
      "--lr-wsd-decay-iters", "10"], (40, 240, 80)),
    (["--train-iters", "40", "--lr-warmup-fraction", "0.1"], (32.0, 320, None)),
    (["--train-samples", "300", "--lr-warmup-samples", "37", "--lr-decay-style", "WSD",
      "--lr-wsd-decay-samples", "90"], (37, 300, 90)),
    (["--train-samples", "300", "--lr-decay-samples", "200", "--lr-warmup-fraction", "0.25"], (50.0, 200, None)),
])
def test_lengths_follow_megatron_rules(flags, expected):
    """Megatron's get_optimizer_param_scheduler: iteration flags x global batch (8), or sample flags as given."""
    cfg = parse_config(BASE + ["--global-batch-size", "8"] + flags, world_size=1).scheduler
    assert (cfg.lr_warmup_samples, cfg.lr_decay_samples, cfg.lr_wsd_decay_samples) == expected


def test_hand_computed_values():
    """Independent of megatron-core: WSD exponential and inverse-square-root at chosen points."""
    cfg = SchedulerConfig(lr=1.0, min_lr=0.1, lr_warmup_samples=10, lr_decay_samples=100, lr_decay_style="WSD",
                          lr_wsd_decay_samples=20, lr_wsd_decay_style="exponential")
    s = OptimizerParamScheduler(cfg)
    assert s.get_lr(num_steps=0) == 0.0 and s.get_lr(num_steps=5) == 0.5  # warmup from init_lr 0
    assert s.get_lr(num_steps=80) == 1.0  # stable until decay_steps - wsd_decay_steps
    assert s.get_lr(num_steps=90) == pytest.approx(0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1))
    assert s.get_lr(num_steps=100) == pytest.approx(0.1) and s.get_lr(num_steps=101) == 0.1
    isr = OptimizerParamScheduler(SchedulerConfig(lr=1.0, min_lr=0.0, lr_warmup_samples=16, lr_decay_samples=1000,
                                                   lr_decay_style="inverse-square-root"))
    assert isr.get_lr(num_steps=64) == pytest.approx(0.5) and isr.get_lr(num_steps=400) == pytest.approx(0.2)


def test_sample_flags_need_train_samples_and_wsd_needs_length():
    with pytest.raises(ArgumentError, match="--lr-decay-samples needs sample-based"):
        parse_config(BASE + ["--train-iters", "10", "--lr-decay-samples", "40"], world_size=1)
    with pytest.raises(ArgumentError, match="WSD needs --lr-wsd-decay-iters"):
        parse_config(BASE + ["--train-iters", "10", "--lr-decay-style", "WSD"], world_size=1)


def test_old_iteration_checkpoint_state_is_rescaled():
    s = OptimizerParamScheduler(SchedulerConfig(lr=1.0, lr_decay_samples=800, lr_decay_style="linear"))
    s.load_state_dict({"num_steps": 25, "decay_steps": 100})  # an iteration-counting checkpoint, batch 8
    assert s.num_steps == 200 and math.isclose(s.get_lr(), 0.75)

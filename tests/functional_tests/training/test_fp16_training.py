"""--fp16 training: overflows skip the step and are counted, the loss scale is unscaled exactly, state resumes."""
import math

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3",
                     "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--seed", "5",
                     "--lr-warmup-iters", "2"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(argv, world=1):
    return run_distributed(_worker, world, (BASE + argv,))[0]


def _megatron_trajectory(skipped, initial, window, hysteresis, min_scale=1.0):
    """Megatron's DynamicGradScaler.update, written out independently: the scale after each iteration."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for s in skipped:
        if s:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale / 2, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2
        out.append(scale)
    return out


def test_overflow_skips_counts_and_backs_off():
    r = _run(["--fp16", "--initial-loss-scale", str(2.0 ** 40), "--loss-scale-window", "4", "--hysteresis", "2",
              "--train-iters", "24"])
    hist = r["history"]
    skipped = [h["skipped"] for h in hist]
    # 2**40 overflows fp16 (max 65504) in the backward; the scale must come down before steps are taken
    assert skipped[0] and skipped[1] and not all(skipped)
    assert r["skipped"] == sum(skipped)
    assert [h["loss scale"] for h in hist] == _megatron_trajectory(skipped, 2.0 ** 40, 4, 2)
    assert max(h["loss scale"] for h in hist[-8:]) > min(h["loss scale"] for h in hist[-8:])  # grew again
    assert all(math.isfinite(h["lm loss"]) for h in hist)
    assert all(math.isnan(h["grad norm"]) or math.isinf(h["grad norm"]) for h in hist if h["skipped"])


def test_static_scale_is_undone_exactly():
    """--loss-scale 1024 and 1 give the same gradient norms and losses (the grads are unscaled, fp32 master)."""
    a = _run(["--fp16", "--loss-scale", "1", "--train-iters", "6"])["history"]
    b = _run(["--fp16", "--loss-scale", "1024", "--train-iters", "6"])["history"]
    ref = _run(["--train-iters", "6"])["history"]  # fp32
    for x, y, z in zip(a, b, ref):
        assert y["grad norm"] == pytest.approx(x["grad norm"], rel=2e-3)
        assert y["lm loss"] == pytest.approx(x["lm loss"], rel=1e-3)
        assert x["lm loss"] == pytest.approx(z["lm loss"], rel=1e-2)  # fp16 autocast close to fp32
    assert not any(h["skipped"] for h in a + b)


def test_loss_scale_resumes_from_checkpoint(tmp_path):
    args = ["--fp16", "--initial-loss-scale", str(2.0 ** 24), "--loss-scale-window", "3", "--train-iters", "10"]
    straight = _run(args)["history"]
    save = str(tmp_path / "ckpt")
    _run(args + ["--save", save, "--exit-interval", "5"])
    second = _run(args + ["--load", save])["history"]
    assert [h["loss scale"] for h in second] == [h["loss scale"] for h in straight[5:]]
    assert [h["lm loss"] for h in second] == [h["lm loss"] for h in straight[5:]]


def test_fp16_and_bf16_exclusive():
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.config import ArgumentError

    with pytest.raises(ArgumentError, match="--fp16 and --bf16"):
        parse_config(BASE + ["--fp16", "--bf16", "--train-iters", "1"], world_size=1)


def _residual_worker(rank, world_size, argv):
    held = {}
    out = train(argv, world_size, trainer_hook=lambda t: held.setdefault("trainer", t))
    trainer = held["trainer"]
    residuals = {k: v.clone() for m in trainer.model for k, v in m.reducer.feedback.residuals.items()}
    return {"residuals": residuals, "scale": trainer.grad_scaler.scale, "skipped": out["skipped"]}


def test_squinch_error_feedback_follows_a_loss_scale_change():
    """Squinch residuals are cut from loss-scaled gradients. Step 1 is identical under a constant scale S
    and under a dynamic one starting at S that grows to 2S after it (--loss-scale-window 1), so the dynamic
    run's residuals after the growth must be exactly twice the constant run's."""
    common = ["--fp16", "--squinch", "--train-iters", "1", "--global-batch-size", "8"]
    const = run_distributed(_residual_worker, 2, (BASE + common + ["--loss-scale", "1024"],))
    grown = run_distributed(_residual_worker, 2, (BASE + common + ["--initial-loss-scale", "1024",
                                                                   "--loss-scale-window", "1"],))
    for c, g in zip(const, grown):
        assert c["skipped"] == g["skipped"] == 0
        assert (c["scale"], g["scale"]) == (1024.0, 2048.0)
        assert c["residuals"] and c["residuals"].keys() == g["residuals"].keys()
        for k in c["residuals"]:
            assert c["residuals"][k].abs().sum() > 0
            assert torch.equal(g["residuals"][k], 2 * c["residuals"][k]), k

"""The --fp16 loss scalers follow Megatron-LM's rules on a hand-computed trajectory."""
import pytest

from megatron_cai.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    LossScaleConfig,
    build_grad_scaler,
)


def test_dynamic_scale_follows_hand_computed_trajectory():
    # initial 16, min 1, window 3, hysteresis 2. By hand: two overflows before the first halving, then every
    # further overflow halves (the hysteresis counter is only refilled by a growth); 3 clean steps double.
    s = DynamicGradScaler(16.0, 1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2)
    overflow = [1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    expected = [16, 8, 4, 4, 4, 8, 8, 8, 4, 2, 1, 1, 1, 1, 2, 2, 2, 4]
    got = []
    for o in overflow:
        s.update(bool(o))
        got.append(s.scale)
    assert got == expected
    assert s.inv_scale == 0.25


def test_overflow_resets_growth_window():
    s = DynamicGradScaler(8.0, 1.0, growth_interval=2, hysteresis=1)
    for o in (0, 1, 0, 0):  # the overflow restarts the 2-step window: 8 -> 4, then 4 -> 8 after 2 clean
        s.update(bool(o))
    assert s.scale == 8.0


def test_state_round_trip_and_megatron_defaults():
    s = build_grad_scaler(LossScaleConfig())
    assert isinstance(s, DynamicGradScaler)
    assert (s.scale, s.min_scale, s.growth_interval, s.hysteresis) == (2.0 ** 32, 1.0, 1000, 2)
    s.update(True)
    t = build_grad_scaler(LossScaleConfig())
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.hysteresis_tracker, t.growth_tracker) == (2.0 ** 32, 1, 0)
    c = build_grad_scaler(LossScaleConfig(loss_scale=128.0))
    assert type(c) is ConstantGradScaler
    c.update(True)
    assert c.scale == 128.0


@pytest.mark.parametrize("kwargs", [dict(initial_scale=1.0, min_scale=2.0), dict(initial_scale=4.0, min_scale=1.0,
                                    hysteresis=0), dict(initial_scale=4.0, min_scale=1.0, growth_interval=0)])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError):
        DynamicGradScaler(**kwargs)

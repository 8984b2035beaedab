"""Start-up checks of generation lengths against the trained context and the learned positions."""
from __future__ import annotations

from megatron_cai.training import startup_checks


def test_generation_length_rules():
    assert "must be >= 0" in startup_checks.generation_length(3, -1, 16, 16, False)[0]
    assert startup_checks.generation_length(3, 13, 16, 16, False) == (None, None)
    err, warn = startup_checks.generation_length(3, 14, 16, 16, False)
    assert err is None and "past the trained context of 16" in warn
    err, warn = startup_checks.generation_length(3, 14, 16, 16, True)
    assert "exceeds the 16 learned positions" in err
    assert startup_checks.position_limit(16, 16) is None and "--seq-length 17" in startup_checks.position_limit(17, 16)

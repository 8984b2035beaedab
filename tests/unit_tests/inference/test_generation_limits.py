"""Generation lengths against the trained context and the learned positions: an error or a warning."""
from __future__ import annotations

from megatron_cai.inference.generation import generation_length


def test_generation_length_rules():
    assert "must be >= 0" in generation_length(3, -1, 16, 16, False)[0]
    assert generation_length(3, 13, 16, 16, False) == (None, None)
    err, warn = generation_length(3, 14, 16, 16, False)
    assert err is None and "past the trained context of 16" in warn
    err, warn = generation_length(3, 14, 16, 16, True)
    assert "exceeds the 16 learned positions" in err

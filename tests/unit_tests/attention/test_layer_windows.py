"""Per-layer sliding windows (--window-size, --window-attn-skip-freq): which layers are local is megatron-core
0.19.2's decision, and every layer's attention equals a brute-force masked reference (causal text, packed
documents, trees; forward and backward) on the CPU kernel (fp64, to 1e-6 absolute) and on Triton under the
interpreter (fp64 inputs computed in fp32, to 1e-6 of each tensor's largest magnitude).

The Triton checks run in a subprocess (this file as a script) with TRITON_INTERPRET=1 at small sizes.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_cai.core.transformer.layer_pattern import LayerPatternError, parse_int_or_pattern

PATTERNS = ["6", "([1]*5+[0])*2", "[1,1,0]*4", "[0]+[1]*11", "([1]*3+[0]*1)*3", "[1,0,1]*2*2", "(([1]*2))*6",
            "2*[1,0]*3"]


def _megatron_freq(text):
    from testlib.layer_attention import megatron_freq

    return megatron_freq(text)


@pytest.mark.parametrize("text", PATTERNS)
def test_pattern_reads_as_megatron_evaluates_it(text):
    assert parse_int_or_pattern(text) == _megatron_freq(text)


@pytest.mark.parametrize("text", ["__import__('os')", "[1]*", "[1,,0]", "[[1]]", "[1]+1", "[1]*[2]", "1e3", "[1, 0]"])
def test_pattern_that_is_not_data_is_refused(text):
    with pytest.raises(LayerPatternError, match="invalid pattern"):
        parse_int_or_pattern(text)


@pytest.mark.parametrize("window,freq", [(7, f) for f in ("1", "2", "3", "6", "12", "13", "([1]*5+[0])*2",
                                                           "[0]+[1]*11", "[1]*12", "[0,1]*6", None)] + [(None, None)])
def test_global_layers_equal_megatron_core(window, freq):
    """The flags through our parser and config into built layers: each layer's window is megatron-core's."""
    from testlib.layer_attention import megatron_windows

    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.model import GPTModel
    from megatron_cai.training.arguments import parse_config

    argv = ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--num-layers", "12", "--hidden-size", "32",
            "--num-attention-heads", "2"]
    argv += ["--window-size", str(window)] if window else []
    argv += ["--window-attn-skip-freq", freq] if freq else []
    config = parse_config(argv, world_size=1).model
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    model = GPTModel(config)
    built = [model.decoder.layers[str(n)].self_attention.window for n in range(12)]
    expected = megatron_windows(window, _megatron_freq(freq) if freq else None, 12)
    assert built == expected
    if window:  # the pattern really mixes kinds where it should
        assert (None in built) == (freq is not None and freq != "[1]*12" and freq != "13")


@pytest.mark.parametrize("argv,match", [
    (["--window-attn-skip-freq", "2"], "needs --window-size"),
    (["--window-size", "4", "--window-attn-skip-freq", "[1,0]"], "must hold 4 entries"),
    (["--window-size", "4", "--window-attn-skip-freq", "[1,2,1,0]"], "each 1"),
    (["--window-size", "4", "--window-attn-skip-freq", "0"], "must be >= 1"),
])
def test_bad_window_pattern_is_one_flag_error(argv, match):
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.errors import UserError

    with pytest.raises(UserError, match=match):
        parse_config(["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--num-layers", "4", *argv],
                     world_size=1)


def _tiny(skip_freq, backend, num_layers=3, window=5, **kw):
    from testlib.tree import tiny_gpt

    model = tiny_gpt(backend, num_layers=num_layers, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                     kv_channels=16, add_bias_linear=False, window_size=window, window_attn_skip_freq=skip_freq,
                     position_embedding_type="rope", **kw)
    return model.double()


@pytest.mark.parametrize("skip_freq", [3, [1, 0, 1]])
def test_every_layer_equals_bruteforce_cpu_kernel(skip_freq):
    from testlib.layer_attention import check_every_layer, megatron_windows

    windows = megatron_windows(5, skip_freq, 3)
    assert None in windows and 5 in windows
    model = _tiny(skip_freq, "cpu")
    assert check_every_layer(model, 40, windows, tol=1e-6) == 9


def test_local_layer_skips_tiles_outside_the_window():
    """The blocked kernel's plan for a local layer visits only the tiles of the band (forward and backward
    share the plan): 16-token tiles, window 16 over 64 causal tokens -> 7 tiles, not the causal 10."""
    from megatron_cai.core.transformer.blocked_attention import _Plan

    idx = torch.arange(64).expand(1, 64)
    limit = torch.full((1, 64), 64)

    def visited(window):
        steps = _Plan(idx, limit, window, idx, 16, 16, 64).steps[0]
        return sum(len(range(*keys.indices(64))) // 16 for _, _, keys, _ in steps)

    assert (visited(16), visited(None)) == (7, 10)


def test_every_layer_equals_bruteforce_triton_interpreted():
    pytest.importorskip("triton")
    from testlib.interpreted import run_interpreted

    result = run_interpreted(__file__, timeout=600)
    assert result == {"checked": 9, "tiles": [7, 10]}, result


def _worker() -> dict:
    import warnings

    from testlib.layer_attention import check_every_layer, megatron_windows

    from megatron_cai.core.transformer.triton_attention import triton_prepare

    warnings.filterwarnings("ignore")
    checked = 0
    for skip_freq in ([1, 0, 1],):  # the int form's decision is checked above
        model = _tiny(skip_freq, "triton")
        # Triton computes fp64 inputs in fp32: 1e-6 of each tensor's largest magnitude
        checked += check_every_layer(model, 24, megatron_windows(5, skip_freq, 3), tol=1e-6, normwise=True)
    q = torch.zeros(1, 1, 64, 16)
    idx = torch.arange(64).expand(1, 64)
    tiles = []
    for window in (16, None):
        (*_, kv_num, _, q_num, _), _ = triton_prepare(q, q, q, idx, torch.full((1, 64), 64), idx, window, block=16)
        assert int(kv_num.sum()) == int(q_num.sum())  # the backward walks the same tiles
        tiles.append(int(kv_num.sum()))
    return {"checked": checked, "tiles": tiles}


if __name__ == "__main__":
    import json

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    torch.manual_seed(0)
    print("RESULT " + json.dumps(_worker()))

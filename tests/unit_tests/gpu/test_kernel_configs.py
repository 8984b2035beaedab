"""The one launch table of the Triton kernels (core/kernel_configs.py): launchers pick from it by the
device's shared memory and capability (CUDA limits come from core/device.py), and nothing else."""
from __future__ import annotations

import pytest
import torch

from megatron_cai.core import device as dev
from megatron_cai.core import kernel_configs as kc

SM80, SM86, SM89, SM90 = (kc.Target.for_capability(c) for c in (80, 86, 89, 90))


def test_target_limits_are_the_cuda_opt_in_limits() -> None:
    assert (SM80.smem_limit, SM86.smem_limit, SM89.smem_limit, SM90.smem_limit) == (166912, 101376, 101376, 232448)
    assert kc.Target.for_capability(100).smem_limit == 232448
    with pytest.raises(ValueError, match="sm_75"):
        kc.Target.for_capability(75)


def test_sm89_bf16_d128_dkdv_fits_its_shared_memory() -> None:
    """The defect: 64 x 64 tiles, 4 warps, 3 stages used 107,520 B on sm_89 (limit 101,376)."""
    for dtype in (torch.bfloat16, torch.float16):
        tiles = kc.attention_tiles("bwd_dkdv", dtype, 128, SM89)
        need = next(c[0] for c in kc.attention_candidates("bwd_dkdv", dtype, 128) if c[1] == tiles)
        assert need <= SM89.smem_limit
        assert tiles != kc.Tiles(64, 64, 4, 3)


def test_selection_follows_shared_memory_and_capability() -> None:
    # d256 16-bit: the 64 x 32 row needs ~131 KB, so sm_86/sm_89 fall back to 32 x 32
    big, small = kc.attention_tiles("fwd", torch.bfloat16, 256, SM90), kc.attention_tiles("fwd", torch.bfloat16, 256,
                                                                                            SM89)
    assert (big.block_m, big.block_n) == (64, 32) and (small.block_m, small.block_n) == (32, 32)
    assert kc.attention_tiles("fwd", torch.bfloat16, 256, SM86) == small
    assert kc.attention_tiles("fwd", torch.bfloat16, 256, SM80) == big
    # fp32 d128 dK/dV: sm_89+ has its own candidate
    assert kc.attention_tiles("bwd_dkdv", torch.float32, 128, SM90) != kc.attention_tiles("bwd_dkdv", torch.float32,
                                                                                          128, SM80)
    # fwd and dq always share BLOCK_M x BLOCK_N (dq walks the forward's key-block lists); warps and stages
    # are their own: fp32 d128 forward spilled with 2 stages, dQ with 1
    for dtype in kc.ATTENTION_DTYPES:
        for dim in (16, 64, 80, 128, 200, 256):
            for t in (SM80, SM86, SM89, SM90):
                fwd, dq = kc.attention_tiles("fwd", dtype, dim, t), kc.attention_tiles("bwd_dq", dtype, dim, t)
                assert (fwd.block_m, fwd.block_n) == (dq.block_m, dq.block_n)
    for t in (SM80, SM86, SM89, SM90):
        assert kc.attention_tiles("fwd", torch.float32, 128, t).num_stages == 1
        assert kc.attention_tiles("bwd_dq", torch.float32, 128, t).num_stages == 2
    # fp32 d128 dK/dV: sm_86 takes the sm_89+ row (32 x 32 spilled there) and it fits its shared memory
    assert kc.attention_tiles("bwd_dkdv", torch.float32, 128, SM86) == kc.attention_tiles("bwd_dkdv", torch.float32,
                                                                                          128, SM89)


def test_fwd_and_dq_rows_that_disagree_on_tiles_are_one_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(kc.ATTENTION_TABLE, ("dq", "16bit", 128), ((50_000, kc.Tiles(32, 64, 8, 2)),))
    with pytest.raises(RuntimeError, match="fwd and dq rows must agree"):
        kc.attention_tiles("bwd_dq", torch.bfloat16, 128, SM90)
    assert kc.attention_tiles("fwd", torch.bfloat16, 128, SM90).block_m == 128  # the Hopper row


@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_rows_are_chosen_from_sm90_on_only(dim) -> None:
    """sm_90 takes 128-row fwd / dQ tiles and 2-stage dK/dV; sm_80 (whose shared memory would fit them)
    and sm_89 keep the generic rows."""
    for cap in (80, 89, 90):
        target = kc.Target.for_capability(cap)
        fwd, dq, dkdv = (kc.attention_tiles(k, torch.bfloat16, dim, target) for k in kc.ATTENTION_KERNELS)
        assert (fwd.block_m, fwd.block_n) == (dq.block_m, dq.block_n)
        if cap >= 90:
            assert fwd.block_m == 128 and fwd.num_stages == 3 and dq.num_stages == 2 and dkdv.num_stages == 2
        else:
            assert fwd.block_m == 64 and dkdv.num_stages == 1


def test_no_candidate_or_too_wide_head_is_one_clear_error() -> None:
    with pytest.raises(RuntimeError, match="shared memory"):
        kc.attention_tiles("fwd", torch.bfloat16, 128, kc.Target(80, 1000))
    with pytest.raises(ValueError, match="head_dim 512"):
        kc.attention_tiles("fwd", torch.bfloat16, 512, SM90)


def test_interpreter_and_cuda_targets(monkeypatch) -> None:
    assert kc.launch_target(torch.device("cpu")) is None
    assert kc.attention_tiles("fwd", torch.float32, 64, None) == kc.INTERPRETER_TILES
    calls = []

    def fake_limits(device):
        calls.append(device)
        return 89, 101376

    monkeypatch.setattr(dev, "kernel_limits", fake_limits)
    assert kc.launch_target(torch.device("cuda", 0)) == SM89 and calls == [torch.device("cuda", 0)]
    with kc.override_target(SM90):
        assert kc.launch_target(torch.device("cuda", 0)) == SM90
    assert kc.launch_target(torch.device("cpu")) is None


def test_attention_launcher_reads_the_table(monkeypatch) -> None:
    from megatron_cai.core.transformer import triton_attention as ta

    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    with kc.override_target(SM89):
        tiles = ta.launch_tiles(q, None)
        assert tiles == {k: kc.attention_tiles(k, torch.bfloat16, 128, SM89) for k in kc.ATTENTION_KERNELS}
        monkeypatch.setitem(kc.ATTENTION_TABLE, ("dkdv", "16bit", 128), ((0, kc.Tiles(16, 32, 2, 1)),))
        assert ta.launch_tiles(q, None)["bwd_dkdv"] == kc.Tiles(16, 32, 2, 1)
    assert ta.launch_tiles(q, None)["fwd"] == kc.INTERPRETER_TILES  # CPU without override: the interpreter


def test_every_table_row_is_enumerated_by_the_check() -> None:
    """The check's cases come from the table's own dtype and head-dim lists."""
    from megatron_cai.core import triton_aot

    labels = [label for label, _, _ in triton_aot.attention_cases(layouts=("plain",), windows=(None,), zregs=(0.0,))]
    for role, kind, dim in kc.ATTENTION_TABLE:
        names = ("float32",) if kind == "fp32" else ("bfloat16", "float16")
        assert any(label.startswith(f"{n} d{dim} ") for n in names for label in labels), (role, kind, dim)
    squinch = [label for label, _, _ in triton_aot.squinch_cases()]
    # (aligned, misaligned) x 3 input dtypes x 3 residuals x (deterministic, stochastic), plus the wire-row
    # encoder (aligned; fp32 / bf16 gradients, no / fp32 residual, both roundings)
    assert sum(label.startswith("encode") for label in squinch) == 2 * 3 * 3 * 2 + 2 * 2 * 2
    assert sum(label.endswith("rows") for label in squinch) == 2 * 2 * 2 + 1  # and the flag-reading decode
    assert sum(label.startswith("decode") for label in squinch) == 2 * 2 + 1

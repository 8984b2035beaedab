"""QAT through the real training path: checkpoints restore the QAT state (bit-exact resume), TP=2 matches
TP=1 under dynamic clamping, calibrated static clamps agree over data-parallel replicas."""
import math

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train, with_activation

from megatron_cai.core.quantization.qat_linear import GemmInputQuantizer
from megatron_cai.training import checkpoint

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
                     "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--seed", "5",
                     "--lr-warmup-iters", "2"]


def _quantizers(trainer) -> dict[str, GemmInputQuantizer]:
    return {n: m for n, m in trainer.model[0].module.named_modules() if isinstance(m, GemmInputQuantizer)}


def _worker(rank, world_size, argv, reset_static=False):
    """Train; return the losses, the static clamp buffers at the end, the activation clamp rule of each
    quantized layer and the clamp c it used in the first forward (identical weights in every layout)."""
    box, first_c = {}, {}

    def record(name, q):
        original = q.input_clamp

        def input_clamp(x, predicted_input_rms=None):
            c, rule = original(x, predicted_input_rms)
            first_c.setdefault(name, c.detach().clone())
            return c, rule

        q.input_clamp = input_clamp

    def hook(trainer):
        box["trainer"] = trainer
        for name, q in _quantizers(trainer).items():
            record(name, q)
            if reset_static:  # as if the checkpoint had not stored the calibrated clamps
                q.input_static_c.fill_(float("nan"))

    out = train(argv, world_size, trainer_hook=hook)
    qs = _quantizers(box["trainer"])
    out["static_c"] = {n: float(q.input_static_c) for n, q in qs.items() if hasattr(q, "input_static_c")}
    out["rules"] = {n: q.last_input_rule for n, q in qs.items()}
    out["first_c"] = {n: c.numpy() for n, c in first_c.items()}  # numpy: tensors would go through shm
    out["sharded_blocks"] = {n for n, q in qs.items() if q.input_sharded and q.config.granularity == "block"}
    return out


def _losses(results) -> list[float]:
    return [h["lm loss"] for h in last_stage_history(results)]


@pytest.mark.parametrize("clamp", ["static", "rms"])
def test_resume_restores_qat_state_bit_exactly(tmp_path, clamp):
    """8 iterations straight (saving at 4) == resume from iteration 4; the calibrated static clamps come
    back from the checkpoint, and recalibrating them on the resumed batch instead changes the run."""
    save = str(tmp_path / "ckpt")
    args = BASE + ["--qat", "int8", "--qat-clamp", clamp, "--train-iters", "8"]
    straight = run_distributed(_worker, 1, (args + ["--save", save, "--save-interval", "4"],))[0]
    assert checkpoint.read_tracker(save) == 8
    resumed = run_distributed(_worker, 1, (args + ["--load", save, "--ckpt-step", "4"],))[0]
    losses = [h["lm loss"] for h in straight["history"]]
    assert [h["lm loss"] for h in resumed["history"]] == losses[4:], "resumed QAT run differs"
    assert set(straight["rules"].values()) == {clamp}
    if clamp == "rms":
        assert straight["static_c"] == {}
        return
    # One calibrated clamp per quantized linear (5 per layer, LM head excluded), saved in the checkpoint.
    assert len(straight["static_c"]) == 5 * 4
    assert all(math.isfinite(c) and c > 0 for c in straight["static_c"].values())
    payload = torch.load(f"{save}/iter_0000004/mp_rank_00/model_optim_rng.pt", weights_only=False)
    saved = {k[: -len(".input_static_c")]: float(v) for k, v in payload["model"]["model0"].items()
             if k.endswith("input_static_c")}
    assert saved == straight["static_c"] == resumed["static_c"]  # calibrated once, never moved
    recalibrated = run_distributed(_worker, 1, (args + ["--load", save, "--ckpt-step", "4"], True))[0]
    assert recalibrated["static_c"] != straight["static_c"]
    assert [h["lm loss"] for h in recalibrated["history"]] != losses[4:]


# TP: hidden 256 with 4 heads and ffn 1024 gives every row-parallel shard of K (linear_proj: 128,
# fc2: 512) a whole number of 128-blocks, so "block" statistics are TP-invariant.
TP_MODEL = BASE + ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--train-iters", "5"]
TP_CASES = {
    "rms_tensor": ["--qat-clamp", "rms"],
    "static_tensor": ["--qat-clamp", "static"],
    "weight_rms_tensor": ["--qat-clamp", "weight-rms"],
    "weight_rms_block": ["--qat-clamp", "weight-rms", "--qat-granularity", "block"],
    "weight_rms_swiglu_sp": ["--qat-clamp", "weight-rms", "--swiglu", "--sequence-parallel"],
}
# Tolerances (relative), from runs of these cases:
# - clamps in the first forward: TP only changes the order of fp32 sums (all-reduced sums of squares of
#   row-parallel inputs and of fc1's weight shards): measured <= 1e-7; a missing all-reduce or a
#   prediction from one rank's shard would be off by 1e-3 .. 1e-1. Norm-weight predictions (q, kv, fc1
#   under weight-rms) use replicated weights and must be bit-identical.
# - iteration 1 (same weights): the loss matched exactly in every case, the grad norm to 2.4e-5 (the
#   same as without QAT: fp32 order in the TP all-reduces). QAT itself moves them by >= 4e-5 / 1e-3.
# - later iterations: a last-ulp difference can flip an int8 rounding (one step, c/127) and Adam turns
#   the different gradients of tiny-gradient coordinates into full-size updates, so runs drift apart
#   chaotically: measured up to 3.5e-4 (loss) by iteration 5. This bound only catches gross errors
#   (a rank training a different model); the two checks above are the precise ones.
C_RTOL, FIRST_LOSS_RTOL, FIRST_GRAD_RTOL, LATER_LOSS_RTOL = 1e-5, 1e-6, 1e-4, 2e-3


def _clamp_of_full_layer(name: str, tp: list[dict]) -> torch.Tensor:
    if name in tp[0]["sharded_blocks"] and tp[0]["first_c"][name].ndim:  # per-block clamps of K's shards
        return torch.cat([torch.from_numpy(r["first_c"][name]) for r in tp], dim=-2)
    c0, c1 = (torch.from_numpy(r["first_c"][name]) for r in tp)
    assert torch.equal(c0, c1), f"{name}: TP ranks disagree on c"
    return c0


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_matches_tp1(case):
    argv = with_activation(TP_MODEL + ["--qat", "int8"] + TP_CASES[case]) if "--swiglu" in TP_CASES[case] else \
        TP_MODEL + ["--qat", "int8"] + TP_CASES[case]
    ref = run_distributed(_worker, 1, (argv,))
    tp = run_distributed(_worker, 2, (argv + ["--tensor-model-parallel-size", "2"],))
    rule = TP_CASES[case][1]
    for r in ref + tp:  # weight-rms: every linear but linear_proj uses a prediction
        assert {k: v for k, v in r["rules"].items()} == {
            k: ("rms" if rule == "weight-rms" and "linear_proj" in k else rule) for k in r["rules"]}
    assert set(ref[0]["first_c"]) == set(tp[0]["first_c"]) and len(ref[0]["first_c"]) == 10
    for name, want in ref[0]["first_c"].items():
        got, want = _clamp_of_full_layer(name, tp), torch.from_numpy(want)
        if rule == "weight-rms" and name.endswith(("linear_q", "linear_kv", "linear_fc1")):
            assert torch.equal(got, want), name
        torch.testing.assert_close(got, want, rtol=C_RTOL, atol=0, msg=name)
    if rule == "static":  # TP ranks calibrate the same value, the one of the unsplit layer
        assert tp[0]["static_c"] == tp[1]["static_c"]
        for name, c in ref[0]["static_c"].items():
            assert tp[0]["static_c"][name] == pytest.approx(c, rel=C_RTOL)
    a, b = last_stage_history(ref), last_stage_history(tp)
    assert len(a) == len(b) == 5
    assert b[0]["lm loss"] == pytest.approx(a[0]["lm loss"], rel=FIRST_LOSS_RTOL)
    assert b[0]["grad norm"] == pytest.approx(a[0]["grad norm"], rel=FIRST_GRAD_RTOL)
    for i, (x, y) in enumerate(zip(a[1:], b[1:]), start=2):
        assert y["lm loss"] == pytest.approx(x["lm loss"], rel=LATER_LOSS_RTOL), f"iteration {i}"


def test_static_calibration_agrees_over_data_parallel_replicas():
    """Each DP rank sees a different first batch; the calibrated clamp is their max, on every rank."""
    argv = BASE + ["--qat", "int8", "--qat-clamp", "static", "--train-iters", "2", "--global-batch-size", "4"]
    r0, r1 = run_distributed(_worker, 2, (argv,))
    assert r0["static_c"] and r0["static_c"] == r1["static_c"]
    # One process with the whole global batch in its first micro-batch calibrates on the same samples.
    single = run_distributed(_worker, 1, (argv + ["--micro-batch-size", "4"],))[0]
    for name, c in single["static_c"].items():
        assert r0["static_c"][name] == pytest.approx(c, rel=1e-6)

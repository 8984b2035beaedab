"""Expert parallelism equals one process holding every expert: the losses, the grad norm and every
parameter's gradient (experts gathered from their EP ranks) over 5 iterations, to 1e-6, for EP 2 and EP 4
with both token dispatchers (the ranks are DP ranks too: each sees its share of the global batch)."""
from __future__ import annotations

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

from megatron_cai.core import parallel_state as ps

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3",
       "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "([0]+[1]*3)", "--disable-bias-linear",
       "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
RUN = TINY_MODEL + MOE + ["--mock-data", "--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "4",
                          "--lr", "3e-3", "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7"]


def _capture_grads(trainer):
    """Each parameter's reduced gradient before the last optimizer step (experts: with their global index)."""
    captured = {}
    step = trainer.optimizer.step

    def recording_step(*a, **k):
        captured.clear()
        for name, p in trainer.model[0].module.named_parameters():
            first = None
            for m in trainer.model[0].module.modules():
                if getattr(m, "fc1_weight", None) is p or getattr(m, "fc2_weight", None) is p:
                    first = m.first_expert
            captured[name] = (first, p.main_grad.detach().clone())
        return step(*a, **k)

    trainer.optimizer.step = recording_step
    trainer.captured = captured


def _worker(rank, world, argv):
    holder = {}

    def hook(trainer):
        _capture_grads(trainer)
        holder["t"] = trainer

    out = train(argv, world_size=world, trainer_hook=hook)
    out["grads"] = holder["t"].captured
    out["ep_rank"] = ps.get_expert_model_parallel_rank()
    return out


def _full_grads(results):
    """Parameter name -> gradient, experts stacked in global order from the EP ranks."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    dense = {}
    for r in results:
        for name, (first, g) in r["grads"].items():
            if first is None:
                dense.setdefault(name, g)
            else:
                pieces.setdefault(name, {})[first] = g
    return {**dense, **{n: torch.cat([parts[k] for k in sorted(parts)]) for n, parts in pieces.items()}}


@pytest.fixture(scope="module")
def reference():
    results = run_distributed(_worker, 1, args=(RUN,))
    return results[0]["history"], _full_grads(results)


def _compare(reference, ep: int, world: int, dispatcher: str):
    ref_hist, ref_grads = reference
    argv = RUN + ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
    results = run_distributed(_worker, world, args=(argv,))
    hist = [r for r in results if r["last_stage"]][0]["history"]
    for a, b in zip(ref_hist, hist):
        for key in ("lm loss", "load_balancing_loss", "z_loss", "grad norm"):
            assert abs(a[key] - b[key]) < 1e-6, (key, a, b)
    assert len(hist) == 5
    grads = _full_grads(results)
    assert sorted(grads) == sorted(ref_grads)
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    assert worst < 1e-6, worst
    assert {r["ep_rank"] for r in results} == set(range(ep))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_equals_one_process(reference, dispatcher):
    _compare(reference, 2, 2, dispatcher)


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep4_equals_one_process(reference, dispatcher):
    _compare(reference, 4, 4, dispatcher)

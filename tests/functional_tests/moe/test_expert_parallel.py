"""Expert parallelism equals one process holding every expert: the losses (lm, load balancing, z), the grad
norm and every parameter's gradient (experts gathered from their EP ranks) over 5 iterations, to 1e-6, for EP 2
and EP 4 with both token dispatchers (the ranks are DP ranks too: each sees its share of the global batch),
and composed: EP 2 x expert-DP 2 (DDP and the distributed optimizer), EP 2 x TP 2 with sequence parallelism
(expert TP 2 with allgather, expert TP 1 with alltoall), EP 2 x PP 2 interleaved, EP 2 x CP 2 on packed
documents, seq_aux_loss per packed document under TP 2 x EP 2. Squinch compresses the expert gradients over
the expert-DP group, and the logged bytes count them."""
from __future__ import annotations

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

from megatron_cai.core import parallel_state as ps

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3",
       "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "([0]+[1]*3)", "--disable-bias-linear",
       "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
BASE = TINY_MODEL + MOE + ["--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "4",
                           "--lr", "3e-3", "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7"]
RUN = BASE + ["--mock-data"]


def _argv(extra) -> list[str]:
    """The run's flags with ``extra``; mock data unless ``extra`` names a dataset."""
    return (BASE if "--data-path" in extra else RUN) + list(extra)


def _capture_grads(trainer):
    """Each parameter's reduced gradient before the last optimizer step, with where it sits in the full tensor:
    (first expert or None, split dim or None, sections, rank along the split)."""
    captured = {}
    step = trainer.optimizer.step
    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()

    def recording_step(*a, **k):
        captured.clear()
        for chunk in trainer.model:
            for name, p in chunk.module.named_parameters():
                if getattr(p, "is_expert", False):
                    where = (p.first_expert, p.etp_dim, p.etp_sections, etp_rank)
                else:
                    tp_split = p.tp_dim if ps.get_tensor_model_parallel_world_size() > 1 else None
                    where = (None, tp_split, len(p.tp_sections or [0]), tp_rank)
                captured[name] = (where, _owned(chunk, p, trainer.optimizer.distributed))
        return step(*a, **k)

    trainer.optimizer.step = recording_step
    trainer.captured = captured


def _owned(ddp, p, distributed: bool) -> torch.Tensor:
    """``p``'s reduced gradient; with the distributed optimizer only this rank's shards, zero elsewhere."""
    g = p.main_grad.detach().clone()
    if not distributed:
        return g
    s, e = ddp.buffer.offsets[id(p)]
    keep = torch.zeros(e - s, dtype=torch.bool)
    for lo, hi in ddp.buffer.owned_ranges(True):
        keep[max(lo, s) - s:max(min(hi, e) - s, 0)] = True
    return (g.reshape(-1) * keep).view_as(g)


def _train_capturing(argv, world, capture):
    """Train with ``capture(trainer)`` installed; (the run's result, the trainer)."""
    holder = {}

    def hook(trainer):
        capture(trainer)
        holder["t"] = trainer

    return train(argv, world_size=world, trainer_hook=hook), holder["t"]


def _worker(rank, world, argv):
    out, trainer = _train_capturing(argv, world, _capture_grads)
    out["grads"] = trainer.captured
    out["ep_rank"] = ps.get_expert_model_parallel_rank()
    out["sharded"] = trainer.optimizer.distributed
    return out


def _unsplit(parts: dict[int, torch.Tensor], dim: int | None, sections: int) -> torch.Tensor:
    if dim is None:
        return parts[0]
    blocks = [[t.chunk(sections, dim=dim)[s] for _, t in sorted(parts.items())] for s in range(sections)]
    return torch.cat([torch.cat(b, dim=dim) for b in blocks], dim=dim)


def _full_grads(results):
    """Parameter name -> gradient, TP / expert-TP shards joined and experts stacked in global order."""
    pieces: dict[str, dict] = {}
    for r in results:
        for name, ((first, dim, sections, split_rank), g) in r["grads"].items():
            parts = pieces.setdefault(name, {}).setdefault(first, (dim, sections, {}))[2]
            parts[split_rank] = parts[split_rank] + g if r["sharded"] and split_rank in parts else \
                parts.get(split_rank, g)  # distributed optimizer: the replicas' shards add up
    out = {}
    for name, by_first in pieces.items():
        joined = {first: _unsplit(parts, dim, sections) for first, (dim, sections, parts) in by_first.items()}
        out[name] = joined[None] if None in joined else torch.cat([joined[k] for k in sorted(joined)])
    return out


_REFERENCES: dict[tuple, tuple] = {}


def _reference(extra: list[str]):
    if tuple(extra) not in _REFERENCES:
        results = run_distributed(_worker, 1, args=(_argv(extra),))
        _REFERENCES[tuple(extra)] = results[0]["history"], _full_grads(results)
    return _REFERENCES[tuple(extra)]


@pytest.fixture(scope="module")
def reference():
    return _reference([])


def _compare(reference, ep: int, world: int, dispatcher: str, extra: tuple = (), worker=_worker):
    ref_hist, ref_grads = reference
    argv = _argv(extra) + ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
    results = run_distributed(worker, world, args=(argv,))
    hist = [r for r in results if r["last_stage"]][0]["history"]
    for a, b in zip(ref_hist, hist):
        assert a.keys() == b.keys()
        for key in a.keys() - {"lr", "skipped", "grad comm bytes", "global batch size"}:
            assert abs(a[key] - b[key]) < 1e-6, (key, a, b)
    assert len(hist) == 5
    grads = _full_grads(results)
    assert set(ref_grads) <= set(grads)  # PP adds the last stage's copy of the tied embedding
    grads = {n: g for n, g in grads.items() if n in ref_grads}
    for n, g in grads.items():  # TP pads the vocabulary further: those rows have no gradient
        if g.shape != ref_grads[n].shape:
            assert g[ref_grads[n].shape[0]:].abs().max() == 0, n
            grads[n] = g[:ref_grads[n].shape[0]]
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    assert worst < 1e-6, worst
    assert {r["ep_rank"] for r in results} == set(range(ep))
    return results


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_equals_one_process(reference, dispatcher):
    _compare(reference, 2, 2, dispatcher)


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep4_equals_one_process(reference, dispatcher):
    _compare(reference, 4, 4, dispatcher)


def test_ep2_with_expert_data_parallel_2_equals_one_process(reference):
    """World 4: each expert lives on two ranks (expert DP 2): their gradients reduce over that group."""
    _compare(reference, 2, 4, "allgather")


def _capture_fsdp_grads(trainer):
    """FSDP2: each parameter's reduced gradient before the last optimizer step, gathered from its shards (over
    DP for dense parameters, over expert DP for experts; every rank gathers in the same order)."""
    captured = {}
    step = trainer.optimizer.step
    first = ps.get_expert_model_parallel_rank() * 4 // ps.get_expert_model_parallel_world_size()
    tp, tp_rank, etp_rank = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                             ps.get_expert_tensor_parallel_rank())
    layout = trainer.checkpointer.param_layout  # each parameter's (expert-)TP split, read before FSDP2 wrapped it

    def where(name):
        m = layout[name]
        sections = len(m["tp_sections"] or [0])
        if m.get("expert"):
            return first, m["tp_dim"], sections, etp_rank
        return None, m["tp_dim"] if tp > 1 else None, sections, tp_rank

    def recording_step(*a, **k):
        captured.clear()
        for chunk in trainer.model:
            for name, p in chunk.module.named_parameters():
                captured[name] = (where(name), p.grad.full_tensor().detach().clone())
        return step(*a, **k)

    trainer.optimizer.step = recording_step
    trainer.captured = captured


def _fsdp_worker(rank, world, argv):
    out, trainer = _train_capturing(argv, world, _capture_fsdp_grads)
    model = trainer.model[0]
    experts = [m for n, m in model.module.named_modules() if n.endswith("mlp.experts")]
    out.update(grads=trainer.captured, ep_rank=ps.get_expert_model_parallel_rank(), sharded=False,
               expert_mesh={m.fc1_weight.device_mesh.size() for m in experts},
               dense_mesh=model.module.decoder.layers["0"].mlp.linear_fc1.weight.device_mesh.size())
    return out


TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")


@pytest.mark.slow
@pytest.mark.parametrize("world,dispatcher,extra,meshes", [
    (4, "alltoall", (), (2, 4)),
    (2, "allgather", (), (1, 2)),
    (4, "allgather", TP2_SP, (1, 2)),  # expert TP 2: expert DP 1
    (4, "alltoall", (*TP2_SP, "--expert-tensor-parallel-size", "1"), (2, 2)),  # expert DP spans the TP pair
], ids=["dp4", "dp2", "tp2_sp", "tp2_sp_etp1"])
def test_ep2_with_fsdp2_equals_one_process(reference, world, dispatcher, extra, meshes):
    """FSDP2: dense parameters sharded over DP, each layer's experts over expert DP: losses, grad norm and every
    gradient equal one DDP process holding every expert."""
    results = _compare(reference, 2, world, dispatcher, ("--use-torch-fsdp2", "--ckpt-format", "torch_dist", *extra),
                       _fsdp_worker)
    assert [(r["expert_mesh"], r["dense_mesh"]) for r in results] == [({meshes[0]}, meshes[1])] * world


def _fsdp_squinch_worker(rank, world, argv):
    from megatron_cai.core.distributed.fsdp import local

    holder = {}
    out = train(argv, world_size=world, trainer_hook=lambda t: holder.setdefault("t", t))
    chunk = holder["t"].model[0]
    experts = {n: m for n, m in chunk.module.named_modules() if n.endswith("mlp.experts")}
    out["experts"] = {n: (type(chunk.comms[n]).__name__, chunk.comms[n].bytes_sent,
                          sum(local(p).numel() for p in m.parameters())) for n, m in experts.items()}
    out["edp"] = ps.get_expert_data_parallel_world_size()
    return out


@pytest.mark.slow
def test_fsdp2_squinch_reduce_scatters_experts_over_expert_dp():
    """FSDP2 at EP 2, world 4, --squinch: each layer's experts reduce-scatter over expert DP 2 in Squinch's wire
    format: per iteration (n - 1) wire rows of their shard's elements (docs/squinch-format.md), n = 2 (over DP 4
    it would be 3 rows of half as many)."""
    argv = RUN + ["--expert-model-parallel-size", "2", "--use-torch-fsdp2", "--ckpt-format", "torch_dist",
                  "--squinch", "--train-iters", "2"]
    results = run_distributed(_fsdp_squinch_worker, 4, args=(argv,))
    for r in results:
        assert r["edp"] == 2 and len(r["experts"]) == 3
        for kind, sent, shard in r["experts"].values():
            assert kind == "SquinchReduceScatter"
            assert shard % 8 == 0  # whole Squinch blocks of 8: no row padding
            assert sent == 2 * (2 - 1) * 16 * -(-(6 * shard // 8 + 1) // 16), (sent, shard)


def _packed_docs(tmp) -> list[str]:
    import json
    import os
    import random
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
    from preprocess_data import preprocess

    rng = random.Random(0)
    path = tmp / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(str(rng.randrange(90)) for _ in range(rng.randint(3, 12)))})
                            + "\n" for _ in range(80)))
    preprocess(str(path), str(tmp / "docs"), "NullTokenizer", vocab_size=100, append_eod=True, progress=False,
               log=lambda m: None)
    return ["--data-path", str(tmp / "docs_text_document"), "--tokenizer-type", "NullTokenizer", "--split", "1",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--seq-length", "32",
            "--max-position-embeddings", "32"]


COMPOSITIONS = {
    "tp2_sp_allgather": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "allgather"),
    "tp2_sp_etp1_alltoall": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1"], "alltoall"),
    "pp2_interleaved": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                        "alltoall"),
    "dp2_distributed_optimizer": (["--use-distributed-optimizer", "--overlap-grad-reduce",
                                   "--overlap-param-gather"], "alltoall"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_ep2_composed_equals_one_process(reference, name):
    extra, dispatcher = COMPOSITIONS[name]
    _compare(reference, 2, 4, dispatcher, tuple(extra))


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_cp2_packed_documents_equals_one_process(tmp_path_factory, dispatcher):
    data = _packed_docs(tmp_path_factory.mktemp("docs"))
    _compare(_reference(data), 2, 4, dispatcher, ("--context-parallel-size", "2", *data))


def _squinch_worker(rank, world, argv):
    holder = {}
    out = train(argv, world_size=world, trainer_hook=lambda t: holder.setdefault("t", t))
    ddp = holder["t"].model[0]
    out.update(expert_bytes=ddp.reducer.expert.bytes_sent, dense_bytes=ddp.reducer.dense.bytes_sent,
               buckets={kind: [b.numel for b in ddp.buffer.buckets if b.expert == kind] for kind in (False, True)},
               squinch=type(ddp.reducer.expert).__name__, edp=ps.get_expert_data_parallel_world_size(),
               dp=ps.get_data_parallel_world_size())
    return out


def test_squinch_expert_gradients_over_expert_dp():
    """World 4, EP 2: experts reduce over expert-DP groups of 2 in Squinch's 6-bit format, dense gradients over
    DP 4. Per bucket of N elements, a compressed all-reduce over n ranks sends 2 (n - 1) wire rows of c = N / n
    elements, each 16 ceil((6 c / 8 + 1) / 16) bytes (docs/squinch-format.md: payload, the non-finite flag byte,
    padding to 16): bf16's ring sends 2 (n - 1) x 2 c bytes. The logged grad comm bytes are exactly that,
    dense and expert together, every iteration; the 6-bit payloads alone are exactly 0.375 of bf16's, and the
    flag rows put the total above it (docs/moe.md)."""
    from fractions import Fraction

    argv = RUN + ["--expert-model-parallel-size", "2", "--squinch", "--train-iters", "2"]
    results = run_distributed(_squinch_worker, 4, args=(argv,))
    r = results[0]
    assert r["squinch"] == "SquinchReducer" and r["edp"] == 2 and r["dp"] == 4

    def wire_row(c):  # the committed wire format, from its spec (c is a multiple of 8: buckets are padded so)
        assert c % 8 == 0
        return 16 * -(-(6 * c // 8 + 1) // 16)

    def squinch(n, buckets, row=wire_row):
        return sum(2 * (n - 1) * row(numel // n) for numel in buckets)

    def bf16(n, buckets):  # a ring all-reduce: 2 (n - 1) / n of the buffer, 2 bytes an element
        return sum(2 * (n - 1) * 2 * numel // n for numel in buckets)

    expert, dense = squinch(2, r["buckets"][True]), squinch(4, r["buckets"][False])
    iterations = len(r["history"])
    assert r["expert_bytes"] == expert * iterations > 0 and r["dense_bytes"] == dense * iterations
    payload = squinch(2, r["buckets"][True], row=lambda c: 6 * c // 8)
    assert Fraction(payload, bf16(2, r["buckets"][True])) == Fraction(3, 8)
    overhead = Fraction(expert - payload, bf16(2, r["buckets"][True]))
    rows = 2 * (2 - 1) * len(r["buckets"][True])  # at least 1, at most 16 bytes each
    assert Fraction(rows, bf16(2, r["buckets"][True])) <= overhead <= Fraction(16 * rows, bf16(2, r["buckets"][True]))
    assert [h["grad comm bytes"] for h in last_stage(results)] == [expert + dense] * iterations


def last_stage(results):
    return [r for r in results if r["last_stage"]][0]["history"]


@pytest.mark.slow
def test_seq_aux_loss_per_document_under_tp2_sp_and_ep2_equals_one_process(tmp_path_factory):
    """seq_aux_loss on packed documents (each document its own sequence): TP 2 with sequence parallelism (a
    document's tokens on both TP ranks) x EP 2 equals one process."""
    data = _packed_docs(tmp_path_factory.mktemp("docs_seq_aux")) + ["--moe-router-load-balancing-type",
                                                                       "seq_aux_loss"]
    ref = _reference(data)
    _compare(ref, 2, 4, "allgather", ("--tensor-model-parallel-size", "2", "--sequence-parallel", *data))


def _resume_worker(rank, world, argv, save):
    """Iterations 1-2 saved, then 3-4 resumed from the checkpoint (Squinch's error feedback included)."""
    first = train(argv + ["--train-iters", "4", "--save", save, "--exit-interval", "2"], world_size=world)
    second = train(argv + ["--train-iters", "4", "--save", save, "--load", save], world_size=world)
    return first["history"] + second["history"]


def test_squinch_expert_feedback_resumes_exactly(tmp_path):
    """DP 2 (expert DP 2): the expert reducer's error feedback is saved with the dense one's and restored: the
    resumed run's losses and grad norms are the uninterrupted run's, bit for bit."""
    argv = RUN + ["--squinch", "--ckpt-format", "torch"]
    whole = last_stage(run_distributed(_worker, 2, args=(argv + ["--train-iters", "4"],)))
    resumed = run_distributed(_resume_worker, 2, args=(argv, str(tmp_path / "ckpt")))[0]
    assert len(resumed) == 4
    for a, b in zip(whole, resumed):
        assert (a["lm loss"], a["load_balancing_loss"], a["grad norm"]) == \
            (b["lm loss"], b["load_balancing_loss"], b["grad norm"])

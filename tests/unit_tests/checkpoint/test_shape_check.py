"""``shape_check``: the saved-vs-live comparison every load path uses, in one process.

The independent expectation is torch's own ``load_state_dict``: the parameters it refuses (size mismatch, missing,
unexpected) are exactly the ones :func:`shape_problems` / :func:`unexpected` name, with the same shapes.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.inference.generation import ensure_single_process
from megatron_cai.training.checkpoint import CheckpointError, CheckpointShapeError, check_shapes
from megatron_cai.training.checkpoint.shape_check import likely_flag, shape_problems, unexpected
from megatron_cai.training.errors import UserError

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, padded_vocab_size=64, seq_length=16,
             activation="relu2")


def _model(**kw) -> GPTModel:
    ensure_single_process()
    return GPTModel(GPTConfig(**{**SMALL, **kw}))


def _shapes(model: GPTModel) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _torch_refuses(saved: GPTModel, live: GPTModel) -> tuple[dict, set, set]:
    """What torch's strict load_state_dict reports: {name: (saved, live)} size mismatches, missing, unexpected."""
    with pytest.raises(RuntimeError) as e:
        live.load_state_dict(saved.state_dict())
    text = str(e.value)
    sizes = {m[0]: (tuple(map(int, re.findall(r"\d+", m[1]))), tuple(map(int, re.findall(r"\d+", m[2]))))
             for m in re.findall(r"size mismatch for (\S+): copying a param with shape torch.Size\(\[([\d, ]*)\]\) "
                                 r"from checkpoint, the shape in current model is torch.Size\(\[([\d, ]*)\]\)", text)}
    def keys(kind):
        m = re.search(kind + r" key\(s\) in state_dict: (.*?)\.\s*$", text, re.M)
        return set(re.findall(r'"([^"]+)"', m.group(1))) if m else set()
    return sizes, keys("Missing"), keys("Unexpected")


@pytest.mark.parametrize("change", [{"hidden_size": 64}, {"padded_vocab_size": 128}, {"ffn_hidden_size": 96},
                                    {"num_query_groups": 1}, {"num_layers": 3}, {"num_layers": 1}])
def test_problems_are_what_torch_refuses(change):
    saved_model, live = _model(), _model(**change)
    sizes, missing, extra = _torch_refuses(saved_model, live)
    assert sizes or missing or extra
    saved, here = _shapes(saved_model), _shapes(live)
    problems = shape_problems(saved, here)
    assert {p.name: (p.saved, p.here) for p in problems if p.saved and p.here} == sizes
    assert {p.name for p in problems if p.saved is None} == missing
    assert {p.name for p in unexpected(saved, saved, set(here))} == extra


def test_vocab_rows_may_differ_only_where_allowed():
    saved, here = {"emb": (64, 32), "w": (64, 32)}, {"emb": (128, 32), "w": (128, 32)}
    problems = shape_problems(saved, here, rows_may_differ=lambda n: n == "emb")
    assert [(p.name, p.saved, p.here) for p in problems] == [("w", (64, 32), (128, 32))]
    assert shape_problems({"emb": (64, 16)}, {"emb": (128, 32)}, rows_may_differ=lambda n: True)  # columns: never


def test_one_error_names_file_parameter_shapes_and_flag():
    saved_model, live = _model(), _model(hidden_size=64)
    hint = likely_flag(saved_model.config, live.config)
    with pytest.raises(CheckpointShapeError) as e:
        check_shapes("/ck/iter_0000002/mp_rank_00/model_optim_rng.pt", _shapes(saved_model), _shapes(live),
                     hint=hint)
    line = str(e.value)
    assert isinstance(e.value, (CheckpointError, UserError)) and "\n" not in line
    first = next(iter(_shapes(live)))  # the first of this run's tensors differs (every one depends on hidden)
    assert ("/ck/iter_0000002/mp_rank_00/model_optim_rng.pt" in line and repr(first) in line
            and str(_shapes(saved_model)[first]) in line and str(_shapes(live)[first]) in line)
    assert "--hidden-size differs: 32 in the checkpoint, 64 in this run" in line


def test_missing_comes_before_unexpected_and_unexpected_needs_saved_params():
    saved, here = {"a": (2,), "old": (3,)}, {"a": (2,), "new": (4,)}
    with pytest.raises(CheckpointShapeError, match=r"this run's 'new' \(shape \(4,\)\) is not in the checkpoint"):
        check_shapes("d", saved, here, saved_params=["old"])
    with pytest.raises(CheckpointShapeError, match=r"holds 'old' \(shape \(3,\)\), which this run lacks"):
        check_shapes("d", saved, {"a": (2,)}, saved_params=["old"])
    check_shapes("d", saved, {"a": (2,)})  # a saved buffer no parameter takes (e.g. QAT's): not an error


@pytest.mark.parametrize("field,value,flag", [("num_layers", 3, "--num-layers"),
                                              ("ffn_hidden_size", 96, "--ffn-hidden-size"),
                                              ("num_query_groups", 1, "--num-query-groups"),
                                              ("padded_vocab_size", 128, "--make-vocab-size-divisible-by")])
def test_likely_flag_names_the_field_that_differs(field, value, flag):
    saved, here = GPTConfig(**SMALL), GPTConfig(**{**SMALL, field: value})
    text = likely_flag(saved, here)
    assert flag in text and f"{getattr(saved, field)!r} in the checkpoint, {value!r} in this run" in text
    assert likely_flag(saved, GPTConfig(**SMALL)) == "" and likely_flag(None, here) == ""


def test_no_problem_no_error():
    shapes = _shapes(_model())
    check_shapes("d", shapes, shapes, saved_params=shapes)
    check_shapes("d", {k: torch.Size(v) for k, v in shapes.items()}, shapes)  # torch.Size against tuples


def _two_ranks(rank: int, world_size: int) -> tuple[str | None, ...]:
    """PP = 2: rank 1's file has a mismatch, rank 0's none; then a global checkpoint whose parameters the ranks
    split. DP = 2: rank 1 alone loads (no one to wait for)."""
    from megatron_cai.core import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    found = []
    mine = {"w": (2, 3)} if rank == 0 else {"v": (4,)}
    saved = {"w": (2, 3)} if rank == 0 else {"v": (5,)}
    for saved_shapes, saved_params in ((saved, ()), ({"w": (2, 3), "v": (4,)}, ["w", "v"])):
        try:
            check_shapes(f"file{rank}", saved_shapes, mine, saved_params=saved_params)
            found.append(None)
        except CheckpointShapeError as e:
            found.append(str(e))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()  # DP = 2: each rank is its own model-parallel group
    if rank == 1:
        try:
            check_shapes("alone", {"v": (5,)}, {"v": (4,)})
        except CheckpointShapeError as e:
            found.append(str(e))
    return tuple(found)


@pytest.mark.slow  # spawns two processes
def test_every_rank_raises_the_first_finding_and_names_are_compared_over_ranks():
    from testlib.distributed import run_distributed

    results = run_distributed(_two_ranks, world_size=2)
    line = "checkpoint file1 does not fit this run's model: 'v' has shape (5,) in the checkpoint but (4,) in this run"
    assert [r[0] for r in results] == [line, line]  # rank 0 found nothing itself, and raises rank 1's finding
    assert [r[1] for r in results] == [None, None]  # 'v' is rank 1's: not "unexpected" on rank 0
    assert "checkpoint alone does not fit" in results[1][2] and len(results[0]) == 2  # no hang


def test_teacher_that_does_not_fit_is_one_rank_local_error():
    from megatron_cai.training.checkpoint import CanonicalCheckpoint, RankLocalShapeError
    from megatron_cai.training.errors import RankLocalError
    from megatron_cai.training.features.distill import build_teacher

    teacher = _model()
    weights = dict(teacher.state_dict())
    build_teacher(CanonicalCheckpoint(teacher.config, model=weights), padded_vocab_size=64)  # fits: loads
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    weights[name] = torch.zeros(96, 32)  # saved with another --ffn-hidden-size than its own config says
    with pytest.raises(RankLocalShapeError) as e:
        build_teacher(CanonicalCheckpoint(teacher.config, model=weights), padded_vocab_size=64, where="--t T")
    assert isinstance(e.value, RankLocalError)
    assert str(e.value) == (f"checkpoint --t T does not fit this run's model: {name!r} has shape (96, 32) in the "
                            f"checkpoint but (128, 32) in this run")


def test_teacher_of_another_vocabulary_is_one_rank_local_error(monkeypatch):
    from megatron_cai.training import checkpoint
    from megatron_cai.training.checkpoint import CanonicalCheckpoint, RankLocalShapeError
    from megatron_cai.training.features.distill import load_teacher

    teacher = _model()
    saved = CanonicalCheckpoint(teacher.config, model=dict(teacher.state_dict()))
    monkeypatch.setattr(checkpoint, "load_canonical", lambda path, step, load_optimizer: saved)
    assert load_teacher("T", teacher.config, torch.device("cpu")) is not None  # the same vocabulary loads
    student = dataclasses.replace(teacher.config, vocab_size=teacher.config.vocab_size - 1)
    with pytest.raises(RankLocalShapeError) as e:
        load_teacher("T", student, torch.device("cpu"))
    assert str(e.value) == (f"--distill-teacher-load T: the teacher's vocabulary has {teacher.config.vocab_size} "
                            f"tokens, the student's {student.vocab_size}: they must share the tokenizer")


def test_diloco_island_state_that_does_not_fit_is_one_rank_local_error():
    from types import SimpleNamespace

    from megatron_cai.training.errors import RankLocalError
    from megatron_cai.training.features.diloco import DilocoSeam, DilocoStateError

    module = torch.nn.Linear(3, 2)  # an island's one chunk: weight (2, 3) and bias (2,) in a flat buffer of 8
    chunk = SimpleNamespace(module=module, buffer=SimpleNamespace(param_data=torch.zeros(8),
                                                                  params=list(module.parameters())))
    seam = SimpleNamespace(model_chunks=[chunk])
    moments = {"weight": {"exp_avg": torch.zeros(2, 3)}, "bias": {"exp_avg": torch.zeros(2)}}
    DilocoSeam._check_island_state_fits(seam, {"island": 1, "weights": [torch.zeros(8)],
                                               "inner_optimizer": {"param_state": moments}})  # fits
    moments["weight"]["exp_avg"] = torch.zeros(4, 3)
    with pytest.raises(DilocoStateError) as e:
        DilocoSeam._check_island_state_fits(seam, {"island": 1, "weights": [torch.zeros(14)],
                                                   "inner_optimizer": {"param_state": moments}})
    assert isinstance(e.value, RankLocalError)
    assert "DiLoCo state of island 1" in str(e.value)
    assert "'flat weights of model chunk 0' has shape (14,) in the checkpoint but (8,) in this run (and 1 more)" \
        in str(e.value)


def test_generation_model_that_does_not_fit_is_one_error():
    from megatron_cai.inference.generation import model_from_canonical
    from megatron_cai.training.checkpoint import CanonicalCheckpoint

    weights = dict(_model().state_dict())
    model_from_canonical(CanonicalCheckpoint(_model().config, model=weights))  # fits: loads
    weights["decoder.layers.2.mlp.linear_fc2.weight"] = torch.zeros(32, 128)  # a layer its config does not have
    expected = (r"checkpoint ck/dir does not fit this run's model: the checkpoint holds "
                r"'decoder.layers.2.mlp.linear_fc2.weight' \(shape \(32, 128\)\)")
    with pytest.raises(CheckpointShapeError, match=expected):
        model_from_canonical(CanonicalCheckpoint(_model().config, model=weights), where="ck/dir")


def test_torch_format_checks_the_adam_moments_too():
    from types import SimpleNamespace

    from megatron_cai.training.checkpoint.torch_format import check_weights_fit

    model = _model()
    chunks = [SimpleNamespace(module=model)]
    moments = {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
               for n, p in model.named_parameters()}
    payload = {"model": {"model0": model.state_dict()}, "optimizer": {"param_state": moments},
               "tp_layout": dict.fromkeys(moments)}
    meta = {"model_config": model.config.to_dict()}
    check_weights_fit("f.pt", payload, chunks, model.config, meta, with_optim=True)  # fits
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    moments[name]["exp_avg"] = torch.zeros(3)
    check_weights_fit("f.pt", payload, chunks, model.config, meta, with_optim=False)  # not loaded: not compared
    with pytest.raises(CheckpointShapeError, match=rf"'optimizer.state.exp_avg.{name}' has shape \(3,\) in the "
                                                   rf"checkpoint but \(32, 128\) in this run"):
        check_weights_fit("f.pt", payload, chunks, model.config, meta, with_optim=True)
    del moments[name]
    with pytest.raises(CheckpointShapeError, match=rf"this run's 'optimizer.state.exp_avg.{name}' \(shape"):
        check_weights_fit("f.pt", payload, chunks, model.config, meta, with_optim=True)

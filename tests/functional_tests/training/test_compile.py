"""--compile against the eager run, fp32 on the CPU: packed-document visibility under TP=2 (with sequence
parallelism and Attention Z-Reg) and under PP=2; each layer one graph, no graph break (Dynamo's counters per
rank), losses and grad norms to 1e-5.

The fast test traces the Trainer's layers with the ``aot_eager`` backend (Dynamo + AOTAutograd, the same
graphs, custom ops and autograd formulas, no code generation) in the same ranks as the eager run; the slow
one runs ``--compile`` itself (inductor's C++ code)."""
import pytest
from testlib.data import random_docs, write_dataset
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.transformer.compile import compile_transformer_layers

BASE = TINY_MODEL + ["--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--train-iters", "2", "--lr", "3e-3", "--log-interval", "100", "--eval-interval", "0",
                     "--eval-iters", "0", "--seed", "7", "--split", "1", "--no-exit-signal-handler",
                     "--reset-attention-mask", "--reset-position-ids"]
LAYOUTS = {
    "tp2_sp_packed_zreg": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-layers", "1",
                           "--attention-zreg-coeff", "0.01"],
    "pp2_packed": ["--pipeline-model-parallel-size", "2", "--num-layers", "2"],
}


def _worker(rank, world_size, argv):
    from torch._dynamo.utils import counters

    counters.clear()
    out = train(argv, world_size)
    out["graph_breaks"] = dict(counters["graph_break"])
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("compile") / "docs")
    write_dataset(prefix, random_docs(0, 120, max_len=9, vocab=100, eod=100))  # NullTokenizer: EOD = vocab
    return prefix


def _traced_layers(trainer) -> None:
    for chunk in trainer.model:
        compile_transformer_layers(chunk.module, backend="aot_eager")


def _worker_eager_then_traced(rank, world_size, argv):
    from torch._dynamo.utils import counters

    eager = train(argv, world_size)
    ps.destroy_model_parallel()
    counters.clear()
    traced = train(argv, world_size, trainer_hook=_traced_layers)
    return {"eager": eager, "traced": traced, "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


def _check(compiled: list[dict], eager: list[dict]) -> None:
    assert len(compiled) == len(eager) == 2
    for i, (c, e) in enumerate(zip(compiled, eager)):
        for key in ("lm loss", "grad norm"):
            assert c[key] == pytest.approx(e[key], rel=1e-5), f"iteration {i + 1} {key}: {c[key]} vs {e[key]}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_traced_layers_match_eager(name, corpus):
    ranks = run_distributed(_worker_eager_then_traced, 2, (BASE + ["--data-path", corpus] + LAYOUTS[name],))
    for r in ranks:
        assert r["graph_breaks"] == {}, f"rank {r['traced']['rank']}: graph breaks {r['graph_breaks']}"
        assert r["graphs"] == 1, f"rank {r['traced']['rank']}: {r['graphs']} graphs (one for all layers expected)"
    _check(last_stage_history([r["traced"] for r in ranks]), last_stage_history([r["eager"] for r in ranks]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layers_match_eager(name, corpus):
    argv = BASE + ["--data-path", corpus] + LAYOUTS[name]
    eager = last_stage_history(run_distributed(_worker, 2, (argv,)))
    ranks = run_distributed(_worker, 2, (argv + ["--compile"],))
    for r in ranks:
        assert r["graph_breaks"] == {}, f"rank {r['rank']}: graph breaks {r['graph_breaks']}"
        assert r["graphs"] == 1, f"rank {r['rank']}: {r['graphs']} graphs (one shared by all layers expected)"
    _check(last_stage_history(ranks), eager)

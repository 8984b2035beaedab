"""Tree data through pretrain_gpt end to end: preprocess --tree -> TreeDataset -> training with Z-Reg,
attention lse statistics in TensorBoard (every layer, also under pipeline parallelism); plain packed
documents through the same visibility path with --reset-attention-mask."""
import math
import os
import random
import sys

import pytest
from testlib import ROOT
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train
from testlib.tree import dumps, random_json_tree

sys.path.insert(0, os.path.join(ROOT, "tools"))
from preprocess_data import preprocess  # noqa: E402

BASE = TINY_MODEL + ["--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--lr", "3e-3", "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "0",
                     "--seed", "5", "--split", "1", "--no-exit-signal-handler"]


def _corpus(tmp_path, tree: bool) -> str:
    rng = random.Random(0)
    if tree:
        lines = [dumps(random_json_tree(rng, 100, max_nodes=5, max_len=4)) for _ in range(80)]
    else:
        lines = [dumps({"text": " ".join(str(rng.randrange(100)) for _ in range(rng.randint(3, 9)))})
                 for _ in range(80)]
    path = tmp_path / ("trees.jsonl" if tree else "docs.jsonl")
    path.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / ("trees" if tree else "docs"))
    preprocess(str(path), out, "NullTokenizer", vocab_size=100, append_eod=True, progress=False, log=lambda m: None,
               tree=tree)
    return out + "_text_document"


def _scalars(tb_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _single(rank, world_size, tmp):
    trees, docs = _corpus(tmp, True), _corpus(tmp, False)
    tree_args = BASE + ["--data-path", trees, "--train-iters", "4"]
    out = {"zreg": train(tree_args + ["--attention-zreg-coeff", "0.01", "--tensorboard-dir", str(tmp / "tb")]),
           "off": train(tree_args),
           "plain": train(BASE + ["--data-path", docs, "--train-iters", "2", "--reset-attention-mask",
                                  "--reset-position-ids", "--eod-mask-loss", "--tensorboard-dir", str(tmp / "tb2")])}
    out["tb"], out["tb2"] = _scalars(str(tmp / "tb")), _scalars(str(tmp / "tb2"))
    return out


def test_tree_training_with_zreg_single_process(tmp_path):
    r = run_distributed(_single, 1, (tmp_path,))[0]
    zreg, off = [h["lm loss"] for h in r["zreg"]["history"]], [h["lm loss"] for h in r["off"]["history"]]
    assert all(math.isfinite(x) for x in zreg + off)
    assert zreg[0] == off[0]  # the reported loss never contains the Z-Reg term...
    assert zreg[1:] != off[1:]  # ...but its gradient changes the updates
    tb = r["tb"]
    for layer in range(4):  # every layer's lse mean / max, every iteration, finite and ordered
        mean, mx = tb[f"attention-lse/layer{layer}-mean"], tb[f"attention-lse/layer{layer}-max"]
        assert len(mean) == len(mx) == 4
        assert all(math.isfinite(a) and math.isfinite(b) and a <= b for a, b in zip(mean, mx))
    assert tb["lm loss"] == pytest.approx(zreg)  # Megatron-LM's tag, every iteration
    # Plain packed documents take the same visibility path (lse statistics exist only there).
    assert "attention-lse/layer0-mean" in r["tb2"]
    assert all(math.isfinite(h["lm loss"]) for h in r["plain"]["history"])


def _pipeline(rank, world_size, tmp, trees):
    return train(BASE + ["--data-path", trees, "--train-iters", "2", "--pipeline-model-parallel-size", "2",
                         "--attention-zreg-coeff", "0.01", "--tensorboard-dir", str(tmp / "tb_pp")], world_size)


def test_lse_stats_of_every_stage_reach_tensorboard(tmp_path):
    trees = _corpus(tmp_path, True)
    results = run_distributed(_pipeline, 2, (tmp_path, trees))
    assert all(math.isfinite(h["lm loss"]) for h in last_stage_history(results))
    tb = _scalars(str(tmp_path / "tb_pp"))  # written by the last rank; layers 0-1 live on the first stage
    for layer in range(4):
        assert len(tb[f"attention-lse/layer{layer}-max"]) == 2

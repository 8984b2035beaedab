"""Reliability building blocks: divergence monitor, run-directory guards, token-id range cache, checkpoint
I/O messages, known-error reporting, Squinch-state warnings, preprocess vocabulary check, generation limits."""
from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import torch

from megatron_cai.core.datasets import token_range as tr
from megatron_cai.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
)
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.reducers import AllReduceReducer
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer
from megatron_cai.training import errors, run_dirs, startup_checks
from megatron_cai.training.checkpoint_io import (
    CheckpointError,
    CheckpointIOError,
    load_torch,
    read_json,
    reducer_state_dropped,
    save_torch,
)
from megatron_cai.training.divergence import DivergenceConfig, DivergenceError, DivergenceMonitor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------- divergence
def test_monitor_raises_at_the_bound_with_loss_and_checkpoint():
    m = DivergenceMonitor(DivergenceConfig(max_consecutive_skipped_iterations=3), CPU, "ck/iter_0000002")
    m.observe(1, {"lm loss": 2.5}, skipped=False)
    m.observe(2, {"lm loss": 2.25}, skipped=False)
    m.observe(3, {"lm loss": float("nan")}, skipped=True)
    m.observe(4, {}, skipped=True)
    m.observe(5, {"lm loss": 2.0}, skipped=False)  # a finite step resets the run of skips
    m.observe(6, {}, skipped=True)
    m.observe(7, {}, skipped=True)
    with pytest.raises(DivergenceError) as e:
        m.observe(8, {}, skipped=True)
    msg = str(e.value)
    assert "iteration 8" in msg and "3 consecutive" in msg
    assert "last finite lm loss 2.000000E+00 at iteration 5" in msg and "ck/iter_0000002" in msg


def test_monitor_without_check_or_bound_never_raises():
    for cfg in (DivergenceConfig(check_for_nan_in_loss_and_grad=False), DivergenceConfig(0)):
        m = DivergenceMonitor(cfg, CPU)
        for i in range(50):
            m.observe(i + 1, {}, skipped=True)


def test_spike_detection_counts_losses_above_k_times_the_median():
    m = DivergenceMonitor(DivergenceConfig(check_for_spiky_loss=True, spiky_loss_factor=3.0, spiky_loss_window=20),
                          CPU)
    losses = [2.0 + 0.01 * (i % 5) for i in range(15)] + [7.0, 2.0, 5.9, 6.1]
    lines = [m.observe(i + 1, {"lm loss": v}, skipped=False) for i, v in enumerate(losses)]
    median_before = [float(np.median(losses[max(0, i - 20):i])) if i else 0.0 for i in range(len(losses))]
    expected = [i >= 10 and v > 3.0 * median_before[i] for i, v in enumerate(losses)]
    assert [line is not None for line in lines] == expected
    assert m.spikes == sum(expected) == 2
    assert "loss spike" in lines[15] and "loss spikes so far: 1" in lines[15]


def test_refuse_save_after_a_skip_or_with_non_finite_state():
    model = DistributedDataParallel(torch.nn.Linear(3, 3), AllReduceReducer(None, 1), DDPConfig(), device=CPU)
    m = DivergenceMonitor(DivergenceConfig(), CPU)
    assert m.refuse_save([model], None) is None
    m.observe(1, {}, skipped=True)
    assert "non-finite" in m.refuse_save([model], None)
    m.observe(2, {"lm loss": 1.0}, skipped=False)
    with torch.no_grad():
        model.module.weight[0, 0] = float("inf")
    assert "non-finite values" in m.refuse_save([model], None)


def test_divergence_state_round_trips():
    m = DivergenceMonitor(DivergenceConfig(), CPU)
    m.observe(7, {"lm loss": 3.5}, skipped=False)
    other = DivergenceMonitor(DivergenceConfig(), CPU)
    other.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert other.last_finite == (7, 3.5)


def test_divergence_flags_have_megatron_defaults():
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.config import ArgumentError

    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    div = parse_config(base, world_size=1).training.divergence
    assert div == DivergenceConfig() and div.check_for_nan_in_loss_and_grad
    assert div.max_consecutive_skipped_iterations == 10
    off = parse_config(base + ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"], world_size=1)
    assert not off.training.divergence.check_for_nan_in_loss_and_grad and off.training.divergence.check_for_spiky_loss
    with pytest.raises(ArgumentError, match="max-consecutive-skipped-iterations"):
        parse_config(base + ["--max-consecutive-skipped-iterations", "-1"], world_size=1)
    with pytest.raises(ArgumentError, match="--seq-length 64 is larger than --max-position-embeddings 32"):
        parse_config(base + ["--seq-length", "64", "--max-position-embeddings", "32"], world_size=1)


# ------------------------------------------------------------------------------------ run dirs
def _mk_run(root, iterations, tracker=None):
    os.makedirs(root, exist_ok=True)
    for i in iterations:
        os.makedirs(os.path.join(root, f"iter_{i:07d}"))
    if tracker is not None:
        with open(os.path.join(root, run_dirs.TRACKER), "w") as f:
            f.write(str(tracker))
    return str(root)


def test_check_run_dirs_cases(tmp_path):
    run = _mk_run(tmp_path / "run", [2, 4])
    os.makedirs(tmp_path / "run" / "iter_0000006.tmp")  # an interrupted save is not a checkpoint
    assert run_dirs.list_iterations(run) == [2, 4]
    with pytest.raises(CheckpointError, match=r"iter_0000002, iter_0000004 but no .*--ckpt-step 4"):
        run_dirs.check_run_dirs(run, run)
    run_dirs.check_run_dirs(run, run, step=2)  # an explicit step loads
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        run_dirs.check_run_dirs(None, run)
    fresh = str(tmp_path / "requeue")
    run_dirs.check_run_dirs(fresh, fresh)  # first start of a requeued job
    with pytest.raises(CheckpointError, match="no such directory"):
        run_dirs.check_run_dirs(fresh, str(tmp_path / "elsewhere"))
    empty = _mk_run(tmp_path / "empty", [])
    run_dirs.check_run_dirs(empty, empty)
    tracked = _mk_run(tmp_path / "tracked", [2], tracker=2)
    run_dirs.check_run_dirs(tracked, tracked)
    with pytest.raises(CheckpointError, match="Resume with --load"):
        run_dirs.check_run_dirs(None, tracked)


def test_check_conversion_target(tmp_path):
    src = _mk_run(tmp_path / "src", [2], tracker=2)
    with pytest.raises(CheckpointError, match="replace the source"):
        run_dirs.check_conversion_target(src, str(tmp_path / "src" / "."))
    busy = _mk_run(tmp_path / "busy", [4], tracker=4)
    with pytest.raises(CheckpointError, match="not empty"):
        run_dirs.check_conversion_target(src, busy)
    run_dirs.check_conversion_target(src, busy, overwrite=True)
    run_dirs.check_conversion_target(src, str(tmp_path / "new"))
    run_dirs.check_conversion_target(src, _mk_run(tmp_path / "empty", []))


# --------------------------------------------------------------------------------- token range
def _corpus(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(get_bin_path(prefix), dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize(get_idx_path(prefix))
    return IndexedDataset(prefix)


def test_token_range_matches_brute_force_and_is_cached(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=rng.integers(1, 50)).tolist() for _ in range(60)]
    docs[41][3] = 777
    monkeypatch.setattr(tr, "_CHUNK", 64)  # many chunks
    ds = _corpus(str(tmp_path / "c"), docs)
    r = tr.token_range(ds, str(tmp_path / "cache"))
    flat = np.concatenate([np.asarray(d) for d in docs])
    assert (r.max_id, r.min_id, r.tokens) == (flat.max(), flat.min(), flat.size)
    assert (r.max_document, r.max_sequence, r.max_offset) == (41, 41, 3)
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: document 41 \(sequence 41, token 3\) holds token id 777"):
        tr.check_token_ids(ds, 500, str(tmp_path / "cache"))
    tr.check_token_ids(ds, 778, str(tmp_path / "cache"))

    def no_scan(_ds):
        raise AssertionError("scanned again")

    monkeypatch.setattr(tr, "compute_token_range", no_scan)  # later starts read the cache: O(1)
    assert tr.token_range(IndexedDataset(str(tmp_path / "c")), str(tmp_path / "cache")) == r
    docs[0][0] = 999  # a rewritten corpus invalidates the entry
    monkeypatch.undo()
    ds2 = _corpus(str(tmp_path / "c"), docs)
    os.utime(get_bin_path(str(tmp_path / "c")), ns=(1, 1))
    assert tr.token_range(ds2, str(tmp_path / "cache")).max_id == 999


def test_builder_checks_the_vocabulary(tmp_path):
    from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
    from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig

    _corpus(str(tmp_path / "c"), [[1, 2, 3, 90] * 10, [5, 6] * 10])
    cfg = GPTDatasetConfig(sequence_length=8, split="1,0,0", vocab_size=90)
    with pytest.raises(IndexedDatasetError, match="document 0 .* token id 90"):
        build_train_valid_test_datasets(str(tmp_path / "c"), "1,0,0", [4, 0, 0], cfg)
    cfg = GPTDatasetConfig(sequence_length=8, split="1,0,0", vocab_size=91)
    assert build_train_valid_test_datasets(str(tmp_path / "c"), "1,0,0", [4, 0, 0], cfg)[0] is not None


# ---------------------------------------------------------------------------------- checkpoint I/O
def test_load_torch_names_what_it_found(tmp_path):
    good = str(tmp_path / "good.pt")
    save_torch({"a": torch.arange(1000)}, good)
    assert torch.equal(load_torch(good)["a"], torch.arange(1000))
    data = open(good, "rb").read()
    cases = {"trunc.pt": data[: len(data) // 2], "empty.pt": b"", "text.pt": b"hello world"}
    expect = {"trunc.pt": "truncated or corrupt torch file", "empty.pt": "empty file (0 bytes): truncated",
              "text.pt": "not a torch file"}
    for name, content in cases.items():
        p = str(tmp_path / name)
        open(p, "wb").write(content)
        with pytest.raises(CheckpointIOError) as e:
            load_torch(p)
        assert p in str(e.value) and expect[name] in str(e.value) and "rank 0" in str(e.value)
    with pytest.raises(CheckpointIOError, match="missing"):
        load_torch(str(tmp_path / "none.pt"))


def test_read_json_names_the_file(tmp_path):
    p = str(tmp_path / "metadata.json")
    open(p, "w").write('{"a": 1,')
    with pytest.raises(CheckpointError, match=r"metadata\.json is corrupt: invalid JSON at line 1"):
        read_json(p)
    open(p, "w").write("")
    with pytest.raises(CheckpointError, match="an empty file"):
        read_json(p)
    open(p, "w").write("[1]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_json(p)


def test_squinch_state_dropped_is_reported(tmp_path):
    rank_dir = tmp_path / "mp_rank_00"
    rank_dir.mkdir()
    rpath = str(rank_dir / "reducer_dp_000.pt")
    squinch, plain = [SquinchReducer(None, 1)], [AllReduceReducer(None, 1)]
    meta = {"data_parallel_size": 2, "args": {"squinch": True}}
    assert reducer_state_dropped(rpath, True, squinch, meta) is None  # nothing saved, nothing dropped
    open(rpath, "wb").write(b"x")
    assert reducer_state_dropped(rpath, True, squinch, meta) is None
    assert "does not use --squinch: dropping it" in reducer_state_dropped(rpath, True, plain, meta)
    assert "another DP size: dropping it" in reducer_state_dropped(rpath, False, squinch, meta)
    os.remove(rpath)
    assert "start at zero" in reducer_state_dropped(rpath, True, squinch, {"args": {"squinch": False}})


# ---------------------------------------------------------------------------------- known errors
def test_known_errors_print_once_and_rank_local_ones_with_their_rank():
    plain, local = IndexedDatasetError("x.idx: truncated"), CheckpointIOError("cannot load a.pt")
    assert errors.format_known_error(plain, 0, 2) == "error: x.idx: truncated"
    assert errors.format_known_error(plain, 1, 2) is None
    assert errors.format_known_error(local, 1, 2) == "error: [rank 1] cannot load a.pt"
    assert errors.format_known_error(local, 0, 1) == "error: cannot load a.pt"


def test_run_cli_returns_2_without_traceback_and_keeps_unknown_errors(capsys):
    def bad():
        raise DivergenceError("training diverged at iteration 3")

    assert errors.run_cli(bad, (DivergenceError,)) == 2
    assert capsys.readouterr().err == "error: training diverged at iteration 3\n"

    def unknown():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        errors.run_cli(unknown, (DivergenceError,))


def test_safe_print_survives_a_closed_stream(monkeypatch):
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    closed = Closed()
    monkeypatch.setattr(sys, "stdout", closed)
    errors.safe_print("saved checkpoint")  # no exception
    assert sys.stdout is not closed
    errors.safe_print("and later lines go nowhere")


# ------------------------------------------------------------------------------ start-up checks
def test_generation_length_rules():
    assert "must be >= 0" in startup_checks.generation_length(3, -1, 16, 16, False)[0]
    assert startup_checks.generation_length(3, 13, 16, 16, False) == (None, None)
    err, warn = startup_checks.generation_length(3, 14, 16, 16, False)
    assert err is None and "past the trained context of 16" in warn
    err, warn = startup_checks.generation_length(3, 14, 16, 16, True)
    assert "exceeds the 16 learned positions" in err
    assert startup_checks.position_limit(16, 16) is None and "--seq-length 17" in startup_checks.position_limit(17, 16)


def test_preprocess_refuses_ids_outside_the_vocabulary(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import preprocess_data

    real = preprocess_data.build_tokenizer

    def build(**kw):
        tok = real(**kw)
        tok.tokenize = lambda text: [int(w) if int(w) != 7 else tok.vocab_size + 2 for w in text.split()]
        return tok

    monkeypatch.setattr(preprocess_data, "build_tokenizer", build)
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": "4 7 5"}\n')
    with pytest.raises(preprocess_data.PreprocessError, match=r"in\.jsonl:2: key 'text': token id 103 is outside"):
        preprocess_data.preprocess(str(path), str(tmp_path / "out"), "NullTokenizer", vocab_size=100,
                                   progress=False, log=lambda m: None, skip_bad_lines=True)
    assert not os.path.exists(tmp_path / "out_text_document.idx")

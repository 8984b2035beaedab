"""A same-size ``.bin`` replacement, copied over with its mtime kept, is caught at resume (issue 39, point 5).

The checkpoint records each corpus file's content fingerprint (metadata.json ``data_fingerprints``); index
caches and the vocabulary check are keyed on the same fingerprints. Both variants of the attack:

* out-of-vocabulary ids: one ``error:`` line naming the ``.bin``; with ``--allow-data-change`` the vocabulary
  check runs afresh (its cache no longer matches) and names the document and the id. Before: the stale
  vocabulary cache let the run start, and the embedding raised IndexError (a traceback).
* valid ids: one ``error:`` line naming the ``.bin``; with ``--allow-data-change`` a warning naming it and a
  line counting the changed files, then training goes on. Before: a silent resume on other data.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_cai.core.datasets.indexed_dataset import get_bin_path, get_idx_path

from .test_faults import assert_one_error, data_flags, run, snapshot, tracker, write_corpus

VOCAB = 100


def _train(tmp_path) -> tuple[str, str, list[str]]:
    docs = [[(7 * i + j) % VOCAB for j in range(40)] for i in range(20)]
    os.makedirs(tmp_path / "data")
    prefix = write_corpus(str(tmp_path / "data" / "c_text_document"), docs)
    save = str(tmp_path / "ckpt")
    proc = run([*data_flags(prefix, VOCAB), "--save", save])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    resume = data_flags(prefix, VOCAB)
    resume[resume.index("--train-iters") + 1] = "4"
    return prefix, save, [*resume, "--load", save, "--save", save]


def _replace_bin_keeping_mtime(prefix: str, new_ids: np.ndarray) -> None:
    path = get_bin_path(prefix)
    st = os.stat(path)
    data = new_ids.astype(np.uint16).tobytes()
    assert len(data) == st.st_size  # the same size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` would leave it
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("variant", ["out_of_vocabulary", "valid_ids"])
def test_same_size_data_replacement_is_caught_at_resume(tmp_path, variant):
    prefix, save, resume = _train(tmp_path)
    ids = np.fromfile(get_bin_path(prefix), dtype=np.uint16)
    if variant == "out_of_vocabulary":
        ids[5::40] = 150  # token 5 of every document: any batch reads one
    else:
        ids = (ids + 1) % VOCAB  # every id valid, every token different
    idx_before = open(get_idx_path(prefix), "rb").read()
    _replace_bin_keeping_mtime(prefix, ids)
    before = snapshot(save)

    proc = run(resume)
    assert_one_error(proc, get_bin_path(prefix), "is not the data checkpoint", "iter_0000002", "--allow-data-change")
    assert snapshot(save) == before and tracker(save) == 2  # nothing trained, nothing written

    proc = run([*resume, "--allow-data-change"])
    if variant == "out_of_vocabulary":
        assert_one_error(proc, get_bin_path(prefix), "document 0", "token id 150")
        assert tracker(save) == 2
    else:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert f"WARNING: {get_bin_path(prefix)} is not the data checkpoint" in out
        assert "data changed since checkpoint" in out and "1 of 2 data files differ" in out
        assert tracker(save) == 4
    assert open(get_idx_path(prefix), "rb").read() == idx_before  # only the .bin changed
    meta = json.load(open(os.path.join(save, "iter_0000002", "metadata.json")))
    assert set(meta["data_fingerprints"]) == {os.path.abspath(prefix)}  # the record the resume compared

"""The checkpoint's record of its data (training/checkpoint/data_record.py): what it records, and a resume on
changed data as an error naming the file, or with --allow-data-change a warning per file and a count."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.fingerprint import forget_cached_fingerprints
from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron_cai.training.checkpoint.data_record import RECORD_KEY, check_data, data_fingerprints
from megatron_cai.training.checkpoint.file_io import CheckpointError
from megatron_cai.training.config import DataConfig


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def _corpus(prefix: str, first: int = 1) -> str:
    with IndexedDatasetBuilder(get_bin_path(prefix), np.uint16) as b:
        for i in range(5):
            b.add_document([first + i, 2, 3])
        b.finalize(get_idx_path(prefix))
    return prefix


def _rewrite_bin(prefix: str) -> None:
    ids = np.fromfile(get_bin_path(prefix), dtype=np.uint16)
    st = os.stat(get_bin_path(prefix))
    (ids + 1).tofile(get_bin_path(prefix))
    os.utime(get_bin_path(prefix), ns=(st.st_atime_ns, st.st_mtime_ns))
    forget_cached_fingerprints()  # rewritten within this process, maybe within one ctime tick


def test_record_lists_every_prefix_of_every_path(tmp_path):
    a, b = _corpus(str(tmp_path / "a")), _corpus(str(tmp_path / "b"))
    data = DataConfig(data_path=["0.3", a, "0.7", b], valid_data_path=[a])
    record = data_fingerprints(data)
    assert list(record) == [os.path.abspath(a), os.path.abspath(b)]
    assert record[a]["idx"] == record[b]["idx"] and record[a]["bin"] == record[b]["bin"]  # same bytes
    assert data_fingerprints(DataConfig(mock_data=True, data_path=[a])) == {}


def test_changed_bin_is_an_error_naming_it_or_a_counted_warning(tmp_path):
    a, b = _corpus(str(tmp_path / "a")), _corpus(str(tmp_path / "b"), first=10)
    data = DataConfig(data_path=[a, b])
    meta = {RECORD_KEY: data_fingerprints(data)}
    assert check_data(meta, data, "CKPT", allowed=False) == 0
    _rewrite_bin(b)
    with pytest.raises(CheckpointError, match=f"^{get_bin_path(b)} is not the data checkpoint CKPT was trained on"):
        check_data(meta, data, "CKPT", allowed=False)
    lines = []
    assert check_data(meta, data, "CKPT", allowed=True, log=lines.append) == 1
    assert lines == [f" WARNING: {get_bin_path(b)} is not the data checkpoint CKPT was trained on (its content "
                     f"fingerprint differs); going on: --allow-data-change",
                     " data changed since checkpoint CKPT: 1 of 4 data files differ"]


def test_moved_corpus_is_matched_by_name_and_a_new_prefix_is_not_compared(tmp_path):
    os.makedirs(tmp_path / "old")
    a = _corpus(str(tmp_path / "old" / "a"))
    meta = {RECORD_KEY: data_fingerprints(DataConfig(data_path=[a]))}
    os.makedirs(tmp_path / "new")
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, str(tmp_path / "new" / "a") + ext)
    moved = str(tmp_path / "new" / "a")
    new = _corpus(str(tmp_path / "new" / "c"), first=50)
    assert check_data(meta, DataConfig(data_path=[moved, new]), "CKPT", allowed=False) == 0
    _rewrite_bin(moved)
    with pytest.raises(CheckpointError, match=get_bin_path(moved)):
        check_data(meta, DataConfig(data_path=[moved]), "CKPT", allowed=False)


def test_a_checkpoint_without_a_record_says_so(tmp_path):
    a = _corpus(str(tmp_path / "a"))
    lines = []
    assert check_data({}, DataConfig(data_path=[a]), "CKPT", allowed=False, log=lines.append) == 0
    assert lines == [" checkpoint CKPT records no data fingerprints (saved before they were): the data is not "
                     "compared"]

"""The data a checkpoint was trained on: each corpus prefix's content fingerprint, kept in ``metadata.json``
(``data_fingerprints``) and compared on resume.

A prefix of this run whose ``.idx`` or ``.bin`` differs from the checkpoint's record is a
:class:`CheckpointError` naming the file, or with ``--allow-data-change`` one warning per changed file and
a line counting them. A prefix is matched by its absolute path, else by its file name when exactly one
recorded prefix has it (a corpus moved to another directory); a prefix the checkpoint does not record (a
new blend component) is not compared. What a fingerprint sees and misses: core/datasets/fingerprint.py.
"""
from __future__ import annotations

import os

from ...core import parallel_state as ps
from ...core.datasets.fingerprint import prefix_fingerprint
from ...core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from ...core.datasets.utils import get_blend_from_list
from ..config import DataConfig
from ..errors import safe_print
from .file_io import CheckpointError

RECORD_KEY = "data_fingerprints"


def data_prefixes(data: DataConfig) -> list[str]:
    """Every corpus prefix of ``--data-path`` and the per-split paths, absolute, in order, once each."""
    if data.mock_data:
        return []
    out: list[str] = []
    for paths in (data.data_path, data.train_data_path, data.valid_data_path, data.test_data_path):
        if paths:
            out += [os.path.abspath(p) for p in get_blend_from_list(paths)[0]]
    return list(dict.fromkeys(out))


def data_fingerprints(data: DataConfig) -> dict[str, dict[str, str]]:
    """``{absolute prefix: {"idx": digest, "bin": digest}}`` of the run's corpora (missing ones left out:
    the dataset builder names them)."""
    return {p: prefix_fingerprint(p) for p in data_prefixes(data) if IndexedDataset.exists(p)}


def _recorded(saved: dict, prefix: str) -> dict | None:
    if prefix in saved:
        return saved[prefix]
    same_name = [p for p in saved if os.path.basename(p) == os.path.basename(prefix)]
    return saved[same_name[0]] if len(same_name) == 1 else None


def changed_files(saved: dict, here: dict) -> list[str]:
    """The ``.idx`` / ``.bin`` files of ``here`` whose fingerprint differs from the record in ``saved``."""
    changed = []
    for prefix, now in here.items():
        then = _recorded(saved, prefix)
        if then is None:
            continue
        changed += [path for part, path in (("idx", get_idx_path(prefix)), ("bin", get_bin_path(prefix)))
                    if then.get(part) != now[part]]
    return changed


def check_data(meta: dict, data: DataConfig, where: str, allowed: bool, log=safe_print) -> int:
    """This run's corpora against the checkpoint's record; returns how many files changed (0 when it has none).

    A change is an error unless ``allowed`` (``--allow-data-change``), then each file is a warning."""
    saved = meta.get(RECORD_KEY)
    here = data_fingerprints(data)
    if saved is None:
        if here and ps.get_rank() == 0:
            log(f" checkpoint {where} records no data fingerprints (saved before they were): the data is not "
                f"compared")
        return 0
    changed = changed_files(saved, here)
    if changed and not allowed:
        raise CheckpointError(f"{changed[0]} is not the data checkpoint {where} was trained on: its content "
                              f"fingerprint differs from the one recorded at save ({len(changed)} changed "
                              f"file(s)); restore the original files, or pass --allow-data-change to go on with "
                              f"these")
    if changed and ps.get_rank() == 0:
        for path in changed:
            log(f" WARNING: {path} is not the data checkpoint {where} was trained on (its content fingerprint "
                f"differs); going on: --allow-data-change")
        log(f" data changed since checkpoint {where}: {len(changed)} of {2 * len(here)} data files differ")
    return len(changed)

"""The exception classes that mean "the user can fix this": printed as one ``error:`` line, exit 2.

Only entry points (``pretrain_gpt.py``, ``tools/*.py``) import this module, so it may import from
everywhere without creating import cycles.
"""
from __future__ import annotations

from ..core.datasets.indexed_dataset import IndexedDatasetError
from ..core.parallel_state import ParallelLayoutError
from .arguments import ArgumentError
from .checkpoint import CheckpointError, ConversionError
from .divergence import DivergenceError
from .errors import DataError, RankLocalError

KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    ArgumentError, CheckpointError, ConversionError, IndexedDatasetError, ParallelLayoutError, DataError,
    DivergenceError, RankLocalError)

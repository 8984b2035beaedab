"""The token dtype is chosen as megatron-core's IndexedDataset optimal_dtype chooses it, and preprocessing uses it."""
import numpy as np
import pytest

from megatron_cai.core.datasets.indexed_dataset import DType

SIZES = [None, 1, 256, 32000, 50257, 65499, 65500, 65535, 65536, 65537, 100000, 128256]


def test_matches_megatron_core_optimal_dtype():
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    for n in SIZES:
        assert DType.optimal_dtype(n) == mcore.DType.optimal_dtype(n), n


def test_boundary_by_hand():
    assert [DType.optimal_dtype(n) for n in (65499, 65500, 65536)] == [np.uint16, np.int32, np.int32]

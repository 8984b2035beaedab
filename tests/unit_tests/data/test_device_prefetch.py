"""DevicePrefetcher: the same micro-batches in the same order; with lookahead the next step's copies start
before the step that takes them (a recording copy stands in for the host-to-device transfer on CPU)."""
import pytest
import torch

from megatron_cai.core.datasets.device_prefetch import DevicePrefetcher


class _Source:
    """Batches {"tokens": [i]} for i = 0..n-1, counting how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.read == self.n:
            raise StopIteration
        self.read += 1
        return {"tokens": torch.tensor([self.read - 1])}


def _ids(batches) -> list[int]:
    return [int(b["tokens"]) for b in batches]


def test_cpu_default_reads_nothing_ahead_and_keeps_order():
    src = _Source(10)
    pf = DevicePrefetcher(src, torch.device("cpu"))
    assert _ids(pf.take(3)) == [0, 1, 2] and src.read == 3
    assert _ids(pf.take(2)) == [3, 4] and src.read == 5


def test_lookahead_copies_the_next_step_before_it_is_taken():
    src, copied = _Source(20), []

    def copy(batch):
        copied.append(int(batch["tokens"]))
        return {k: v.clone() for k, v in batch.items()}

    pf = DevicePrefetcher(src, torch.device("cpu"), lookahead=True, copy=copy)
    assert _ids(pf.take(3)) == [0, 1, 2]
    assert copied == [0, 1, 2, 3, 4, 5], "the next step's three batches must be copied before take returns"
    assert _ids(pf.take(3)) == [3, 4, 5] and copied[-3:] == [6, 7, 8]
    assert _ids(pf.take(5)) == [6, 7, 8, 9, 10], "a larger batch (ramp-up) takes the rest when asked"
    assert copied[-5:] == [11, 12, 13, 14, 15] and src.read == 16
    assert _ids(pf.take(1)) == [11]


def test_exhaustion_is_raised_only_for_a_batch_that_does_not_exist():
    src = _Source(5)
    pf = DevicePrefetcher(src, torch.device("cpu"), lookahead=True)
    assert _ids(pf.take(3)) == [0, 1, 2]  # reading ahead ran into the end: no error yet
    with pytest.raises(StopIteration):
        pf.take(3)
    assert _ids(pf.take(2)) == [3, 4]


@pytest.mark.gpu
def test_cuda_side_stream_copies_pinned_batches_intact():
    device = torch.device("cuda")
    host = [{"tokens": torch.arange(i, i + 4096).pin_memory()} for i in range(6)]
    pf = DevicePrefetcher(iter(host), device)
    assert pf.lookahead
    for step in range(3):
        got = pf.take(2)
        for j, b in enumerate(got):
            assert b["tokens"].device.type == "cuda"
            torch.testing.assert_close(b["tokens"].cpu(), host[2 * step + j]["tokens"])

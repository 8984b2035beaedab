"""Megatron's pretraining sampler and data loader; the resume point is ``consumed_samples``.

Samples are read in global order ``consumed_samples, consumed_samples + 1, ...`` (the dataset is
already shuffled by its ``shuffle_index``). Every block of ``micro_batch_size * data_parallel_size``
consecutive indices forms one micro-batch per DP rank: rank r takes the slice
``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of the block. Restarting with the saved
``consumed_samples`` (global samples consumed by all DP ranks together) continues exactly where an
uninterrupted run would have been.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch


class MegatronPretrainingSampler:
    """Batch sampler yielding this DP rank's micro-batch indices (Megatron ``--dataloader-type single``)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to load (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be in [0, {total_samples}): the dataset is "
                f"exhausted (build it with more samples, e.g. a larger --train-samples/--train-iters)"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.micro_batch_times_data_parallel_size)
        partial = not self.drop_last and rest > self.data_parallel_rank * self.micro_batch_size
        return full + int(partial)

    def __iter__(self) -> Iterator[list[int]]:
        block = self.micro_batch_times_data_parallel_size
        beg = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + block <= self.total_samples:
            yield list(range(start + beg, start + beg + self.micro_batch_size))
            start += block
        if not self.drop_last and start < self.total_samples:
            batch = list(range(start, self.total_samples))[beg:beg + self.micro_batch_size]
            if batch:
                yield batch


def build_pretraining_data_loader(dataset: torch.utils.data.Dataset | None, consumed_samples: int,
                                  micro_batch_size: int, data_parallel_rank: int = 0,
                                  data_parallel_size: int = 1, num_workers: int = 0,
                                  drop_last: bool = True, pin_memory: bool = False,
                                  ) -> torch.utils.data.DataLoader | None:
    """A ``DataLoader`` over ``dataset`` starting after ``consumed_samples`` global samples.

    Yields dicts of stacked tensors (``tokens`` [mbs, seq], ``labels``, ``loss_mask``,
    ``position_ids``, and ``visibility_start``/``visibility_limit`` when the dataset provides them).
    Returns ``None`` for a ``None`` dataset (a split that does not exist).
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size, drop_last)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # A private generator: creating the iterator must not draw from the global RNG, whose state is
        # part of the checkpoint (bit-exact resume).
        generator=torch.Generator(),
    )

"""Synthetic GPT samples for tests and smoke runs (``--mock-data``): no files, fully deterministic.

Each sample is an arithmetic token sequence ``(a * t + b) mod vocab`` with (a, b) drawn from the sample
index, so a model can learn it and every rank regenerates identical samples.
"""
from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, idx])
        a, b = rng.integers(1, 8), rng.integers(0, self.vocab_size)
        text = (a * np.arange(self.seq_length + 1) + b) % self.vocab_size
        noise = rng.random(self.seq_length + 1) < 0.1
        text[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        text = torch.from_numpy(text.astype(np.int64))
        return {"tokens": text[:-1].clone(), "labels": text[1:].clone(),
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length, dtype=torch.int64)}

"""How a full ("canonical") tensor maps to tensor-parallel shards, and back.

A TP-split parameter records ``tp_dim`` (the split dimension) and ``tp_sections``: the full sizes of the
sections stacked along that dimension (e.g. ``[gate, up]`` of a SwiGLU fc1). Each section is split into
TP equal chunks separately, and a rank's local tensor is its chunk of every section, concatenated. So
the canonical layout never depends on TP, which is what makes checkpoints and HF export reshardable.
"""
from __future__ import annotations

import torch


def section_sizes(full_size: int, sections: list[int] | None) -> list[int]:
    sections = list(sections) if sections else [full_size]
    if sum(sections) != full_size:
        raise ValueError(f"sections {sections} do not add up to the dimension size {full_size}")
    return sections


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int,
                 sections: list[int] | None = None) -> torch.Tensor:
    """This rank's shard of a canonical tensor (contiguous)."""
    parts = []
    for chunk in full.split(section_sizes(full.shape[dim], sections), dim=dim):
        if chunk.shape[dim] % world != 0:
            raise ValueError(f"dimension {dim} section of size {chunk.shape[dim]} is not divisible by "
                             f"tensor-model-parallel size {world}")
        parts.append(chunk.chunk(world, dim=dim)[rank])
    return torch.cat(parts, dim=dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], dim: int, sections: list[int] | None = None) -> torch.Tensor:
    """Reassemble the canonical tensor from all ranks' shards (inverse of `shard_tensor`)."""
    world = len(shards)
    full_size = shards[0].shape[dim] * world
    sizes = section_sizes(full_size, sections)
    local_sizes = [s // world for s in sizes]
    per_rank = [s.split(local_sizes, dim=dim) for s in shards]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(world)], dim=dim)
                      for i in range(len(sizes))], dim=dim)


def divide(numerator: int, denominator: int, what: str = "") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what or numerator} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator

"""``--check-weight-hash-across-dp-replicas-interval N``: every N iterations, the data-parallel (x context-parallel)
replicas of each model shard must hold bit-identical weights (megatron-core's
``check_param_hashes_across_dp_replicas``). Each rank hashes its parameters (SHA-256 over the bytes, in name
order); the digests are all-gathered over the DP x CP group; a difference stops the run with one ``error:``
line naming the ranks whose weights differ from the majority. Not with FSDP2, whose DP ranks hold shards, not
replicas (refused, as megatron-core refuses it with Megatron-FSDP's optim_grads_params)."""
from __future__ import annotations

import hashlib
from collections import Counter

import torch
import torch.distributed as dist

from ...core import parallel_state as ps
from ..errors import UserError


class WeightReplicaMismatchError(UserError, RuntimeError):
    """Data-parallel replicas hold different weights."""


def weights_digest(modules: list[torch.nn.Module]) -> bytes:
    """SHA-256 of every parameter's bytes, in name order, over ``modules``."""
    digest = hashlib.sha256()
    for i, module in enumerate(modules):
        for name, p in sorted(module.named_parameters()):
            digest.update(f"{i}.{name}".encode())
            digest.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.digest()


def check_weight_replicas(modules: list[torch.nn.Module], iteration: int, device: torch.device) -> None:
    """Compare this rank's weights with its DP x CP replicas' (collective over that group); raise
    :class:`WeightReplicaMismatchError` naming the ranks that differ."""
    group = ps.get_data_parallel_group(with_context_parallel=True)
    mine = torch.frombuffer(bytearray(weights_digest(modules)), dtype=torch.uint8).to(device)
    if group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    digests = [bytes(t.cpu().tolist()) for t in gathered]
    majority, _ = Counter(digests).most_common(1)[0]
    differ = [r for r, d in zip(ranks, digests) if d != majority]
    if differ:
        group_ranks = ", ".join(map(str, ranks))
        raise WeightReplicaMismatchError(
            f"--check-weight-hash-across-dp-replicas-interval: at iteration {iteration} the weights of rank(s) "
            f"{', '.join(map(str, differ))} differ from their data-parallel replicas' (ranks {group_ranks}; the "
            f"others agree)")

"""Context parallelism (``--context-parallel-size``): one sequence split over CP ranks, attention that
moves and computes only what some query can see.

- :mod:`.split`: the sequence split (Megatron-LM's zig-zag for causal; balanced by visible pairs for
  packed documents and trees);
- :mod:`.plan`: which keys each rank needs from each peer (from the visibility intervals) and the
  per-key-set intervals in local-row coordinates;
- :mod:`.exchange`: the point-to-point transfers and their byte counts;
- :mod:`.kernels`: per-key-set kernels (blocked on CPU, Triton on CUDA) with a backward that takes the
  merged softmax's lse;
- :mod:`.attention`: the autograd Function (log-sum-exp merge, Z-Reg, dK/dV returned to their owners);
- :mod:`.batch`: a rank's share of a micro-batch and the visibility object its layers receive.

The scheme is described in docs/context-parallel.md.
"""
from .batch import ContextParallelVisibility, get_batch_on_this_cp_rank, shard_batch
from .split import SequenceSplit, balanced_split, zigzag_split

__all__ = ["ContextParallelVisibility", "SequenceSplit", "balanced_split", "get_batch_on_this_cp_rank",
           "shard_batch", "zigzag_split"]

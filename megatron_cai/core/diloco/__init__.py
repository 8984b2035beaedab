"""DiLoCo across islands (docs/diloco.md): islands train with ordinary data parallelism for H inner steps, then
average their pseudo-gradients (fp32, bf16 or Squinch 6-bit with error feedback) and apply them with a
Nesterov outer optimizer, fragment by fragment (Streaming DiLoCo), overlapped with the inner steps.

``DilocoConfig`` (config.py) from the flags; ``DilocoOuter`` (outer.py) over a rank's flat weights;
``OuterReduce`` (outer_reduce.py) the compressed outer all-reduce; outer_model.py its step-time model.
The training loop's seam is ``megatron_cai/training/features/diloco.py``.
"""
from .config import OUTER_BITS, DilocoConfig
from .outer import DilocoOuter, FlatWeights, IslandGroups, IslandLostError, OuterStats, fragment_bounds
from .outer_reduce import OuterReduce

__all__ = ["OUTER_BITS", "DilocoConfig", "DilocoOuter", "FlatWeights", "IslandGroups", "IslandLostError",
           "OuterReduce", "OuterStats", "fragment_bounds"]

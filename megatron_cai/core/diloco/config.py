"""DilocoConfig: the outer loop of DiLoCo across islands (docs/diloco.md), built from ``--diloco-*``."""
from __future__ import annotations

from dataclasses import dataclass

OUTER_BITS = (6, 16, 32)  # Squinch v1, bf16, fp32 pseudo-gradients on the wire


@dataclass(frozen=True)
class DilocoConfig:
    """``islands`` = 1 with ``inner_steps`` = 0 is off (plain data parallelism).

    Fragment ``f`` (0 .. fragments - 1) sends its pseudo-gradient after inner steps ``t`` with
    ``t % inner_steps == offset(f)`` and applies the outer update ``overlap_steps`` inner steps later; the
    island's weights of that fragment become ``local_weight * local + (1 - local_weight) * outer``. After the
    last training iteration (``final_average``) every island's weights become the islands' mean.
    """

    islands: int = 1              # --diloco-islands
    inner_steps: int = 0          # --diloco-inner-steps H (0: DiLoCo off)
    outer_lr: float = 0.7         # --diloco-outer-lr
    outer_momentum: float = 0.9   # --diloco-outer-momentum (Nesterov; 0: plain SGD)
    outer_bits: int = 6           # --diloco-outer-bits 6 (Squinch) | 16 (bf16) | 32 (fp32)
    fragments: int = 1            # --diloco-fragments K (Streaming DiLoCo)
    overlap_steps: int = 0        # --diloco-overlap-steps tau: inner steps the outer all-reduce overlaps
    local_weight: float = 0.0     # --diloco-local-weight alpha: mixing at apply time (0: take the outer weights)
    error_feedback: bool = True   # --no-diloco-error-feedback turns it off (6 and 16 bits)
    final_average: bool = True    # --no-diloco-final-average: the islands keep their own weights at the end

    @property
    def enabled(self) -> bool:
        return self.inner_steps > 0

    def problems(self) -> list[str]:
        """Every impossible combination, each naming its flag (empty when the config is usable)."""
        out = []
        if self.islands < 1:
            out.append(f"--diloco-islands must be >= 1, got {self.islands}")
        if self.islands > 1 and not self.enabled:
            out.append(f"--diloco-islands {self.islands} needs --diloco-inner-steps H >= 1")
        if self.inner_steps < 0:
            out.append(f"--diloco-inner-steps must be >= 0, got {self.inner_steps}")
        if self.outer_bits not in OUTER_BITS:
            out.append(f"--diloco-outer-bits must be one of {OUTER_BITS}, got {self.outer_bits}")
        if not 0.0 <= self.outer_momentum < 1.0:
            out.append(f"--diloco-outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not self.outer_lr > 0:
            out.append(f"--diloco-outer-lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.local_weight <= 1.0:
            out.append(f"--diloco-local-weight must be in [0, 1], got {self.local_weight}")
        if self.fragments < 1 or (self.enabled and self.fragments > self.inner_steps):
            out.append(f"--diloco-fragments must be in 1 .. --diloco-inner-steps ({self.inner_steps}), "
                       f"got {self.fragments}")
        if self.overlap_steps < 0 or (self.enabled and self.overlap_steps >= self.inner_steps):
            out.append(f"--diloco-overlap-steps must be in 0 .. --diloco-inner-steps - 1 ({self.inner_steps - 1}), "
                       f"got {self.overlap_steps}: a fragment's update must land before it is sent again")
        return out

    def send_offset(self, fragment: int) -> int:
        """The inner step (mod H) after which ``fragment`` sends: spread evenly, the last one at H."""
        return (self.inner_steps * (fragment + 1) // self.fragments) % self.inner_steps

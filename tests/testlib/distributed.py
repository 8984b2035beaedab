"""The gloo test harness lives in the package (benchmarks use it too); re-exported for tests."""
from megatron_cai.testing.distributed import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]

"""The host-synchronisation counter lives in the package (benchmarks use it too); re-exported for tests."""
from megatron_cai.testing.host_sync import METHODS, HostSyncCounter

__all__ = ["METHODS", "HostSyncCounter"]

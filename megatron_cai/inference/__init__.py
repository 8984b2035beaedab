"""Text generation from trained checkpoints (KV-cache sampling)."""

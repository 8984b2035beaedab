"""Start-up checks that turn late crashes into one clear message.

Each check returns the problem as a string (None when fine) so that callers raise their own error
type; ``raise_if`` raises a ``DataError`` for the data checks.
"""
from __future__ import annotations

from .errors import DataError


def position_limit(seq_length: int, max_position_embeddings: int | None) -> str | None:
    """Megatron's rule: ``--seq-length`` may not exceed ``--max-position-embeddings`` (any position type)."""
    if max_position_embeddings is not None and seq_length > max_position_embeddings:
        return (f"--seq-length {seq_length} is larger than --max-position-embeddings {max_position_embeddings}; "
                f"raise --max-position-embeddings to at least {seq_length} or lower --seq-length")
    return None


def empty_train_split(train_ds, train_iters: int, data_path, split: str) -> str | None:
    """The train split is empty (an empty corpus, or a --split that gives training no documents)."""
    if train_ds is None and train_iters > 0:
        return (f"--data-path {' '.join(map(str, data_path or []))}: the train split is empty (the corpus has no "
                f"documents with at least 2 tokens, or --split {split} gives training none); nothing to train on")
    return None


def generation_length(prompt_tokens: int, max_new_tokens: int, trained_context: int,
                      max_position_embeddings: int | None, learned_positions: bool) -> tuple[str | None, str | None]:
    """(error, warning) for generating ``max_new_tokens`` after a prompt of ``prompt_tokens`` tokens."""
    if max_new_tokens < 0:
        return f"--max-new-tokens must be >= 0, got {max_new_tokens}", None
    total = prompt_tokens + max_new_tokens
    if learned_positions and max_position_embeddings is not None and total > max_position_embeddings:
        return (f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} = {total} tokens exceeds "
                f"the {max_position_embeddings} learned positions of this model"), None
    if total > trained_context:
        return None, (f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} = {total} tokens goes "
                      f"past the trained context of {trained_context} tokens (the run's --seq-length): positions "
                      f"beyond it were never trained, expect degraded text")
    return None, None


def raise_if(problem: str | None) -> None:
    if problem:
        raise DataError(problem)

"""Damage to files on disk, undone afterwards: the byte flips the integrity tests inject."""
from __future__ import annotations

from collections.abc import Iterator


def each_byte_flipped(path: str, mask: int = 0x01) -> Iterator[int]:
    """Flip one byte of ``path`` (its first, a middle one, its last) with ``mask``, yielding the offset while
    the file holds that flip; the original bytes are back after each step and at the end."""
    original = open(path, "rb").read()
    for offset in sorted({0, len(original) // 2, len(original) - 1}):
        data = bytearray(original)
        data[offset] ^= mask
        open(path, "wb").write(bytes(data))
        try:
            yield offset
        finally:
            open(path, "wb").write(original)

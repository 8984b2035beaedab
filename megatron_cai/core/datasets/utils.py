"""Dataset helpers: ``--split`` and ``--data-path`` parsing, and the on-disk ``.npy`` index cache."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence

import numpy as np

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def parse_and_normalize_split(split: str) -> list[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]`` (Megatron rule: padded with zeros to 3, normalized)."""
    parts = [p for p in re.split(r"[,/]", str(split).strip()) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers "
                         f"like '969,30,1'") from None
    if not values or len(values) > 3:
        raise ValueError(f"--split {split!r}: expected 1 to 3 comma-separated numbers, got {len(values)}")
    if any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: weights must be finite, >= 0 and not all 0")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_elements: int) -> list[tuple[int, int] | None]:
    """Contiguous ``[begin, end)`` element ranges of train/valid/test (``None`` for a zero-weight split)."""
    weights = parse_and_normalize_split(split)
    bookends = np.cumsum([0.0] + weights)
    ranges: list[tuple[int, int] | None] = []
    for i in range(3):
        if weights[i] == 0:
            ranges.append(None)
            continue
        beg = int(round(bookends[i] * float(num_elements)))
        end = int(round(min(bookends[i + 1], 1.0) * float(num_elements)))
        ranges.append((beg, end))
    return ranges


def get_blend_from_list(data_path: str | Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` rules: one prefix, ``W1 P1 W2 P2 ...``, or a list of prefixes.

    Returns ``(prefixes, weights)``; ``weights`` is ``None`` for an unweighted list.
    """
    items = [data_path] if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) == 1:
        return items, None

    def is_number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    evens = [is_number(x) for x in items[0::2]]
    if all(evens) and len(items) % 2 == 0:
        weights = [float(x) for x in items[0::2]]
        if any(w < 0 or not np.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights must be finite, >= 0 and not all 0: {weights}")
        return items[1::2], weights
    if not any(evens):
        return items, None
    raise ValueError(
        "--data-path: give one prefix, a list of prefixes, or weight/prefix pairs 'W1 P1 W2 P2 ...'; "
        f"got a mix of numbers and paths: {items}"
    )


def description_hash(description: str) -> str:
    """MD5 of a JSON description (the cache key)."""
    return hashlib.md5(description.encode("utf-8")).hexdigest()


def to_json(obj: dict) -> str:
    """Stable JSON for hashing."""
    return json.dumps(obj, sort_keys=True, indent=2)


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """``np.save`` to a temporary file and rename, so readers never see a partial file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    """Write a text file through a temporary file + rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """Advisory exclusive lock (one builder per cache entry on a node); a no-op where unsupported."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # file systems without flock: atomic renames still keep readers safe
        yield
    finally:
        os.close(fd)


def _load_cached(paths: dict[str, str], description_path: str, description: str) -> dict | None:
    if not os.path.isfile(description_path) or not all(os.path.isfile(p) for p in paths.values()):
        return None
    try:
        with open(description_path, encoding="utf-8") as f:
            if f.read() != description:
                return None
        return {k: np.load(p, mmap_mode="r", allow_pickle=False) for k, p in paths.items()}
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable index cache %s (%s); rebuilding", description_path, e)
        return None


def load_or_build_indices(cache_dir: str | None, base: str, description: str,
                          names: Sequence[str], build: Callable[[], dict[str, np.ndarray]],
                          ) -> tuple[dict[str, np.ndarray], bool]:
    """Load ``<cache_dir>/<base>-<name>.npy`` arrays, or build and save them.

    ``base`` should start with the MD5 of ``description``. The description file is written last and
    compared on load, so it marks a complete entry. Returns ``(arrays, built_anew)``. Without a
    usable cache directory the arrays are built in memory (with a warning if the directory could
    not be created).
    """
    if cache_dir is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create index cache dir %s (%s); building in memory (set "
                           "--data-cache-path to a writable directory to cache)", cache_dir, e)
            cache_dir = None
    if cache_dir is None:
        return build(), True
    paths = {n: os.path.join(cache_dir, f"{base}-{n}.npy") for n in names}
    description_path = os.path.join(cache_dir, f"{base}-description.txt")
    arrays = _load_cached(paths, description_path, description)
    if arrays is not None:
        return arrays, False
    with _file_lock(os.path.join(cache_dir, f"{base}.lock")):
        arrays = _load_cached(paths, description_path, description)  # another process may have won
        if arrays is not None:
            return arrays, False
        arrays = build()
        try:
            for n in names:
                save_npy_atomic(paths[n], arrays[n])
            write_text_atomic(description_path, description)
        except OSError as e:
            logger.warning("could not write index cache in %s (%s); using the indices in memory",
                           cache_dir, e)
    return arrays, True

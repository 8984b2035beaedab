"""Check a checkpoint's files against the content hashes recorded when they were written.

    python tools/verify_checkpoint.py checkpoints/run            # the tracker's iteration
    python tools/verify_checkpoint.py checkpoints/run --all      # every iter_XXXXXXX
    python tools/verify_checkpoint.py checkpoints/run/iter_0000400

One line per iteration (``ok``, ``no content hashes`` for checkpoints saved before they were recorded, or
``FAILED``) and one line per file that does not verify (missing, truncated, hash mismatch). Exit status 0
when everything checked verifies, 2 otherwise (or on a bad argument).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cai.training.checkpoint import (  # noqa: E402
    TRACKER,
    CheckpointError,
    iteration_dir,
    list_iterations,
    read_tracker,
    verify_iteration,
)


def _targets(path: str, every: bool) -> list[str]:
    """The iteration directories to check for ``path`` (a run directory or one ``iter_XXXXXXX``)."""
    if re.fullmatch(r"iter_\d{7,}", os.path.basename(os.path.normpath(path))):
        return [os.path.normpath(path)]
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if every:
        found = list_iterations(path)
        if not found:
            raise CheckpointError(f"{path} holds no iter_XXXXXXX checkpoints")
        return [iteration_dir(path, i) for i in found]
    tracked = read_tracker(path)
    if tracked is None:
        raise CheckpointError(f"{path} has no {TRACKER}: name an iter_XXXXXXX directory, or pass --all")
    return [iteration_dir(path, tracked)]


def check(directory: str) -> bool:
    """Print one line for ``directory`` (and one per bad file); whether it verifies."""
    try:
        manifest, bad = verify_iteration(directory)
    except CheckpointError as e:
        print(f"{directory}: FAILED: {e}")
        return False
    if manifest is None:
        print(f"{directory}: no content hashes (saved before they were recorded): not verified")
        return True
    if not bad:
        size = sum(f["bytes"] for f in manifest["files"].values())
        print(f"{directory}: ok ({len(manifest['files'])} files, {size / 1e6:.1f} MB, {manifest['algorithm']})")
        return True
    print(f"{directory}: FAILED ({len(bad)} of {len(manifest['files'])} files)")
    for m in bad:
        print(f"  {m.describe()}")
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a run directory (--save), or one iter_XXXXXXX directory")
    p.add_argument("--all", action="store_true", help="check every iteration of the run, not only the tracker's")
    args = p.parse_args(argv)
    try:
        targets = _targets(args.path, args.all)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = [check(d) for d in targets]
    return 0 if all(results) else 2


if __name__ == "__main__":
    sys.exit(main())

"""Check a checkpoint's files against the content hashes recorded when they were written.

    python tools/verify_checkpoint.py checkpoints/run            # the tracker's iteration
    python tools/verify_checkpoint.py checkpoints/run --all      # every iter_XXXXXXX
    python tools/verify_checkpoint.py checkpoints/run/iter_0000400

One line per iteration (``ok`` or ``FAILED``) and one line per file that does not verify (missing, truncated,
hash mismatch). An iteration whose manifest cannot be trusted (missing, an algorithm this installation lacks,
names outside the directory, files it does not list, a bad signature under ``--checkpoint-signing-key``) or
that holds a file that is not plain data (a pickle that would run code) is one ``error:`` line. Exit status 0
when everything checked verifies, 2 otherwise (or on a bad argument).

The hashes prove that the files are the ones recorded in the manifest; anyone who can write the directory can
recompute an unkeyed manifest, so only a signature (``--checkpoint-signing-key FILE``) says who wrote it
(docs/checkpoints.md).
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
    CheckpointTrust,
    check_plain_data,
    checkpoint_trust,
    iteration_dir,
    list_iterations,
    read_signing_key,
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
        if manifest is None:
            raise CheckpointError(f"{directory} has no content hashes (checksums.json): its files cannot be verified")
        if not bad:
            pickles = check_plain_data(directory)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    if not bad:
        size = sum(f["bytes"] for f in manifest["files"].values())
        signed = ", signed" if "hmac_sha256" in manifest else ""
        print(f"{directory}: ok ({len(manifest['files'])} files, {size / 1e6:.1f} MB, {manifest['algorithm']}{signed}; "
              f"{pickles} pickles read as plain data)")
        return True
    print(f"{directory}: FAILED ({len(bad)} of {len(manifest['files'])} files)")
    for m in bad:
        print(f"  {m.describe()}")
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a run directory (--save), or one iter_XXXXXXX directory")
    p.add_argument("--all", action="store_true", help="check every iteration of the run, not only the tracker's")
    p.add_argument("--checkpoint-signing-key", default=None, metavar="FILE",
                   help="a file holding the HMAC key the checkpoint was signed with: the signature must match")
    args = p.parse_args(argv)
    try:
        targets = _targets(args.path, args.all)
        trust = CheckpointTrust(signing_key=read_signing_key(args.checkpoint_signing_key))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with checkpoint_trust(trust):
        results = [check(d) for d in targets]
    return 0 if all(results) else 2


if __name__ == "__main__":
    sys.exit(main())

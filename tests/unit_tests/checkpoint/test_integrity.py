"""Content hashes of checkpoint files: computed while writing, equal to a hash of the bytes on disk, and any
changed byte of any file (the manifest included) found by verification."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from testlib.damage import each_byte_flipped

from megatron_cai.training.checkpoint import CheckpointError
from megatron_cai.training.checkpoint import dcp_pieces as dc
from megatron_cai.training.checkpoint import integrity as ig
from megatron_cai.training.checkpoint.file_io import DEFAULT_ALGORITHM, save_torch, write_json
from megatron_cai.training.checkpoint.run_dirs import iteration_dir, last_verifying_iteration


def reference_hash(path: str, algorithm: str) -> str:
    """The algorithm applied to the whole file at once, by its library directly (not our streaming code)."""
    data = open(path, "rb").read()
    if algorithm == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64(data).hexdigest()
    return hashlib.blake2b(data, digest_size=32 if algorithm == "blake2b_256" else 8).hexdigest()


@pytest.mark.parametrize("numel", [10, 3_000_000])  # the second is written through the overlapped path
def test_save_torch_hash_is_the_hash_of_the_file(tmp_path, numel):
    path = str(tmp_path / "x.pt")
    got = save_torch({"w": torch.arange(numel, dtype=torch.float32), "n": 3}, path)
    assert got.nbytes == os.path.getsize(path)
    assert got.digest == reference_hash(path, DEFAULT_ALGORITHM)
    assert torch.equal(torch.load(path)["w"], torch.arange(numel, dtype=torch.float32))


def test_dcp_save_hashes_every_file_it_writes(tmp_path):
    path = str(tmp_path / "dcp")
    full = torch.randn(6, 4)
    records = dc.dcp_save({"w": dc.Pieces(full.shape, [((0, 0), full)]), "b": torch.ones(3)}, path, no_dist=True)
    on_disk = sorted(os.listdir(path))
    assert sorted(os.path.basename(p) for p in records) == on_disk == [".metadata", "__0_0.distcp"]
    for p, h in records.items():
        assert h.digest == reference_hash(p, DEFAULT_ALGORITHM) and h.nbytes == os.path.getsize(p)


def _iteration(root: str, it: int) -> str:
    d = iteration_dir(root, it)
    os.makedirs(os.path.join(d, "mp_rank_00"))
    rec = {}
    for rel, obj in (("mp_rank_00/model_optim_rng.pt", {"w": torch.randn(50)}), ("reducer.pt", [torch.ones(4)])):
        p = os.path.join(d, rel)
        rec[p] = (save_torch(obj, p), 0)
    meta = os.path.join(d, "metadata.json")
    rec[meta] = (write_json(meta, {"iteration": it}), 0)
    ig.write_manifest(d, rec)
    return d


def test_any_flipped_byte_is_found_and_named(tmp_path):
    root = str(tmp_path)
    _iteration(root, 1)
    d = _iteration(root, 2)
    manifest, bad = ig.verify_iteration(d)
    assert bad == [] and set(manifest["files"]) == {"mp_rank_00/model_optim_rng.pt", "reducer.pt", "metadata.json"}
    for rel, spec in manifest["files"].items():
        path = os.path.join(d, rel)
        original = open(path, "rb").read()
        for offset in each_byte_flipped(path, 0x40):
            _, bad = ig.verify_iteration(d)
            assert [(m.path, m.cause) for m in bad] == [(path, "hash mismatch")], (rel, offset)
            assert spec["hash"] in bad[0].expected and spec["hash"] not in bad[0].found
        open(path, "wb").write(original[:-10])
        assert [m.cause for m in ig.verify_iteration(d)[1]] == ["truncated"]
        os.remove(path)
        assert [m.cause for m in ig.verify_iteration(d)[1]] == ["missing"]
        open(path, "wb").write(original)
    assert last_verifying_iteration(root, 3) == 2
    os.remove(os.path.join(d, "reducer.pt"))
    assert last_verifying_iteration(root, 3) == 1


def test_a_damaged_manifest_is_an_error_naming_it(tmp_path):
    d = _iteration(str(tmp_path), 1)
    path = os.path.join(d, ig.MANIFEST)
    m = json.load(open(path))
    name = sorted(m["files"])[0]
    m["files"][name]["hash"] = "0" * 16  # a consistent-looking but changed entry
    open(path, "w").write(json.dumps(m))
    with pytest.raises(CheckpointError, match=f"{path}.*hash mismatch of the manifest itself"):
        ig.verify_iteration(d)
    open(path, "w").write("{not json")
    with pytest.raises(CheckpointError, match=path):
        ig.verify_iteration(d)


def test_no_manifest_means_not_verified(tmp_path):
    d = iteration_dir(str(tmp_path), 1)
    os.makedirs(d)
    assert ig.verify_iteration(d) == (None, [])


def test_the_shares_of_the_ranks_cover_every_file_once(tmp_path):
    d = _iteration(str(tmp_path), 1)
    manifest = ig.read_manifest(d)
    names = manifest["files"]
    for world in (1, 2, 3, 5):
        seen = []
        for r in range(world):
            seen += sorted(names, key=lambda n: (-names[n]["bytes"], n))[r::world]
        assert sorted(seen) == sorted(names)
    os.remove(os.path.join(d, "reducer.pt"))
    found = [m for r in range(2) for m in ig.verify_share(d, manifest, r, 2)]
    assert [os.path.basename(m.path) for m in found] == ["reducer.pt"]

"""Loading is not executing: torch files as weights only, DCP metadata through a restricted unpickler, signed and
strict manifests, and the committed pre-safety fixture loading only under the explicit flags."""
from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
from testlib import TESTS

from megatron_cai.training.checkpoint import CheckpointError, UnsafeCheckpointError
from megatron_cai.training.checkpoint import dcp_pieces as dc
from megatron_cai.training.checkpoint import integrity as ig
from megatron_cai.training.checkpoint.file_io import save_torch, write_json
from megatron_cai.training.checkpoint.safe_load import (
    CheckpointTrust,
    checkpoint_trust,
    load_dcp_metadata,
    load_torch,
    read_signing_key,
)

FIXTURE_RANK_FILE = os.path.join(TESTS, "fixtures", "ckpt_main_db88585", "iter_0000002", "mp_rank_00",
                                 "model_optim_rng.pt")


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_torch_file_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    marker, path = str(tmp_path / "marker"), str(tmp_path / "x.pt")
    torch.save({"w": torch.ones(3), "x": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as e:
        load_torch(path)
    assert path in str(e.value) and "GLOBAL exec" in str(e.value) and "--trust-checkpoint-code" in str(e.value)
    assert not os.path.exists(marker)
    with checkpoint_trust(CheckpointTrust(trust_code=True), log=lambda *_: None):
        load_torch(path)  # the explicit opt-in: the old, unrestricted path
    assert os.path.exists(marker)


def test_what_our_saves_write_loads_as_weights_only(tmp_path):
    """Every type a save writes (tensors, OrderedDict state dicts, tuples, the RNG states as plain data)."""
    from megatron_cai.core import device as device_mod

    path = str(tmp_path / "x.pt")
    model = torch.nn.Linear(3, 2)
    obj = {"model": {"model0": model.state_dict()}, "rng": device_mod.get_rng_state(), "betas": (0.9, 0.95),
           "n": 3, "s": "x", "none": None}
    save_torch(obj, path)
    back = load_torch(path)
    assert torch.equal(back["model"]["model0"]["weight"], model.weight) and back["betas"] == (0.9, 0.95)
    assert torch.equal(back["rng"]["torch"], obj["rng"]["torch"]) and back["rng"]["numpy"][0] == "MT19937"


def _real_metadata(tmp_path) -> bytes:
    path = str(tmp_path / "dcp")
    full = torch.randn(6, 4)
    dc.dcp_save({"w": dc.Pieces(full.shape, [((0, 0), full)]), "common": {"it": 3}}, path, no_dist=True)
    return open(os.path.join(path, ".metadata"), "rb").read()


def test_dcp_metadata_loads_and_a_payload_in_it_is_refused(tmp_path):
    data = _real_metadata(tmp_path)
    md = load_dcp_metadata(io.BytesIO(data), "m")
    assert md.state_dict_metadata["w"].size == torch.Size([6, 4])
    marker = str(tmp_path / "marker")
    evil = pickle.loads(data)  # noqa: S301 - written above
    evil.planner_data = Payload(marker)
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):  # refused by name, never imported
        load_dcp_metadata(io.BytesIO(pickle.dumps(evil)), "m")
    assert not os.path.exists(marker)


def test_the_metadata_unpickler_refuses_a_module_before_importing_it(tmp_path):
    """A global of a module that is not DCP's is refused by name: its module is never imported."""
    crafted = b"\x80\x04cnot_a_module_xyz\nanything\n)R."  # GLOBAL, EMPTY_TUPLE, REDUCE
    with pytest.raises(UnsafeCheckpointError, match="not_a_module_xyz.anything"):
        load_dcp_metadata(io.BytesIO(crafted), "m")
    for module, name in (("torch", "load"), ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
                         ("os", "system"), ("pathlib", "_local"), ("torch.distributed.checkpoint.metadata", "Enum")):
        crafted = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b")R."
        with pytest.raises(UnsafeCheckpointError):
            load_dcp_metadata(io.BytesIO(crafted), "m")


def test_the_fixture_saved_before_safe_loading_needs_the_explicit_flag():
    """ckpt_main_db88585 pickled its NumPy RNG state as an ndarray: refused as weights only, loaded with the flag."""
    with pytest.raises(UnsafeCheckpointError, match="numpy"):
        load_torch(FIXTURE_RANK_FILE)
    with checkpoint_trust(CheckpointTrust(trust_code=True), log=lambda *_: None):
        assert load_torch(FIXTURE_RANK_FILE)["iteration"] == 2


# ------------------------------------------------------------------------------------ the manifest
def _iteration(d: str) -> dict:
    os.makedirs(os.path.join(d, "mp_rank_00"))
    rec = {}
    for rel, obj in (("mp_rank_00/model_optim_rng.pt", {"w": torch.randn(50)}),):
        p = os.path.join(d, rel)
        rec[p] = (save_torch(obj, p), 0)
    meta = os.path.join(d, "metadata.json")
    rec[meta] = (write_json(meta, {"iteration": 1}), 0)
    return rec


@pytest.mark.parametrize("name, problem", [("../x", "(..)"), ("a/../../x", "(..)"), ("/dev/zero", "absolute"),
                                           ("./x", "normalised"), ("a//b", "normalised"), ("", "not a file name"),
                                           ("C:/x", "absolute"), ("a\\b", "absolute")])
def test_names_outside_the_iteration_are_refused(name, problem):
    assert problem in ig.name_problem(name)


def test_plain_names_pass():
    for name in ("metadata.json", "mp_rank_00/model_optim_rng.pt", ".metadata", "tokenizer/t.model"):
        assert ig.name_problem(name) is None


def test_a_fifo_or_a_link_in_the_manifest_never_blocks_nor_is_followed(tmp_path):
    d = str(tmp_path / "iter_0000001")
    rec = _iteration(d)
    fifo, link = os.path.join(d, "fifo"), os.path.join(d, "link")
    os.mkfifo(fifo)
    os.symlink(os.path.join(d, "metadata.json"), link)
    from megatron_cai.training.checkpoint.file_io import FileHash

    rec[fifo] = (FileHash("0" * 64, 0), 0)
    rec[link] = (rec[os.path.join(d, "metadata.json")][0], 0)  # the link's target verifies: still refused
    ig.write_manifest(d, rec)
    manifest, bad = ig.verify_iteration(d)
    causes = {os.path.basename(m.path): m.cause for m in bad}
    assert causes == {"fifo": "unreadable: not a regular file", "link": "unreadable: a symbolic link"}


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    d = str(tmp_path / "iter_0000001")
    ig.write_manifest(d, _iteration(d))
    assert ig.verify_iteration(d)[1] == []
    open(os.path.join(d, "mp_rank_00", "reducer_dp_000.pt"), "wb").write(b"x")
    with pytest.raises(CheckpointError, match="mp_rank_00/reducer_dp_000.pt, which its content hashes"):
        ig.verify_iteration(d)


def test_an_unknown_algorithm_is_unverifiable_not_skipped(tmp_path):
    d = str(tmp_path / "iter_0000001")
    ig.write_manifest(d, _iteration(d))
    path = os.path.join(d, ig.MANIFEST)
    m = json.load(open(path))
    if "xxh3_64" not in ig.ALGORITHMS:  # the downgrade: a real algorithm this installation lacks
        m["algorithm"] = "xxh3_64"
        json.dump(m, open(path, "w"))
        with pytest.raises(ig.UnverifiableError, match="xxhash package.*--allow-unverified-checkpoint"):
            ig.read_manifest(d)
    m["algorithm"] = "crc32"  # no algorithm at all: a damaged manifest, which no flag loads
    json.dump(m, open(path, "w"))
    with pytest.raises(CheckpointError, match="corrupt: unknown hash algorithm 'crc32'") as e:
        ig.read_manifest(d)
    assert not isinstance(e.value, ig.UnverifiableError)


def test_a_signed_manifest_verifies_only_with_its_key(tmp_path):
    d = str(tmp_path / "iter_0000001")
    key, other = b"k" * 32, b"o" * 32
    rec = _iteration(d)
    with checkpoint_trust(CheckpointTrust(signing_key=key), log=lambda *_: None):
        ig.write_manifest(d, rec)
        assert ig.verify_iteration(d)[1] == []
        # an attacker rewrites a file and recomputes the (unkeyed) hashes: the signature no longer matches
        save_torch({"w": torch.zeros(50)}, os.path.join(d, "mp_rank_00", "model_optim_rng.pt"))
        forged = ig.manifest_for(d, ig.hash_tree(d))
        forged[ig.SIGNATURE] = json.load(open(os.path.join(d, ig.MANIFEST)))[ig.SIGNATURE]
        json.dump(forged, open(os.path.join(d, ig.MANIFEST), "w"))
        with pytest.raises(CheckpointError, match="do not match their signature"):
            ig.verify_iteration(d)
        del forged[ig.SIGNATURE]
        json.dump(forged, open(os.path.join(d, ig.MANIFEST), "w"))
        with pytest.raises(CheckpointError, match="are not signed"):
            ig.verify_iteration(d)
    with checkpoint_trust(CheckpointTrust(signing_key=other), log=lambda *_: None):
        ig.write_manifest(d, ig.hash_tree(d))
    with checkpoint_trust(CheckpointTrust(signing_key=key), log=lambda *_: None):
        with pytest.raises(CheckpointError, match="signed with another key"):
            ig.verify_iteration(d)


def test_the_signing_key_comes_from_a_file_of_enough_bytes(tmp_path):
    short, good = tmp_path / "short", tmp_path / "good"
    short.write_bytes(b"abc\n")
    good.write_bytes(b"x" * 32 + b"\n")
    assert read_signing_key(str(good)) == b"x" * 32 and read_signing_key(None) is None
    with pytest.raises(CheckpointError, match="holds 3 bytes"):
        read_signing_key(str(short))
    with pytest.raises(CheckpointError, match="cannot read the key file"):
        read_signing_key(str(tmp_path / "none"))


def test_safe_globals_other_libraries_register_do_not_widen_the_load(tmp_path):
    """Importing megatron.core registers numpy's reconstructors as process-wide safe globals; a load here still
    admits only its own list (the registrations stay in place for their owner)."""
    import numpy as np

    path = str(tmp_path / "n.pt")
    torch.save({"a": np.arange(3)}, path)
    registered = [np.core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("int64"))]
    torch.serialization.add_safe_globals(registered)
    try:
        with pytest.raises(UnsafeCheckpointError, match="numpy"):
            load_torch(path)
        assert all(g in torch.serialization.get_safe_globals() for g in registered)
    finally:
        torch.serialization.clear_safe_globals()

"""dcp_pieces.Pieces through torch.distributed.checkpoint in one process: a fused tensor written as
per-section TP pieces reads back, for another TP size, as that rank's sections; vocabulary rows clip."""
import torch

from megatron_cai.core.tensor_parallel.utils import shard_tensor
from megatron_cai.training.checkpoint import dcp_pieces as dc


def _save(tmp_path, full: torch.Tensor, meta: dict, tp: int) -> str:
    """Every TP rank's pieces of ``full`` (as the ranks of a TP=tp run would write them), in one process."""
    pieces = []
    for r in range(tp):
        local = shard_tensor(full, meta["tp_dim"], r, tp, meta.get("tp_sections"))
        pieces += dc.save_pieces(local, meta, r, tp).pieces
    path = str(tmp_path / "ckpt")
    dc.dcp_save({"w": dc.Pieces(full.shape, pieces)}, path, no_dist=True)
    return path


def test_sectioned_tensor_reshards_on_load(tmp_path):
    full = torch.arange(24 * 3, dtype=torch.float32).view(24, 3)  # sections [gate 12, up 12] along dim 0
    meta = {"tp_dim": 0, "tp_sections": [12, 12], "full_shape": [24, 3]}
    path = _save(tmp_path, full, meta, tp=2)
    saved = dc.read_dcp_metadata(path).state_dict_metadata["w"]
    assert list(saved.size) == [24, 3] and len(saved.chunks) == 4  # 2 ranks x 2 sections
    for tp in (1, 3, 4):
        for r in range(tp):
            target = torch.zeros(24 // tp, 3)
            dc.dcp_load({"w": dc.load_pieces(target, meta, saved.size, r, tp, "w")}, path, no_dist=True)
            assert torch.equal(target, shard_tensor(full, 0, r, tp, [12, 12])), (tp, r)


def test_vocabulary_rows_clip_and_pad_with_zeros(tmp_path):
    name = "embedding.word_embeddings.weight"
    full = torch.randn(12, 4)  # saved with 12 padded rows
    path = _save(tmp_path, full, {"tp_dim": 0, "full_shape": [12, 4]}, tp=2)
    saved = dc.read_dcp_metadata(path).state_dict_metadata["w"]
    meta16 = {"tp_dim": 0, "full_shape": [16, 4]}  # a run with 16 padded rows at TP = 2: 8 per rank
    target = torch.zeros(8, 4)
    dc.dcp_load({"w": dc.load_pieces(target, meta16, saved.size, 1, 2, name)}, path, no_dist=True)
    assert torch.equal(target[:4], full[8:12]) and torch.equal(target[4:], torch.zeros(4, 4))


def test_dp_row_shards_across_section_boundaries(tmp_path):
    """FSDP2 keeps rows of the TP-local tensor; a DP shard may straddle the [gate, up] boundary."""
    full = torch.randn(24, 3)
    meta = {"tp_dim": 0, "tp_sections": [12, 12], "full_shape": [24, 3]}
    pieces = []
    for t in range(2):  # TP = 2, DP = 3: TP-local rows [gate 6 | up 6], DP shards of 4 rows
        local = shard_tensor(full, 0, t, 2, [12, 12])
        for d in range(3):
            pieces += dc.save_pieces(local[4 * d:4 * d + 4], meta, t, 2, row0=4 * d).pieces
    assert len(pieces) == 8  # the middle shard of each TP rank is two pieces
    path = str(tmp_path / "ckpt")
    dc.dcp_save({"w": dc.Pieces(full.shape, pieces)}, path, no_dist=True)
    saved = dc.read_dcp_metadata(path).state_dict_metadata["w"]
    whole = torch.zeros(24, 3)
    dc.dcp_load({"w": dc.load_pieces(whole, meta, saved.size, 0, 1, "w")}, path, no_dist=True)
    assert torch.equal(whole, full)
    target = torch.zeros(3, 3)  # TP = 4, DP = 2: TP-local rows [gate 3 | up 3], rank (t=1, d=1) holds rows 3..5
    dc.dcp_load({"w": dc.load_pieces(target, meta, saved.size, 1, 4, "w", row0=3)}, path, no_dist=True)
    assert torch.equal(target, shard_tensor(full, 0, 1, 4, [12, 12])[3:6])

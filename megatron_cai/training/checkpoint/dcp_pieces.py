"""DCP's sharded metadata for layout-free checkpoints: a tensor's pieces with their global offsets.

:class:`Pieces` implements DCP's ``_Checkpointable`` protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``): this rank's rectangular pieces of a global
(canonical) tensor. :func:`rank_boxes` says where a rank's tensor lies in the canonical one: per TP
section (``tensor_parallel.utils``' layout: each section split into TP equal chunks) and, under FSDP2,
only the rows of the DP shard the rank holds. MoE expert parameters (``"expert"`` in their layout) are
``[num_experts, ...]`` globally: EP rank ``r`` holds experts ``[r E/EP, (r+1) E/EP)`` along dim 0, split over
expert TP (the caller passes the expert-TP rank and size as ``tp_rank`` / ``tp``). ``dcp_save`` / ``dcp_load``
run DCP with the two planner subclasses that look pieces up, and turn DCP's failures into errors naming the
directory and the rank.
Used by :mod:`.dist_format`, :mod:`.async_save` and :mod:`.format_conversion`.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...core.models.gpt.model import WORD_EMBEDDINGS
from ...core.tensor_parallel.utils import section_sizes
from .file_io import CheckpointError, FileHash, describe_write_error
from .integrity import HashingFileSystemWriter
from .safe_load import SafeFileSystemReader, load_weights

DCP_METADATA = ".metadata"
OUTPUT_WEIGHT = "output_layer.weight"
VOCAB_PARAMS = (WORD_EMBEDDINGS, OUTPUT_WEIGHT)


class Pieces:
    """A global tensor of which this rank holds some rectangular pieces (DCP's ``_Checkpointable`` protocol).

    ``pieces``: ``(global offsets, tensor)``; on a load the tensors are filled in place."""

    def __init__(self, shape: Iterable[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.shape = torch.Size(shape)
        self.pieces = pieces

    def size(self) -> torch.Size:
        return self.shape

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.pieces]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for c, (_, t) in zip(self._chunks(), self.pieces)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.pieces) \
                and torch.Size(self.pieces[index.index][0]) == index.offset:
            return self.pieces[index.index][1]
        for o, t in self.pieces:
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"no piece at offset {index.offset} of {index.fqn}")


class PiecesSavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    def __init__(self, checkpoint: str = "") -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.checkpoint = checkpoint  # the directory, for messages

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict  # flat already; Pieces are not tensors
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        """A byte object (``common``, ``rank_state.*``) is read as weights only (:mod:`.safe_load`)."""
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = load_weights(value, f"the object {fqn!r} of torch_dist checkpoint {self.checkpoint}")


def tp_boxes(full_shape: Iterable[int], meta: dict, tp_rank: int, tp: int) -> list[tuple[tuple, tuple, int, int]]:
    """Where TP rank ``tp_rank``'s local tensor lies in the canonical one: ``(global offsets, sizes,
    local offset along the split dim, split dim)`` per section (one box when not split)."""
    full = list(full_shape)
    dim = meta.get("tp_dim")
    if dim is None or tp == 1:
        return [(tuple([0] * len(full)), tuple(full), 0, 0)]
    out, g, local = [], 0, 0
    for s in section_sizes(full[dim], meta.get("tp_sections")):
        n = s // tp
        off, size = [0] * len(full), list(full)
        off[dim], size[dim] = g + tp_rank * n, n
        out.append((tuple(off), tuple(size), local, dim))
        g, local = g + s, local + n
    return out


def rank_boxes(full_shape: Iterable[int], meta: dict, tp_rank: int, tp: int, row0: int = 0, rows: int | None = None,
               ep: tuple[int, int] = (0, 1)) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """This rank's pieces of a canonical tensor: ``(global offsets, index into the local tensor)``.

    The local tensor is rows ``[row0, row0 + rows)`` of the TP-local tensor: all of it (DDP, the
    distributed optimizer after its gather) or an FSDP2 DP shard (dim 0, ``torch.chunk`` over DP).
    ``ep``: (EP rank, EP size), for an expert parameter: its local tensor is that rank's block of experts."""
    full = list(full_shape)
    if meta.get("expert") and ep[1] > 1:
        per_rank = full[0] // ep[1]
        boxes = rank_boxes([per_rank, *full[1:]], meta, tp_rank, tp, row0, rows)
        return [((off[0] + ep[0] * per_rank, *off[1:]), idx) for off, idx in boxes]
    split0 = meta.get("tp_dim") == 0 and tp > 1
    rows = (full[0] // tp if split0 else full[0]) - row0 if rows is None else rows
    out = []
    for off, size, lo, dim in tp_boxes(full, meta, tp_rank, tp):
        if dim == 0:  # the box spans TP-local rows [lo, lo + size[0])
            i0, i1 = max(lo, row0), min(lo + size[0], row0 + rows)
            if i0 >= i1:
                continue
            goff = (off[0] + i0 - lo, *off[1:])
            index = (slice(i0 - row0, i1 - row0),)
        else:
            if rows <= 0:
                continue
            goff = (off[0] + row0, *off[1:])
            index = (slice(0, rows),) + tuple(slice(None) for _ in range(1, dim)) + (slice(lo, lo + size[dim]),)
        out.append((goff, index))
    return out


def save_pieces(local: torch.Tensor, meta: dict, tp_rank: int, tp: int, row0: int = 0,
                ep: tuple[int, int] = (0, 1)) -> Pieces:
    """This rank's pieces of a canonical tensor, given its TP-local tensor (or rows of it from ``row0``)."""
    full = list(meta["full_shape"])
    local = local.detach()
    rows = local.shape[0] if local.dim() else None
    boxes = rank_boxes(full, meta, tp_rank, tp, row0, rows, ep)
    return Pieces(full, [(o, local[idx].contiguous()) for o, idx in boxes])


def load_pieces(target: torch.Tensor, meta: dict, saved_shape: torch.Size, tp_rank: int, tp: int,
                name: str, row0: int = 0, ep: tuple[int, int] = (0, 1)) -> Pieces:
    """Pieces that read into ``target`` (this rank's TP-local tensor, or rows of it from ``row0``; zeroed):
    each clipped to the saved shape (vocabulary tables may have other padding; anything else matches: the loader
    compared the shapes first, :mod:`.shape_check`)."""
    full = list(meta["full_shape"])
    pieces = []
    for off, idx in rank_boxes(full, meta, tp_rank, tp, row0, target.shape[0], ep):
        view = target[idx]
        rows = min(view.shape[0], saved_shape[0] - off[0])  # only dim 0 (vocabulary rows) may be clipped
        if rows > 0:
            pieces.append((off, view.narrow(0, 0, rows) if rows < view.shape[0] else view))
    return Pieces(saved_shape, pieces)


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rows of a TP-local tensor this rank holds, the first one's index): the tensor itself, or an
    FSDP2 DTensor's DP shard, which is never gathered."""
    if not hasattr(t, "device_mesh"):
        return t, 0
    if not row_sharded(t):
        return t.full_tensor(), 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), offset[0]


def row_sharded(t) -> bool:
    from torch.distributed.tensor import Shard

    return all(isinstance(pl, Shard) and pl.dim == 0 for pl in t.placements)


def dcp_save(sd: dict[str, Any], path: str, *, no_dist: bool = False, process_group=None) -> dict[str, FileHash]:
    """``dcp.save`` with our planner; returns the content hashes of the files this rank wrote (its
    ``.distcp``, and DCP's ``.metadata`` on the coordinator), computed as they were written. A failed
    write is an error naming the directory, the rank and the cause; the partial directory is never
    published (no rename, no tracker)."""
    writer = HashingFileSystemWriter(path)
    try:
        with _quiet(no_dist):
            dcp.save(sd, storage_writer=writer, planner=PiecesSavePlanner(), no_dist=no_dist,
                     process_group=process_group)
    except CheckpointException as e:
        ranks = sorted(e.failures)
        exc = e.failures[ranks[0]][0] if isinstance(e.failures[ranks[0]], tuple) else e.failures[ranks[0]]
        raise CheckpointError(f"cannot write torch_dist checkpoint {path} on rank {ranks[0]}: "
                              f"{describe_dcp_error(exc, path)}; the previous checkpoint stays current") from None
    return writer.records


@contextlib.contextmanager
def _quiet(no_dist: bool):
    """One process on purpose (the converter): silence DCP's "assuming a single process" warning."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.simplefilter("ignore", UserWarning)
        yield


def read_dcp_metadata(path: str):
    """DCP's global metadata of a checkpoint directory; a missing or corrupt file is an error naming it."""
    file = os.path.join(path, DCP_METADATA)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: {path} is not a complete torch_dist checkpoint (an interrupted "
                              f"save, or another format: see --auto-detect-ckpt-format)")
    try:
        return SafeFileSystemReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle, EOF, OS errors: all mean the same thing here
        size = os.path.getsize(file)
        raise CheckpointError(f"{file} is corrupt ({size} bytes): {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}") from None


def dcp_load(sd: dict[str, Any], path: str, *, no_dist: bool = False) -> None:
    """``dcp.load`` with our planner; a failed read is an error naming the directory and the rank."""
    try:
        with _quiet(no_dist):
            dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=PiecesLoadPlanner(path), no_dist=no_dist)
    except CheckpointException as e:  # every failing rank's exception, gathered by DCP (a BaseException)
        ranks = sorted(e.failures)
        exc = e.failures[ranks[0]][0] if isinstance(e.failures[ranks[0]], tuple) else e.failures[ranks[0]]
        if isinstance(exc, CheckpointError):  # a refused object: its own message names it
            raise type(exc)(str(exc)) from None
        others = f" (and ranks {ranks[1:]})" if len(ranks) > 1 else ""
        raise CheckpointError(f"cannot read torch_dist checkpoint {path} on rank {ranks[0]}"
                              f"{others}: {describe_dcp_error(exc)}") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a failure before DCP's collective phase
        raise CheckpointError(f"cannot read torch_dist checkpoint {path} on rank {_process_rank()}: "
                              f"{describe_dcp_error(e)}") from None


def describe_dcp_error(exc: BaseException, path: str | None = None) -> str:
    """One clause for a failure inside DCP: the cause (no space, permission, truncated file) when known."""
    if path is not None and isinstance(exc, (OSError, RuntimeError)):
        text = describe_write_error(path, exc, 1 << 20)  # torch's writer failing with < 1 MiB free: a full disk
        if "no space left" in text or isinstance(exc, OSError):
            return text.split(": ", 1)[1] if ": " in text else text
    if isinstance(exc, (EOFError, pickle.UnpicklingError)) or "unexpected pos" in str(exc) \
            or "PytorchStreamReader failed" in str(exc):
        return f"a file of the checkpoint is truncated or corrupt ({type(exc).__name__}: {_first_line(exc)})"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""


def _process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0

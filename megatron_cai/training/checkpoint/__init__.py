"""Checkpoints: one save/load entry, :class:`Checkpointer` (``save``, ``load``, ``finalize_async``).

Behind it, modules named for what they hold:

- ``torch_format``: ``--ckpt-format torch``, per-rank files in Megatron's layout (fixed TP/PP layout);
- ``dist_format``: ``--ckpt-format torch_dist`` on ``torch.distributed.checkpoint``, loads into any layout;
- ``dcp_pieces``: the TP/DP pieces of each global tensor that DCP writes and reads;
- ``async_save``: ``--async-save``, the background writer and its staging buffers;
- ``metadata``: ``metadata.json``, format detection, the checks a resume makes;
- ``shape_check``: saved tensors against the live ones they load into, one error naming what does not fit;
- ``run_dirs``: ``iter_XXXXXXX`` directories, publishing a save, the guards against overwriting a run;
- ``retention``: ``--save-retain-interval`` and non-persistent saves, what a published save lets go;
- ``run_lock``: one job per ``--save`` (rank 0's ``fcntl`` lock, held for the job's life);
- ``integrity``: every file's content hash, computed as it is written, verified on load;
- ``file_io``: reads and writes whose errors name the file and the rank;
- ``safe_load``: loading is not executing: weights-only torch files, DCP metadata through a restricted unpickler;
- ``reshard``: the layout-free (canonical) form and resharding torch-format checkpoints;
- ``format_conversion``: torch <-> torch_dist (``tools/convert_checkpoint.py --target-ckpt-format``).

Code outside this package imports only the names below (``test_code_structure.py`` checks it).
"""
from .async_save import AsyncCheckpointSaver, AsyncSave
from .checkpointer import (
    Checkpointer,
    check_plain_data,
    open_run_dirs,
    resolve_load_format,
    verify_checkpoint,
    warn_if_short_of_space,
)
from .dcp_pieces import read_dcp_metadata
from .file_io import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    CheckpointError,
    CheckpointIOError,
    save_torch,
    write_json,
    write_text,
)
from .format_conversion import dist_to_torch, load_any_canonical, torch_to_dist
from .integrity import MANIFEST, verify_iteration
from .metadata import TORCH, TORCH_DIST, detect_format, read_metadata, refuse_megatron_lm_checkpoint, tp_layout
from .reshard import (
    OUTPUT_WEIGHT,
    CanonicalCheckpoint,
    ConversionError,
    Layout,
    fit_vocab_rows,
    load_canonical,
    reshard_checkpoint,
    save_resharded,
    target_layout,
)
from .run_dirs import (
    TRACKER,
    check_conversion_target,
    check_run_dirs,
    iteration_dir,
    last_verifying_iteration,
    list_iterations,
    read_tracker,
    same_path,
)
from .run_lock import RunLock
from .safe_load import (
    CheckpointTrust,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    checkpoint_trust,
    current_trust,
    load_torch,
    load_weights,
    read_signing_key,
    set_trust,
    trust_from_flags,
)
from .shape_check import CheckpointShapeError, RankLocalShapeError, check_shapes
from .torch_format import load_torch_checkpoint, param_names, rank_dir_name, same_stage_layers

__all__ = [
    "OUTPUT_WEIGHT", "TORCH", "TORCH_DIST", "TRACKER", "AsyncCheckpointSaver", "AsyncSave", "CanonicalCheckpoint",
    "CheckpointError", "CheckpointIOError", "Checkpointer", "ConversionError", "Layout", "check_conversion_target",
    "check_run_dirs", "detect_format", "dist_to_torch", "fit_vocab_rows", "iteration_dir", "load_canonical",
    "load_torch", "load_torch_checkpoint", "rank_dir_name", "read_dcp_metadata", "read_metadata", "read_tracker",
    "same_stage_layers", "CheckpointShapeError", "RankLocalShapeError", "check_shapes",
    "refuse_megatron_lm_checkpoint", "reshard_checkpoint", "resolve_load_format", "save_resharded", "save_torch",
    "target_layout", "torch_to_dist", "tp_layout", "write_json", "write_text", "open_run_dirs", "verify_checkpoint",
    "warn_if_short_of_space", "load_any_canonical", "RunLock", "MANIFEST", "verify_iteration",
    "last_verifying_iteration", "list_iterations", "same_path", "ALGORITHMS", "DEFAULT_ALGORITHM", "param_names",
    "CheckpointTrust", "SafeFileSystemReader", "UnsafeCheckpointError", "checkpoint_trust",
    "load_weights", "set_trust", "trust_from_flags", "check_plain_data",
    "read_signing_key", "current_trust",
]

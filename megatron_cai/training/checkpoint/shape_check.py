"""Saved tensors against the live ones they are copied into: one error naming what does not fit, never torch's
``load_state_dict`` traceback.

Every load path (``torch`` per-rank files, ``torch_dist``, the optimizer state, DiLoCo's island state) gives
:func:`check_shapes` the saved shapes and this run's by name. A parameter this run has and the checkpoint lacks, one
the checkpoint holds and this run lacks, or one whose shape differs is a :class:`CheckpointShapeError`: one line
naming the checkpoint file or directory, the first such parameter with both shapes (and how many more), and the
flag that most likely differs, read from the checkpoint's saved model configuration (:func:`likely_flag`).
Collective loads agree first (every rank of a model-parallel group calls :func:`check_shapes`): every rank raises
the first rank's finding, which rank 0 prints, so a mismatch on some pipeline stages only neither hangs the others
nor prints twice.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ...core import parallel_state as ps
from ...core.models.gpt.config import GPTConfig
from ..errors import RankLocalError
from .file_io import CheckpointError

Shape = tuple[int, ...]

# The configuration fields that set parameter shapes, most likely cause first (a --hidden-size change also
# changes the derived ffn_hidden_size and kv_channels: the first one found is named as the likely flag).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "kv_channels", "padded_vocab_size", "vocab_size", "max_position_embeddings",
                "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                "activation", "normalization", "position_embedding_type", "multi_latent_attention", "q_lora_rank",
                "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "attention_output_gate",
                "moe_architecture")
FLAG_OF = {"padded_vocab_size": "the padded vocabulary (--make-vocab-size-divisible-by x the TP size)",
           "activation": "--swiglu / --squared-relu (the activation)",
           "moe_architecture": "the --num-experts / --moe-* flags"}


class CheckpointShapeError(CheckpointError):
    """A saved tensor does not fit the live one it would be copied into (or one side lacks it)."""


class RankLocalShapeError(CheckpointShapeError, RankLocalError):
    """The same, found by a load only some ranks make (an online teacher): reported with the rank."""


@dataclass(frozen=True)
class ShapeProblem:
    """One name whose saved and live shapes differ; ``None``: that side has no such tensor."""

    name: str
    saved: Shape | None
    here: Shape | None

    def describe(self) -> str:
        if self.saved is None:
            return f"this run's {self.name!r} (shape {self.here}) is not in the checkpoint"
        if self.here is None:
            return f"the checkpoint holds {self.name!r} (shape {self.saved}), which this run lacks"
        return f"{self.name!r} has shape {self.saved} in the checkpoint but {self.here} in this run"


def shape_problems(saved: Mapping[str, Iterable[int]], here: Mapping[str, Iterable[int]], *,
                   rows_may_differ: Callable[[str], bool] = lambda name: False) -> list[ShapeProblem]:
    """This run's names that the checkpoint lacks or holds with another shape.

    ``rows_may_differ(name)``: its dim 0 may differ (vocabulary tables whose padding a reader re-pads)."""
    out = []
    for name, shape in here.items():
        mine = tuple(shape)
        if name not in saved:
            out.append(ShapeProblem(name, None, mine))
            continue
        theirs = tuple(saved[name])
        if theirs != mine and not (rows_may_differ(name) and theirs[1:] == mine[1:] and len(theirs) == len(mine)):
            out.append(ShapeProblem(name, theirs, mine))
    return out


def unexpected(saved: Mapping[str, Iterable[int]], names: Iterable[str], live: set[str]) -> list[ShapeProblem]:
    """The saved ``names`` that no live tensor has."""
    return [ShapeProblem(n, tuple(saved[n]), None) for n in names if n not in live]


def likely_flag(saved: GPTConfig | None, config: GPTConfig | None) -> str:
    """``; most likely --flag differs: A in the checkpoint, B in this run`` (and what else differs), or ``""``
    when the saved configuration is unknown or agrees on every shape-setting field."""
    if saved is None or config is None:
        return ""
    diff = [(f, getattr(saved, f), getattr(config, f)) for f in SHAPE_FIELDS if getattr(saved, f) != getattr(config, f)]
    if not diff:
        return ""
    (field, there, mine), rest = diff[0], diff[1:]
    also = f" (also {', '.join(f'{f}: {a!r} vs {b!r}' for f, a, b in rest)})" if rest else ""
    return (f"; most likely {FLAG_OF.get(field, '--' + field.replace('_', '-'))} differs: {there!r} in the "
            f"checkpoint, {mine!r} in this run{also}")


def describe(where: str, problems: list[ShapeProblem], hint: str = "") -> str:
    """The one line for ``problems`` found reading ``where`` (a file or a directory)."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"checkpoint {where} does not fit this run's model: {problems[0].describe()}{more}{hint}"


def _gather(obj: object, collective: bool) -> list:
    """Every rank's ``obj`` over this rank's model-parallel (TP x PP) group when ``collective``, else ``[obj]``.

    That group holds every distinct file and parameter of a checkpoint; its DP x CP replicas read the same and
    find the same, so every rank reaches the same verdict (rank 0's group included) without the ranks that do not
    load at all (a tool or a test loading on one rank of a DP group) ever being waited for."""
    if not (collective and dist.is_initialized() and ps.model_parallel_is_initialized()):
        return [obj]
    group = ps.get_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def check_shapes(where: str, saved: Mapping[str, Iterable[int]], here: Mapping[str, Iterable[int]], *,
                 hint: str = "", rows_may_differ: Callable[[str], bool] = lambda name: False,
                 saved_params: Iterable[str] = (), collective: bool = True,
                 error: type[Exception] = CheckpointShapeError) -> None:
    """Raise ``error`` (see the module docstring) when a saved shape does not fit this run's.

    ``saved_params``: the saved names some live tensor must take (else "which this run lacks"); with ``collective``
    they are compared with every rank's names (a global checkpoint: torch_dist), and every rank must call this and
    raises the first finding of its model-parallel group (:func:`_gather`). ``where`` names this rank's file or the
    directory."""
    problems = shape_problems(saved, here, rows_may_differ=rows_may_differ)
    everyone = _gather((describe(where, problems, hint) if problems else None, sorted(here)), collective)
    message = next((m for m, _ in everyone if m is not None), None)
    if message is None:
        live = {n for _, names in everyone for n in names}
        extra = unexpected(saved, saved_params, live)
        message = describe(where, extra, hint) if extra else None
    if message is not None:
        raise error(message)


def saved_config(meta: dict) -> GPTConfig | None:
    """The model configuration a checkpoint's ``metadata.json`` records (None when it cannot be read)."""
    try:
        return GPTConfig.from_dict(meta["model_config"])
    except (KeyError, TypeError, ValueError):
        return None

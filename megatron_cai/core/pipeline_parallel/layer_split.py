"""Which transformer layers each pipeline stage (and virtual chunk) holds: Megatron's split.

Megatron-LM cuts ``num_layers`` into pipeline stages evenly, or unevenly in two ways:

- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the first (last) stage holds
  that many layers, the middle stages share the rest evenly;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding (the
  loss) counts as one layer in the split, so the first (last) chunk holds one transformer layer fewer.

With V virtual chunks per rank, each stage's layers are split evenly over its chunks, and layers are numbered in
chunk order: chunk 0 of ranks 0..P-1, then chunk 1 of ranks 0..P-1, ... (megatron-core's
``get_num_layers_to_build`` and ``get_transformer_layer_offset``). A chunk may hold no transformer layer at all
(the embedding or the loss alone).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    """How layers are split over pipeline stages (Megatron's TransformerConfig fields)."""

    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def first_last(self) -> bool:
        return self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage is not None

    @property
    def even(self) -> bool:
        return not (
            self.first_last or self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        )


EVEN = PipelineSplit()


def stage_layer_count(num_layers: int, pp_rank: int, pp_size: int, split: PipelineSplit = EVEN) -> int:
    """Transformer layers plus the embedding / loss slots that the split gives pipeline rank ``pp_rank``."""
    if pp_size == 1:
        return num_layers
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    if split.first_last:
        if pp_rank == 0 and first is not None:
            return first
        if pp_rank == pp_size - 1 and last is not None:
            return last
        middle_stages = pp_size - (first is not None) - (last is not None)
        return (num_layers - (first or 0) - (last or 0)) // middle_stages
    slots = num_layers + split.account_for_embedding_in_pipeline_split + split.account_for_loss_in_pipeline_split
    return slots // pp_size


def chunk_layer_count(
    num_layers: int,
    pp_rank: int,
    pp_size: int,
    vpp_rank: int = 0,
    vpp_size: int | None = None,
    split: PipelineSplit = EVEN,
) -> int:
    """Transformer layers of chunk ``vpp_rank`` of pipeline rank ``pp_rank`` (megatron-core's
    ``get_num_layers_to_build``)."""
    chunks = vpp_size or 1
    count = stage_layer_count(num_layers, pp_rank, pp_size, split) // chunks
    if pp_size > 1 and split.account_for_embedding_in_pipeline_split and pp_rank == 0 and vpp_rank == 0:
        count -= 1
    if pp_size > 1 and split.account_for_loss_in_pipeline_split and pp_rank == pp_size - 1 and vpp_rank == chunks - 1:
        count -= 1
    return count


def stage_layer_numbers(
    num_layers: int,
    pp_rank: int,
    pp_size: int,
    vpp_rank: int = 0,
    vpp_size: int | None = None,
    split: PipelineSplit = EVEN,
) -> list[int]:
    """Global layer indices of a pipeline stage (or virtual chunk), in Megatron's order: the chunks before it
    (chunk order: virtual chunk, then pipeline rank) hold the layers before its first."""
    offset = sum(
        chunk_layer_count(num_layers, r, pp_size, v, vpp_size, split)
        for v in range(vpp_rank + 1)
        for r in range(pp_size)
        if (v, r) < (vpp_rank, pp_rank)
    )
    return list(range(offset, offset + chunk_layer_count(num_layers, pp_rank, pp_size, vpp_rank, vpp_size, split)))


def split_problems(
    num_layers: int, pp_size: int, vpp_size: int | None, split: PipelineSplit, flags: dict[str, str] | None = None
) -> list[str]:
    """What is wrong with this split (megatron-core's TransformerConfig and argument checks); [] when valid.
    ``flags``: the flag names to quote for the four split fields (Megatron-LM's by default)."""
    names = {
        "first": "--decoder-first-pipeline-num-layers",
        "last": "--decoder-last-pipeline-num-layers",
        "embedding": "--account-for-embedding-in-pipeline-split",
        "loss": "--account-for-loss-in-pipeline-split",
        **(flags or {}),
    }
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    chunks = vpp_size or 1
    if split.even:
        return []
    if pp_size == 1 and split.first_last:
        return [f"an uneven pipeline split ({_given(split, names)}) needs --pipeline-model-parallel-size > 1"]
    if split.first_last and not (
        split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split
    ):
        return _first_last_problems(num_layers, pp_size, chunks, first, last, names)
    if split.first_last:
        return [f"{names['first']} / {names['last']} cannot be combined with {names['embedding']} / {names['loss']}"]
    slots = num_layers + split.account_for_embedding_in_pipeline_split + split.account_for_loss_in_pipeline_split
    if slots % pp_size:
        return [
            f"num-layers {num_layers} plus the embedding / loss slots ({slots}) is not divisible by "
            f"pipeline-model-parallel-size {pp_size}"
        ]
    if (slots // pp_size) % chunks:
        return [
            f"layers per pipeline stage with the embedding / loss slots ({slots // pp_size}) are not divisible "
            f"by the virtual pipeline size {chunks}"
        ]
    return []


def _first_last_problems(
    num_layers: int, pp_size: int, chunks: int, first: int | None, last: int | None, names: dict[str, str]
) -> list[str]:
    problems = []
    for value, name in ((first, names["first"]), (last, names["last"])):
        if value is not None and value <= 0:
            problems.append(f"{name} {value} must be > 0")
        elif value is not None and value % chunks:
            problems.append(f"{name} {value} is not divisible by the virtual pipeline size {chunks}")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp_size - (first is not None) - (last is not None)
    if bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
        problems.append(
            f"{middle_layers} layers are left for {middle_stages} middle pipeline stages "
            f"(num-layers {num_layers}, {names['first']} {first}, {names['last']} {last})"
        )
    elif middle_stages and middle_layers % middle_stages:
        problems.append(
            f"the {middle_layers} middle layers are not divisible by the {middle_stages} middle pipeline stages"
        )
    elif middle_stages and (middle_layers // middle_stages) % chunks:
        problems.append(
            f"the {middle_layers // middle_stages} layers of each middle pipeline stage are not "
            f"divisible by the virtual pipeline size {chunks}"
        )
    return problems


def _given(split: PipelineSplit, names: dict[str, str]) -> str:
    given = [
        names["first"] if split.num_layers_in_first_pipeline_stage is not None else "",
        names["last"] if split.num_layers_in_last_pipeline_stage is not None else "",
        names["embedding"] if split.account_for_embedding_in_pipeline_split else "",
        names["loss"] if split.account_for_loss_in_pipeline_split else "",
    ]
    return ", ".join(g for g in given if g)

"""Process groups for tensor (TP), context (CP), data (DP) and pipeline (PP) parallelism.

Ranks are laid out in Megatron's order: TP ranks are adjacent, then CP, then DP, then PP::

    global_rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

Gradients are reduced over DP x CP (the ``with_context_parallel=True`` group, ordered by
``cp_rank + CP * dp_rank``): CP ranks hold the same weights and see different tokens of one sequence.
That group is further split into an intra-node group (its ranks on the same node, so a node holds whole
CP groups) and an inter-node group (its ranks with the same position inside their node), for
hierarchical gradient reduction. With a world size of one nothing is created and every getter answers
for a single process.

Mixture-of-Experts layers lay the same ranks out a second time, as megatron-core's expert rank generator does
(expert TP ranks adjacent, then EP, then expert DP, then PP)::

    global_rank = etp_rank + ETP * (ep_rank + EP * (edp_rank + EDP * pp_rank))

Expert parameters are split over EP (and ETP) and their gradients reduce over the expert-DP group.

``--use-tp-pp-dp-mapping`` (``order=TP_PP_DP_ORDER``) swaps DP and PP in both enumerations, as megatron-core's
'tp-cp-ep-pp-dp' order does: PP ranks then come before DP ranks.

Islands (DiLoCo, docs/diloco.md): with ``islands=N`` the world is cut into N equal runs of consecutive ranks
(whole nodes under torchrun and Slurm); each island is laid out as above as if it were the whole job, and
every group but ``outer`` stays inside one island. The ``outer`` group joins the ranks at the same position
of every island (the same model shard and DP x CP slot): the outer all-reduce of the pseudo-gradients.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist


class ParallelLayoutError(ValueError):
    """An impossible parallel layout; the message says which sizes and why."""


@dataclass
class _State:
    world_size: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int | None = None
    vpp_rank: int | None = None
    ep: int = 1
    etp: int = 1
    edp: int = 1
    ranks_per_node: int = 1
    islands: int = 1
    groups: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)


_STATE: _State | None = None

DEFAULT_ORDER = "tp-cp-dp-pp"  # megatron-core's default ('tp-cp-ep-dp-pp', EP = 1 here)
TP_PP_DP_ORDER = "tp-cp-pp-dp"  # --use-tp-pp-dp-mapping (megatron-core's 'tp-cp-ep-pp-dp')



def check_layout(world_size: int, tp: int, pp: int, num_layers: int | None = None,
                 num_attention_heads: int | None = None, num_query_groups: int | None = None,
                 global_batch_size: int | None = None, micro_batch_size: int | None = None,
                 vpp_layers: int | None = None, cp: int = 1) -> int:
    """Validate a TP x CP x DP x PP layout; return DP. Raises one ParallelLayoutError listing every problem."""
    problems = []
    if tp < 1 or pp < 1 or cp < 1:
        problems.append(f"tensor ({tp}), context ({cp}) and pipeline ({pp}) parallel sizes must be >= 1")
    elif world_size % (tp * cp * pp) != 0:
        what = f"tensor-model-parallel-size {tp} x " + (f"context-parallel-size {cp} x " if cp > 1 else "")
        problems.append(f"world size {world_size} is not divisible by {what}pipeline-model-parallel-size {pp} = "
                        f"{tp * cp * pp}")
    dp = max(world_size // max(tp * cp * pp, 1), 1)
    if num_layers is not None and num_layers % pp != 0:
        problems.append(f"num-layers {num_layers} is not divisible by pipeline-model-parallel-size {pp}")
    if vpp_layers is not None and num_layers is not None and pp > 0 and num_layers % pp == 0:
        per_stage = num_layers // pp
        if per_stage % vpp_layers != 0:
            problems.append(f"layers per pipeline stage ({per_stage}) are not divisible by "
                            f"num-layers-per-virtual-pipeline-stage {vpp_layers}")
    if num_attention_heads is not None and num_attention_heads % tp != 0:
        problems.append(f"num-attention-heads {num_attention_heads} is not divisible by "
                        f"tensor-model-parallel-size {tp}")
    if num_query_groups is not None and num_query_groups % tp != 0 and tp % num_query_groups != 0:
        problems.append(f"num-query-groups {num_query_groups} and tensor-model-parallel-size {tp}: one must "
                        "divide the other (KV heads are split, or replicated, across TP ranks)")
    if global_batch_size is not None and micro_batch_size is not None:
        if global_batch_size % (micro_batch_size * dp) != 0:
            problems.append(f"global-batch-size {global_batch_size} is not divisible by micro-batch-size "
                            f"{micro_batch_size} x data-parallel size {dp} = {micro_batch_size * dp}")
    if problems:
        cp_text = f", CP={cp}" if cp > 1 else ""
        raise ParallelLayoutError(
            f"impossible parallel layout for world size {world_size} (TP={tp}{cp_text}, PP={pp}, DP={dp}): "
            + "; ".join(problems))
    return dp


def check_expert_layout(world_size: int, pp: int, etp: int, ep: int) -> int:
    """Validate the expert layout (ETP x EP x expert-DP x PP); return the expert-DP size."""
    if etp < 1 or ep < 1 or world_size % (etp * ep * pp) != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by expert-tensor-parallel-size {etp} x "
            f"expert-model-parallel-size {ep} x pipeline-model-parallel-size {pp} = {etp * ep * pp}")
    return world_size // (etp * ep * pp)


def expert_layouts(etp: int, ep: int, edp: int, pp: int, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """The expert groups as megatron-core's expert rank generator makes them: the dense ``order`` with EP in
    CP's place (megatron-core's 'tp-cp-ep-dp-pp' or 'tp-cp-ep-pp-dp' with CP = 1), the first dimension fastest."""
    grank = _rank_of(order.replace("cp", "ep"), {"tp": etp, "ep": ep, "dp": edp, "pp": pp})
    T, E, D, P = range(etp), range(ep), range(edp), range(pp)
    return {"etp": [[grank(tp=t, ep=e, dp=d, pp=p) for t in T] for p in P for d in D for e in E],
            "ep": [[grank(tp=t, ep=e, dp=d, pp=p) for e in E] for p in P for d in D for t in T],
            "tp_ep": [sorted(grank(tp=t, ep=e, dp=d, pp=p) for e in E for t in T) for p in P for d in D],
            "edp": [[grank(tp=t, ep=e, dp=d, pp=p) for d in D] for p in P for e in E for t in T]}


def _rank_of(order: str, sizes: dict[str, int]):
    """The global rank of a coordinate when ranks enumerate ``sizes`` in ``order`` (first dimension fastest)."""
    dims = order.split("-")
    if sorted(dims) != sorted(sizes):
        raise ValueError(f"rank order {order!r}: expected a permutation of {', '.join(sizes)}")

    def grank(**index: int) -> int:
        rank, stride = 0, 1
        for dim in dims:
            rank += index[dim] * stride
            stride *= sizes[dim]
        return rank

    return grank


_GROUP_TIMEOUT: datetime.timedelta | None = None  # --distributed-timeout-minutes, for every group made here


def new_group(ranks=None, **kwargs):
    """``dist.new_group`` with the run's collective timeout (``--distributed-timeout-minutes``, given to
    :func:`initialize_model_parallel`): every process group of the package is made here, so a rank that
    stops answering fails every collective waiting on it after that long (a structure test checks it)."""
    if _GROUP_TIMEOUT is not None:
        kwargs.setdefault("timeout", _GROUP_TIMEOUT)
    return dist.new_group(ranks, **kwargs)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              ranks_per_node: int | None = None, context_parallel_size: int = 1,
                              timeout: datetime.timedelta | None = None, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: int | None = None, islands: int = 1,
                              order: str = DEFAULT_ORDER) -> None:
    """Create all process groups, each with ``timeout`` (default: torch's). Every rank must call this with
    the same arguments. ``expert_tensor_parallel_size`` defaults to the tensor-parallel size, as Megatron's;
    ``islands``: DiLoCo islands (module docstring), the expert groups stay inside one island. ``order``: how
    the ranks of each island enumerate the layout (see :func:`rank_layouts`), for the dense and the expert groups."""
    global _STATE, _GROUP_TIMEOUT
    _GROUP_TIMEOUT = timeout
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if islands < 1 or world % islands:
        raise ParallelLayoutError(f"world size {world} does not split into {islands} equal islands "
                                  "(--diloco-islands)")
    island_size = world // islands
    dp = check_layout(island_size, tp, pp, cp=cp)
    state = _State(world_size=world, rank=rank, tp=tp, pp=pp, dp=dp, cp=cp,
                   vpp=virtual_pipeline_model_parallel_size,
                   vpp_rank=0 if virtual_pipeline_model_parallel_size else None, islands=islands)
    rpn = ranks_per_node or island_size
    tcp = tp * cp
    if rpn % tcp != 0 or ((tcp * dp) % rpn != 0 and rpn % (tcp * dp) != 0):
        # A node must hold whole TP x CP groups and a whole number of DP peers (or whole DP groups).
        if ranks_per_node is not None and world > 1:
            cp_text = f" x context-parallel-size {cp}" if cp > 1 else ""
            raise ParallelLayoutError(
                f"ranks per node {rpn} must be a multiple of tensor-model-parallel-size {tp}{cp_text} and divide, "
                f"or be a multiple of, TP x CP x DP = {tcp * dp}, so that each node holds whole TP (and CP) groups")
        rpn = island_size
    state.ranks_per_node = rpn
    state.ep, state.etp = expert_model_parallel_size, expert_tensor_parallel_size or tp
    state.edp = check_expert_layout(island_size, pp, state.etp, state.ep)
    if not order.endswith("pp") and pp > 1 and state.edp != dp:
        # megatron-core's rule: the dense and the expert layouts must agree on the pipeline groups.
        raise ParallelLayoutError(
            f"with --use-tp-pp-dp-mapping and pipeline-model-parallel-size {pp} the expert data-parallel size "
            f"({state.edp}) must equal the data-parallel size ({dp}): expert-tensor-parallel-size {state.etp} x "
            f"expert-model-parallel-size {state.ep} must equal tensor-model-parallel-size {tp} x "
            f"context-parallel-size {cp}")
    one_island = (_island_layouts(tp, cp, dp, pp, rpn, order)
                  | expert_layouts(state.etp, state.ep, state.edp, pp, order))
    layouts = {name: [[r + i * island_size for r in ranks] for i in range(islands) for ranks in groups]
               for name, groups in one_island.items()}
    layouts["outer"] = [[r + i * island_size for i in range(islands)] for r in range(island_size)]
    if islands > 1:  # every rank of one island: the inner loop's world (its norm, its skip decisions)
        layouts["island"] = [list(range(i * island_size, (i + 1) * island_size)) for i in range(islands)]
    for name, groups in layouts.items():
        for ranks in groups:
            pg = new_group(ranks) if world > 1 else None
            if rank in ranks:
                state.groups[name] = pg
                state.ranks[name] = ranks
    _STATE = state


def _island_layouts(tp: int, cp: int, dp: int, pp: int, rpn: int,
                    order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Every group of one island (ranks 0 .. TP x CP x DP x PP - 1) by kind, its ranks enumerated in ``order``."""
    layouts = rank_layouts(tp, cp, dp, pp, order)
    intra, inter = [], []
    for group in layouts["dp_cp"]:  # each node's members of a DP x CP group, and the same member across nodes
        nodes: dict[int, list[int]] = {}
        for r in group:
            nodes.setdefault(r // rpn, []).append(r)
        chunks = list(nodes.values())
        if len({len(c) for c in chunks}) > 1:  # not whole groups per node: one node
            chunks = [group]
        intra += chunks
        inter += [[c[i] for c in chunks] for i in range(len(chunks[0]))]
    layouts["dp_intra"] = intra
    layouts["dp_inter"] = inter
    return layouts


def rank_layouts(tp: int, cp: int, dp: int, pp: int, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """The rank groups of each kind (tp, cp, dp, dp_cp, pp, mp, embd, tp_cp, tp_dp_cp) when global ranks enumerate
    the layout in ``order``, the first dimension fastest (megatron-core's RankGenerator)."""
    rank_of = _rank_of(order, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})

    def grank(t, c, d, p):
        return rank_of(tp=t, cp=c, dp=d, pp=p)

    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    return {
        "tp": [[grank(t, c, d, p) for t in T] for p in P for d in D for c in C],
        "cp": [[grank(t, c, d, p) for c in C] for p in P for d in D for t in T],
        "dp": [[grank(t, c, d, p) for d in D] for p in P for c in C for t in T],
        "dp_cp": [sorted(grank(t, c, d, p) for d in D for c in C) for p in P for t in T],
        "pp": [[grank(t, c, d, p) for p in P] for d in D for c in C for t in T],
        "mp": [sorted(grank(t, c, d, p) for p in P for t in T) for d in D for c in C],
        "embd": [sorted({grank(t, c, d, 0), grank(t, c, d, pp - 1)}) for d in D for c in C for t in T],
        "tp_cp": [sorted(grank(t, c, d, p) for c in C for t in T) for p in P for d in D],
        "tp_dp_cp": [sorted(grank(t, c, d, p) for d in D for c in C for t in T) for p in P],
    }


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    global _STATE, _GROUP_TIMEOUT
    _STATE = None
    _GROUP_TIMEOUT = None


def _s() -> _State:
    if _STATE is None:
        raise RuntimeError("parallel_state is not initialized: call initialize_model_parallel() first")
    return _STATE


def _group(name: str):
    return _s().groups.get(name)


def _ranks(name: str) -> list[int]:
    return _s().ranks.get(name, [0])


# Groups (None means "a single process": collectives on it are skipped by callers).
def get_tensor_model_parallel_group():
    return _group("tp")


def get_pipeline_model_parallel_group():
    return _group("pp")


def get_data_parallel_group(with_context_parallel: bool = False):
    """The DP group; with ``with_context_parallel`` the DP x CP group over which gradients are reduced."""
    return _group("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_group():
    return _group("cp")


def get_model_parallel_group():
    return _group("mp")


def get_embedding_group():
    return _group("embd")


def get_data_parallel_intra_node_group():
    """The DP x CP group's ranks on this node (whole CP groups): hierarchical reduction's first stage."""
    return _group("dp_intra")


def get_data_parallel_inter_node_group():
    return _group("dp_inter")


def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_tensor_parallel_group():
    return _group("etp")


def get_expert_tensor_and_model_parallel_group():
    """Expert TP x EP: the allgather dispatcher's group."""
    return _group("tp_ep")


def get_expert_data_parallel_group():
    """The ranks holding the same experts: expert gradients reduce over it."""
    return _group("edp")


def get_tensor_and_context_parallel_group():
    return _group("tp_cp")


def get_tensor_data_context_parallel_group():
    """TP x DP x CP: the expert-bias token counts and the global aux loss sum over it."""
    return _group("tp_dp_cp")


def get_expert_model_parallel_world_size() -> int:
    return _s().ep if _STATE else 1


def get_expert_model_parallel_rank() -> int:
    return _ranks("ep").index(_s().rank) if _STATE else 0


def get_expert_tensor_parallel_world_size() -> int:
    return _s().etp if _STATE else 1


def get_expert_tensor_parallel_rank() -> int:
    return _ranks("etp").index(_s().rank) if _STATE else 0


def get_expert_data_parallel_world_size() -> int:
    return _s().edp if _STATE else 1


def get_expert_data_parallel_rank() -> int:
    return _ranks("edp").index(_s().rank) if _STATE else 0


def get_expert_data_parallel_global_ranks() -> list[int]:
    return list(_ranks("edp"))


# Sizes and ranks.
def get_tensor_model_parallel_world_size() -> int:
    return _s().tp if _STATE else 1


def get_pipeline_model_parallel_world_size() -> int:
    return _s().pp if _STATE else 1


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if not _STATE:
        return 1
    return _s().dp * _s().cp if with_context_parallel else _s().dp


def get_context_parallel_world_size() -> int:
    return _s().cp if _STATE else 1


def get_tensor_model_parallel_rank() -> int:
    return _ranks("tp").index(_s().rank) if _STATE else 0


def get_pipeline_model_parallel_rank() -> int:
    return _ranks("pp").index(_s().rank) if _STATE else 0


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _ranks("dp_cp" if with_context_parallel else "dp").index(_s().rank) if _STATE else 0


def get_context_parallel_rank() -> int:
    return _ranks("cp").index(_s().rank) if _STATE else 0


def get_data_parallel_intra_node_world_size() -> int:
    return len(_ranks("dp_intra")) if _STATE else 1


def get_data_parallel_inter_node_world_size() -> int:
    return len(_ranks("dp_inter")) if _STATE else 1


def get_data_parallel_global_ranks(with_context_parallel: bool = False) -> list[int]:
    return list(_ranks("dp_cp" if with_context_parallel else "dp"))


def get_context_parallel_global_ranks() -> list[int]:
    return list(_ranks("cp"))


def get_embedding_global_ranks() -> list[int]:
    return list(_ranks("embd"))


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(_s().rank) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(_s().rank) - 1) % len(ranks)]


# Virtual pipeline (interleaved 1F1B).
def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _s().vpp if _STATE else None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _s().vpp_rank if _STATE else None


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    _s().vpp_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    if not ignore_virtual and _STATE and _s().vpp and _s().vpp_rank not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    if not ignore_virtual and _STATE and _s().vpp and _s().vpp_rank not in (None, _s().vpp - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# Islands (DiLoCo).
def get_num_islands() -> int:
    return _s().islands if _STATE else 1


def get_island_rank() -> int:
    """Which island this rank belongs to (0 .. islands - 1)."""
    return _s().rank // (_s().world_size // _s().islands) if _STATE else 0


def get_outer_group():
    """The ranks at this rank's position in every island (None with one island)."""
    return _group("outer") if get_num_islands() > 1 else None


def get_island_group():
    """Every rank of this rank's island: the inner loop's world (None, the whole world, with one island)."""
    return _group("island") if get_num_islands() > 1 else None


def get_island_world_size() -> int:
    """How many ranks one island holds (the world size with one island)."""
    return get_world_size() // get_num_islands()


def get_outer_global_ranks() -> list[int]:
    return list(_ranks("outer"))


def get_data_shard() -> tuple[int, int]:
    """(shard, shards) of the training data this rank reads: its DP rank among every island's DP ranks
    (each island trains on its own samples; CP ranks share theirs)."""
    dp = get_data_parallel_world_size()
    return get_island_rank() * dp + get_data_parallel_rank(), get_num_islands() * dp


def get_world_size() -> int:
    return _s().world_size if _STATE else 1


def get_rank() -> int:
    return _s().rank if _STATE else 0

"""Fully sharded data parallelism on PyTorch FSDP2 (``--use-torch-fsdp2``), composed with our TP and PP.

Each model chunk is sharded over the DP dimension of a (PP, DP, TP) device mesh built from
``parallel_state``'s groups (with context parallelism the DP dimension is DP x CP, over which gradients
reduce; rank order TP, CP, DP, PP keeps it one mesh dimension): every transformer layer is one
``fully_shard`` unit, the embedding another (unless a single-stage model ties it to the output layer),
and the chunk itself the root unit (final norm and output layer, which ``GPTModel._logits`` uses outside
any submodule's forward). Parameters are the TP-local shards, so FSDP2 shards TP shards over DP.

MoE: each layer's routed experts (``GroupedExperts``, this EP rank's experts, expert-TP-local) are a unit of
their own, sharded over the expert-data-parallel mesh (parallel_state's expert-DP group: the ranks holding the
same experts), inside their layer's unit, which then holds the dense parameters only (torchtitan's layout).
Their reduce-scatter runs over expert DP; FSDP2 divides by its size, and the unit's all-reduce hook first
multiplies by expert-DP / (DP x CP) (``ExpertGradScale``): each expert's gradient already sums what every EP
rank's tokens contributed, and the result is the same DP x CP mean as the dense gradients' (the DDP path's
pre-scale, ``expert_reducer.py``).

``FullyShardedChunk`` offers the interface the schedules and the trainer use on the DDP wrapper:
``set_is_last_microbatch`` (FSDP2's ``set_requires_gradient_sync`` / ``set_is_last_backward``: no
reduce-scatter before the last micro-batch's backward of the chunk), ``zero_grad_buffer``,
``finish_grad_sync`` (sums over the embedding group for tied embeddings across stages and over TP for
TP-partial gradients, on the local DP shards), ``reducer`` (the reduce-scatter hooks' state) and
``grad_comm_bytes`` (the ``contracts.ModelChunk`` members). ``core.optimizer.fsdp_adamw.FullyShardedAdamW``
updates the DTensor shards.

HSDP (``--squinch --squinch-hierarchical``): the shard mesh is this node's DP ranks (parallel_state's
intra-node DP group); each unit's ``SquinchReduceScatter(inter_group=...)`` reduce-scatters inside the node and, as the
unit's all-reduce hook, sums the shard across nodes with Squinch; FSDP2 then divides by the whole DP
size. The grad norm counts the first node's shards only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .. import device as device_mod
from .. import parallel_state as ps
from ..transformer.moe.experts import GroupedExperts
from .config import DDPConfig
from .contracts import NO_TIMERS
from .squinch_fsdp import CountingReduceScatter, SquinchReduceScatter


@dataclass(frozen=True)
class FSDPSettings:
    """How ``--use-torch-fsdp2`` shards and communicates."""

    bf16: bool = False                  # bf16 compute (param_dtype); fp32 sharded master weights
    reduce_in_bf16: bool = False        # reduce-scatter in bf16 (default fp32)
    reshard_after_forward: bool = True  # free gathered layer weights after forward (ZeRO-3)
    squinch: bool = False
    squinch_error_feedback: bool = True
    squinch_stochastic: bool = False
    hierarchical: bool = False          # HSDP: shard within a node, Squinch all-reduce across nodes
    seed: int = 0

    @property
    def hsdp(self) -> bool:
        """--squinch-hierarchical: FSDP2 within a node, Squinch all-reduce across nodes."""
        return self.squinch and self.hierarchical

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.bf16 else None,
                                    reduce_dtype=torch.bfloat16 if self.reduce_in_bf16 else torch.float32)


@dataclass(frozen=True)
class ParamMeta:
    """What the DDP path reads from parameter attributes, recorded before FSDP2 replaces the params."""

    shared_embedding: bool
    tp_replicated: bool
    allreduce_over_tp: bool
    decay: bool
    expert: bool = False  # MoE routed experts: sharded over the expert-DP mesh


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def build_dp_mesh(device: torch.device, hierarchical: bool = False) -> DeviceMesh:
    """The DP (x CP) dimension of a (PP, DP x CP, TP) mesh over parallel_state's existing process groups; with
    ``hierarchical`` (HSDP) those ranks on this node only (parallel_state's intra-node group)."""
    world = ps.get_world_size()
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError("--use-torch-fsdp2 needs torch.distributed: launch with torchrun")
        # a single process (plain python, or torchrun with one rank): FSDP2 still needs a process group
        dist.init_process_group(device_mod.backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    if hierarchical and world > 1:
        return DeviceMesh.from_group(ps.get_data_parallel_intra_node_group(), device.type,
                                     mesh_dim_names=("dp_shard",))
    if world == 1:
        return DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("dp",))
    pp, dp, tp = (ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size(True),
                  ps.get_tensor_model_parallel_world_size())
    groups = [ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_tensor_model_parallel_group()]
    mesh = DeviceMesh.from_group(groups, device.type, mesh=torch.arange(world).view(pp, dp, tp),
                                 mesh_dim_names=("pp", "dp", "tp"))
    return mesh["dp"]


def build_expert_dp_mesh(device: torch.device) -> DeviceMesh:
    """MoE: parallel_state's expert-data-parallel group (the ranks that hold the same experts) as a 1-D mesh
    (after ``build_dp_mesh``, which starts torch.distributed for a single process)."""
    group = ps.get_expert_data_parallel_group() if ps.get_world_size() > 1 else dist.group.WORLD
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("edp",))


def expert_units(module: nn.Module) -> list[GroupedExperts]:
    """The routed experts of each MoE layer (each gets its own ``fully_shard`` over the expert-DP mesh)."""
    return [m for m in module.modules() if isinstance(m, GroupedExperts)]


class ExpertGradScale:
    """An expert unit's all-reduce hook: scale the reduce-scattered shard by expert-DP / (DP x CP) before FSDP2
    divides it by expert DP (a no-op when the two groups are one)."""

    def __init__(self, expert_dp: int, dp: int) -> None:
        self.factor = expert_dp / dp

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.factor != 1.0:
            reduce_output.mul_(self.factor)


def sharding_units(module: nn.Module) -> list[nn.Module]:
    """Sub-modules that get their own ``fully_shard`` (the chunk itself is the root unit)."""
    units = list(module.decoder.layers.values())
    tied_here = module.pre_process and module.post_process and module.output_layer is None
    if module.embedding is not None and not tied_here:
        units.insert(0, module.embedding)
    return units


class FullyShardedChunk(nn.Module):
    """One model chunk (``GPTModel``) under FSDP2 over the DP mesh dimension (a ``contracts.ModelChunk``)."""

    data_parallel_kind = "fsdp2"

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh, settings: FSDPSettings,
                 device: torch.device, expert_mesh: DeviceMesh | None = None) -> None:
        """``expert_mesh``: the expert-DP mesh of MoE experts (None: experts shard with their layer, over
        ``dp_mesh``)."""
        super().__init__()
        self.settings = settings
        self.meta = {name: ParamMeta(bool(getattr(p, "shared_embedding", False)),
                                     getattr(p, "tp_dim", None) is None,
                                     bool(getattr(p, "allreduce_over_tp", False)), p.dim() > 1,
                                     bool(getattr(p, "is_expert", False)))
                     for name, p in module.named_parameters()}
        policy = settings.mp_policy()
        experts = expert_units(module) if expert_mesh is not None else []
        for unit in experts:  # first: the layers' units then skip the experts' parameters
            fully_shard(unit, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward)
        for unit in sharding_units(module):
            fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward)
        fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward)
        self.module = module
        self.comms: dict[str, CountingReduceScatter] = {}
        for name, m in module.named_modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                comm = self._make_comm(len(self.comms))
                m.set_custom_reduce_scatter(comm)
                if isinstance(comm, SquinchReduceScatter) and comm.hierarchical:  # nodes, then divide by DP
                    m.set_all_reduce_hook(comm.all_reduce_hook)
                    m.set_gradient_divide_factor(float(ps.get_data_parallel_world_size(True)))
                if any(m is unit for unit in experts):  # reduced over expert DP: rescale to the DP x CP mean
                    m.set_all_reduce_hook(ExpertGradScale(expert_mesh.size(), ps.get_data_parallel_world_size(True)))
                self.comms[name or "root"] = comm
        self.reducer = UnitReducers(self.comms)
        self.reducer.attach(device)  # the gradients' device: Squinch state is restored there
        named = dict(module.named_parameters())
        self.shared_params = [p for n, p in named.items() if self.meta[n].shared_embedding]
        self.tp_partial_params = [p for n, p in named.items() if self.meta[n].allreduce_over_tp]

    def _make_comm(self, index: int) -> CountingReduceScatter:
        s = self.settings
        if not s.squinch:
            return CountingReduceScatter()
        if s.hsdp:
            inter = ps.get_data_parallel_inter_node_group() if ps.get_world_size() > 1 else None
            return SquinchReduceScatter(error_feedback=s.squinch_error_feedback, stochastic=s.squinch_stochastic,
                                        seed=s.seed * 1000 + index, inter_group=inter)
        return SquinchReduceScatter(error_feedback=s.squinch_error_feedback, stochastic=s.squinch_stochastic,
                                    seed=s.seed * 1000 + index)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_is_last_microbatch(self, last: bool) -> None:
        """Only the last micro-batch's backward reduce-scatters; earlier ones accumulate unsharded grads."""
        self.module.set_requires_gradient_sync(last)
        self.module.set_is_last_backward(last)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def finish_grad_sync(self) -> None:
        """After the last backward: sum tied-embedding shards over the embedding group and TP-partial
        gradient shards over TP (FSDP2 has already reduce-scattered over DP)."""
        embd_group = ps.get_embedding_group()
        if self.shared_params and embd_group is not None and len(ps.get_embedding_global_ranks()) > 1:
            for p in self.shared_params:
                dist.all_reduce(local(p.grad), group=embd_group)
        grads = [local(p.grad) for p in self.tp_partial_params if p.grad is not None]
        if grads and ps.get_tensor_model_parallel_world_size() > 1:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def counted_in_norm(self, name: str) -> bool:
        """Each distinct gradient element once in the global norm (as in the DDP path): TP-replicated
        tensors on TP rank 0 only, the last stage's copy of tied embeddings not at all; under HSDP the
        shards of the first node only (the other nodes hold identical copies)."""
        if self.settings.hsdp and ps.get_world_size() > 1 and \
                dist.get_rank(ps.get_data_parallel_inter_node_group()) != 0:
            return False
        m = self.meta[name]
        if m.expert:  # distinct over EP x expert TP, sharded over expert DP
            return True
        if m.shared_embedding and not self.module.pre_process:
            return False
        return not (m.tp_replicated and ps.get_tensor_model_parallel_rank() != 0)

    @property
    def grad_comm_bytes(self) -> int:
        return self.reducer.bytes_sent


class UnitReducers:
    """The reduce-scatter hooks of one chunk's ``fully_shard`` units, seen as one ``contracts.GradReducer``
    (bytes, skipped steps, state; no phase timers)."""

    timers = NO_TIMERS

    def __init__(self, comms: dict[str, CountingReduceScatter]) -> None:
        self.comms = comms
        self.carries_feedback = any(c.carries_feedback for c in comms.values())

    def attach(self, device: torch.device) -> None:
        for c in self.comms.values():
            c.attach(device)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.comms.values())

    @property
    def inter_node_bytes_sent(self) -> int:
        return sum(c.inter_node_bytes_sent for c in self.comms.values())

    def step_skipped(self) -> None:
        for c in self.comms.values():
            c.step_skipped()

    def rescale_feedback(self, factor: float) -> None:
        for c in self.comms.values():
            c.rescale_feedback(factor)

    def state_dict(self) -> dict:
        return {name: c.state_dict() for name, c in self.comms.items()}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.comms) - set(state))
        if missing:
            raise KeyError(f"reduce-scatter state for FSDP units {missing} is missing from the checkpoint")
        for name, c in self.comms.items():
            c.load_state_dict(state[name])


def wrap_model_chunks(chunks: list[nn.Module], device: torch.device,
                      settings: FSDPSettings) -> list[FullyShardedChunk]:
    """Shard every model chunk of this rank over DP (after ``chunk.to(device)``); MoE experts over expert DP
    (except under HSDP, which the flags allow at EP 1 only: there the experts shard with their layer)."""
    mesh = build_dp_mesh(device, settings.hsdp)
    moe = any(expert_units(c) for c in chunks)
    expert_mesh = build_expert_dp_mesh(device) if moe and not settings.hsdp else None
    return [FullyShardedChunk(c, mesh, settings, device, expert_mesh) for c in chunks]


__all__: list[str] = ["ExpertGradScale", "FSDPSettings", "FullyShardedChunk", "UnitReducers", "build_dp_mesh",
                      "build_expert_dp_mesh", "build_fsdp2", "expert_units", "local", "sharding_units",
                      "wrap_model_chunks"]


def build_fsdp2(chunks: list[nn.Module], device: torch.device, ddp: DDPConfig, *, bf16: bool,
                seed: int) -> list[FullyShardedChunk]:
    """The trainer's hook: shard this rank's chunks as ``ddp`` says."""
    settings = FSDPSettings(bf16=bf16, reduce_in_bf16=ddp.grad_reduce_in_bf16, squinch=ddp.reducer == "squinch",
                            squinch_error_feedback=ddp.squinch.error_feedback,
                            squinch_stochastic=ddp.squinch.stochastic_rounding,
                            hierarchical=ddp.squinch.hierarchical, seed=seed)
    return wrap_model_chunks(chunks, device, settings)

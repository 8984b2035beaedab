"""AdamW over the flat parameter/gradient buffers, optionally sharded over DP (ZeRO-1).

Parameters are fp32 (bf16 runs use autocast), so the flat ``param_data`` buffer *is* the fp32 master
copy. The optimizer updates the buffer ranges it owns: everything, or with the distributed optimizer
this rank's shard of every bucket, after which the shards are all-gathered. Adam state lives only
for owned elements. No weight decay on 1-D parameters (norm weights and biases), as in Megatron.

The update is PyTorch's fused kernel (``torch._fused_adamw_``, ``torch._fused_sgd_``: one pass over
memory, on CUDA and on the CPU), called once per parameter group of an owned range: the contiguous runs
that share a learning rate (``--decoupled-lr`` for the embedding and output layer, ``--use-mup``'s rescaled group:
``OptimizerConfig.lr_kind``) and a weight decay.
"""
from __future__ import annotations

import torch

from .. import device as device_mod
from .. import parallel_state as ps
from ..distributed.contracts import ModelChunk
from ..distributed.ddp import DistributedDataParallel
from .clip_grads import GlobalNormClipping
from .config import OptimizerConfig, applies_weight_decay, group_lrs
from .fsdp_adamw import FullyShardedAdamW


def _intersect(segments: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in segments if s < hi and e > lo]


class _Chunk:
    """One owned contiguous buffer range of one model chunk, with its Adam state."""

    def __init__(self, ddp: DistributedDataParallel, lo: int, hi: int, decay_segments, norm_segments,
                 kind_segments: dict[str, list[tuple[int, int]]]) -> None:
        buf = ddp.buffer
        self.lo, self.hi = lo, hi
        self.param = buf.param_data[lo:hi]
        self.grad = buf.grad_data[lo:hi]
        self.exp_avg = torch.zeros(hi - lo, dtype=torch.float32, device=buf.param_data.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.norm = [(s - lo, e - lo) for s, e in _intersect(norm_segments, lo, hi)]
        self.runs = _runs(hi - lo, [(s - lo, e - lo) for s, e in _intersect(decay_segments, lo, hi)],
                          {k: [(s - lo, e - lo) for s, e in _intersect(segs, lo, hi)]
                           for k, segs in kind_segments.items()})


def _runs(n: int, decay: list[tuple[int, int]], kinds: dict[str, list[tuple[int, int]]]
          ) -> list[tuple[int, int, str, bool]]:
    """``[0, n)`` cut into maximal runs ``(start, end, lr kind, decay)`` of one learning rate and decay
    (``kinds``: the segments of each non-base learning-rate kind, see OptimizerConfig.lr_kind)."""
    cuts = sorted({0, n, *(x for seg in decay + [s for segs in kinds.values() for s in segs] for x in seg)})

    def inside(x: int, segments) -> bool:
        return any(s <= x < e for s, e in segments)

    runs: list[list] = []
    for s, e in zip(cuts, cuts[1:]):
        key = (next((k for k, segs in kinds.items() if inside(s, segs)), "base"), inside(s, decay))
        if runs and runs[-1][1] == s and tuple(runs[-1][2:]) == key:
            runs[-1][1] = e
        else:
            runs.append([s, e, *key])
    return [tuple(r) for r in runs]


class _Group:
    """The tensors of one fused call: owned runs with the same learning rate kind and weight decay."""

    def __init__(self, kind: str, decay: bool) -> None:
        self.kind, self.decay = kind, decay
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []

    def add(self, c: _Chunk, s: int, e: int) -> None:
        self.params.append(c.param[s:e])
        self.grads.append(c.grad[s:e])
        self.exp_avgs.append(c.exp_avg[s:e])
        self.exp_avg_sqs.append(c.exp_avg_sq[s:e])

    def fp32_grads(self) -> list[torch.Tensor]:
        """The gradients as the kernels take them (fp32 copies of --grad-reduce-in-bf16 buffers)."""
        return [g if g.dtype == torch.float32 else g.float() for g in self.grads]


class DistributedAdamW(GlobalNormClipping):
    """AdamW (``optimizer="adam"``) or SGD with momentum (``optimizer="sgd"``: torch.optim.SGD's update with L2
    weight decay on matrices, as Megatron-LM's sgd) over the flat buffers.

    ``overlap_param_gather`` (distributed optimizer): the all-gather of the updated shards runs in the
    background; each module waits for its parameters' buckets just before its next forward.
    """

    def __init__(self, model_chunks: list[DistributedDataParallel], config: OptimizerConfig) -> None:
        self.model_chunks = model_chunks
        self.config = config
        self.lr, self.weight_decay, self.betas, self.eps = config.lr, config.weight_decay, config.betas, config.adam_eps
        self.kind, self.sgd_momentum = config.optimizer, config.sgd_momentum
        # sharded over DP x CP: the ranks that hold the same weights (Megatron's rule with context parallelism)
        self.distributed = config.use_distributed_optimizer and ps.get_data_parallel_world_size(True) > 1
        self.step_count = 0
        self.grad_scaler = None  # set by the trainer with --fp16; its state is saved with the optimizer's
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        edp_rank = ps.get_expert_data_parallel_rank()
        self.chunks: list[list[_Chunk]] = []
        for ddp in model_chunks:
            buf = ddp.buffer
            # the learning-rate kind of each parameter (--decoupled-lr, --use-mup): segments per non-base kind
            kind_of = {id(p): config.lr_kind(name, p.dim()) for name, p in ddp.module.named_parameters()}
            kind_segments = {k: buf.segments(lambda p, k=k, kind_of=kind_of: kind_of.get(id(p)) == k)
                             for k in ("decoupled", "mup")}
            decayed = {id(p) for name, p in ddp.module.named_parameters()
                       if applies_weight_decay(name, p.dim() > 1, config.apply_wd_to_qk_layernorm)}
            decay = buf.segments(lambda p, decayed=decayed: id(p) in decayed)

            def counts(p, ddp=ddp) -> bool:
                # Each distinct gradient element counted once in the global norm: TP-replicated tensors on TP
                # rank 0 only, the last stage's copy of tied embeddings not at all, DP replicas on DP rank 0.
                if getattr(p, "shared_embedding", False) and not ddp.module.pre_process:
                    return False
                if getattr(p, "is_expert", False):  # distinct over EP x ETP, replicated (or sharded) over EDP
                    return self.distributed or edp_rank == 0
                replicated = getattr(p, "tp_dim", None) is None
                return not (replicated and tp_rank != 0)

            def expert_counts(p, counts=counts) -> bool:
                return getattr(p, "is_expert", False) and counts(p)

            norm = buf.segments(counts if self.distributed or dp_rank == 0 else expert_counts)
            self.chunks.append([_Chunk(ddp, lo, hi, decay, norm, kind_segments)
                                for lo, hi in buf.owned_ranges(self.distributed)])
        self.groups: dict[tuple[str, bool], _Group] = {}
        for c in (c for chunk_list in self.chunks for c in chunk_list):
            for s, e, kind, wd in c.runs:
                self.groups.setdefault((kind, wd), _Group(kind, wd)).add(c, s, e)
        self._step = torch.zeros((), dtype=torch.float32, device=self.grad_device())  # the kernels read it
        self.overlap_param_gather = config.overlap_param_gather and self.distributed
        self._pending: dict[tuple[int, int], tuple] = {}  # (chunk, bucket) -> (work, local shard)
        if self.overlap_param_gather:
            self._register_param_gather_hooks()

    # ------------------------------------------------------------------------------------ gradients
    def owned_grads(self):
        return (c.grad for chunk_list in self.chunks for c in chunk_list)

    def moment_tensors(self):
        return (t for chunk_list in self.chunks for c in chunk_list for t in (c.exp_avg, c.exp_avg_sq))

    def norm_grads(self):
        return (c.grad[s:e] for chunk_list in self.chunks for c in chunk_list for s, e in c.norm)

    def norm_params(self):
        return (c.param[s:e] for chunk_list in self.chunks for c in chunk_list for s, e in c.norm)

    def grad_device(self) -> torch.device:
        return self.model_chunks[0].buffer.param_data.device

    # --------------------------------------------------------------------------------------- update
    @torch.no_grad()
    def step(self, lr: float | None = None, decoupled_lr: float | None = None, mup_lr: float | None = None) -> None:
        """One AdamW (or SGD) update at `lr`; the embedding / output parameters at `decoupled_lr` when given
        (AdamW only, as before: SGD updates them at `lr`); the MuP group at `mup_lr` (default: `lr` x the
        scheduler's multiplier for it, see group_lrs)."""
        lrs = group_lrs(self.config, self.lr if lr is None else lr, decoupled_lr, mup_lr)
        self.step_count += 1
        self._step.fill_(self.step_count)
        for g in self.groups.values():
            wd = self.weight_decay if g.decay else 0.0
            if self.kind == "sgd":
                self._sgd(g, lrs[g.kind], wd)
            else:
                b1, b2 = self.betas
                torch._fused_adamw_(g.params, g.fp32_grads(), g.exp_avgs, g.exp_avg_sqs, [],
                                    [self._step] * len(g.params), lr=lrs[g.kind], beta1=b1,
                                    beta2=b2, weight_decay=wd, eps=self.config.eps_of(g.kind), amsgrad=False,
                                    maximize=False)
        if self.distributed:
            self._all_gather_params()

    def _sgd(self, g: _Group, lr: float, wd: float) -> None:
        """torch.optim.SGD (dampening 0, no Nesterov): g' = g + wd * p; buf = m * buf + g' (buf = g' on the
        first step); p -= lr * buf. The momentum buffer lives in exp_avg."""
        bufs = g.exp_avgs if self.sgd_momentum else []
        torch._fused_sgd_(g.params, g.fp32_grads(), bufs, weight_decay=wd, momentum=self.sgd_momentum, lr=lr,
                          dampening=0.0, nesterov=False, maximize=False, is_first_step=self.step_count == 1)

    @staticmethod
    def _bucket_group(bucket):
        """The ranks that share a bucket's shards: expert DP for MoE expert buckets, DP x CP otherwise."""
        if bucket.expert:
            return ps.get_expert_data_parallel_group()
        return ps.get_data_parallel_group(with_context_parallel=True)

    def _all_gather_params(self) -> None:
        for ci, ddp in enumerate(self.model_chunks):
            for bi, bucket in enumerate(ddp.buffer.buckets):
                local = bucket.shard(bucket.param_data).clone()
                work = device_mod.all_gather_into_tensor(bucket.param_data, local, group=self._bucket_group(bucket),
                                                         async_op=True)
                self._pending[(ci, bi)] = (work, local)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before reading or saving parameters)."""
        for key in list(self._pending):
            self._wait_bucket(key)

    def _wait_bucket(self, key: tuple[int, int]) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending[0].wait()

    def _register_param_gather_hooks(self) -> None:
        """A forward pre-hook on every module that owns parameters: wait for their buckets' all-gathers."""
        for ci, ddp in enumerate(self.model_chunks):
            buf = ddp.buffer
            for module in ddp.module.modules():
                keys = set()
                for p in module.parameters(recurse=False):
                    if id(p) not in buf.offsets:
                        continue
                    s, e = buf.offsets[id(p)]
                    keys.update((ci, bi) for bi, b in enumerate(buf.buckets) if b.start < e and s < b.end)
                if keys:
                    module.register_forward_pre_hook(
                        lambda _m, _inp, keys=tuple(sorted(keys)): [self._wait_bucket(k) for k in keys] and None)

    # ----------------------------------------------------------------------------------- state I/O
    def _full_state(self, which: str) -> list[torch.Tensor]:
        """Per model chunk, the flat state over the whole buffer (gathered over DP when sharded)."""
        out = []
        for ddp, chunk_list in zip(self.model_chunks, self.chunks):
            full = torch.zeros_like(ddp.buffer.param_data)
            for c in chunk_list:
                full[c.lo:c.hi] = getattr(c, which)
            if self.distributed:
                gathered = torch.zeros_like(full)
                for bucket in ddp.buffer.buckets:
                    device_mod.all_gather_into_tensor(gathered[bucket.start:bucket.end],
                                                      bucket.shard(full[bucket.start:bucket.end]).clone(),
                                                      group=self._bucket_group(bucket))
                full = gathered
            out.append(full)
        return out

    state_dict_copies = True  # state_dict(copy=False) hands out views of freshly gathered buffers

    def state_dict(self, param_names: list[dict[int, str]], copy: bool = True) -> dict:
        """Adam state per parameter name (layout-free within this TP/PP rank; collective over DP).

        ``copy=False``: each parameter's state is a view of one freshly gathered flat buffer (still private
        to the caller) instead of its own copy; an asynchronous save stages no second copy."""
        exp_avg, exp_avg_sq = self._full_state("exp_avg"), self._full_state("exp_avg_sq")
        state = {}
        for ddp, names, ea, eas in zip(self.model_chunks, param_names, exp_avg, exp_avg_sq):
            for p in ddp.buffer.params:
                s, e = ddp.buffer.offsets[id(p)]
                ea_p, eas_p = ea[s:e].view_as(p), eas[s:e].view_as(p)
                state[names[id(p)]] = {"exp_avg": ea_p.clone() if copy else ea_p,
                                       "exp_avg_sq": eas_p.clone() if copy else eas_p}
        return {"step": self.step_count, "param_state": state,
                "hyper": {"betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay},
                **self.scaler_state()}

    def load_state_dict(self, state: dict, param_names: list[dict[int, str]]) -> None:
        self.step_count = state["step"]
        self.load_scaler_state(state)
        for ddp, names, chunk_list in zip(self.model_chunks, param_names, self.chunks):
            full_ea = torch.zeros_like(ddp.buffer.param_data)
            full_eas = torch.zeros_like(ddp.buffer.param_data)
            for p in ddp.buffer.params:
                name = names[id(p)]
                if name not in state["param_state"]:
                    raise KeyError(f"optimizer state for parameter {name!r} is missing from the checkpoint")
                s, e = ddp.buffer.offsets[id(p)]
                full_ea[s:e] = state["param_state"][name]["exp_avg"].reshape(-1)
                full_eas[s:e] = state["param_state"][name]["exp_avg_sq"].reshape(-1)
            for c in chunk_list:
                c.exp_avg.copy_(full_ea[c.lo:c.hi])
                c.exp_avg_sq.copy_(full_eas[c.lo:c.hi])


def build_optimizer(model_chunks: list[ModelChunk], config: OptimizerConfig) -> DistributedAdamW | FullyShardedAdamW:
    """The optimizer for the chunks' kind of data parallelism: over DDP's flat buffers, or FSDP2's shards."""
    if model_chunks[0].data_parallel_kind == "fsdp2":
        return FullyShardedAdamW(model_chunks, config)
    return DistributedAdamW(model_chunks, config)

"""Squinch: 6-bit compressed reduction of data-parallel gradient buckets.

Reduce-scatter (with the distributed optimizer)::

    g /= DP; payload = encode(g + e) (e: error feedback, per bucket); all_to_all(payload chunks)
    shard = sum_w decode(chunk from rank w)           # fp32, in the shard owner, in rank order

All-reduce (plain DP) continues with an owner-side re-encode (its own error feedback), an all-gather
of the payloads and a decode into the full bucket, so every replica ends with identical gradients.
Nothing is ever reduced in a ring over compressed data.

Hierarchical mode: an uncompressed reduce-scatter inside each node, the Squinch all-to-all across
nodes among ranks with the same local index (the inter-node group), and (all-reduce mode) the
compressed all-gather across nodes followed by an uncompressed all-gather inside the node.

Every row on the wire is ``[nonfinite flag byte | 6-bit payload]``: a rank whose input held NaN/Inf
sets the flag, and every receiver fills its result with NaN, so the global grad-norm check makes every
rank skip the step. Nothing non-finite is silently turned finite.
"""
from __future__ import annotations

import torch

from .. import device as device_mod
from .. import parallel_state as ps
from ..squinch import decode, decode_accumulate, encode_with_feedback
from .grad_buffer import Bucket
from .grad_reducer import GradReducer


class SquinchReducer(GradReducer):
    def __init__(self, dp_group, dp_size: int, *, error_feedback: bool = True, stochastic: bool = False,
                 hierarchical: bool = False, shard_only: bool = False, seed: int = 0,
                 backend: str | None = None) -> None:
        super().__init__(dp_group, dp_size)
        self.error_feedback, self.stochastic = error_feedback, stochastic
        self.shards = shard_only
        self.backend = backend
        self.residuals: dict[str, torch.Tensor] = {}
        self.generator: torch.Generator | None = None
        self._seed = seed
        self.hierarchical = hierarchical and dp_size > 1
        if self.hierarchical:
            self.local_size = ps.get_data_parallel_intra_node_world_size()
            self.num_nodes = ps.get_data_parallel_inter_node_world_size()
            if self.local_size * self.num_nodes != dp_size:
                raise ValueError(f"--squinch-hierarchical: {self.local_size} ranks per node x {self.num_nodes} "
                                 f"nodes does not make the data-parallel size {dp_size}")
            self.intra_group = ps.get_data_parallel_intra_node_group()
            self.inter_group = ps.get_data_parallel_inter_node_group()
        self.inter_node_bytes_sent = 0

    # ----------------------------------------------------------------------------------- helpers
    def _residual(self, key: str, numel: int, device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        r = self.residuals.get(key)
        if r is None or r.numel() != numel:
            r = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        return r

    def _gen(self, device) -> torch.Generator | None:
        if not self.stochastic:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self._seed)
        return self.generator

    def _encode_rows(self, x: torch.Tensor, rows: int, key: str) -> torch.Tensor:
        """Encode x (rows equal chunks) with error feedback into a [rows, 1 + nbytes] send buffer."""
        residual = self._residual(key, x.numel(), x.device)
        payload, nonfinite = encode_with_feedback(x, residual, stochastic=self.stochastic,
                                                  generator=self._gen(x.device), backend=self.backend)
        nb = payload.numel() // rows
        send = torch.empty(rows, 1 + nb, dtype=torch.uint8, device=x.device)
        send[:, 1:] = payload.view(rows, nb)
        send[:, 0] = nonfinite.to(torch.uint8)
        if residual is not None and bool(nonfinite):
            residual.zero_()  # the step will be skipped everywhere; drop this bucket's feedback
        return send

    @staticmethod
    def _decode_sum_into(recv: torch.Tensor, out: torch.Tensor, backend) -> None:
        """out = sum over rows of decode(row) (rank order), or NaN if any sender flagged non-finite."""
        target = out if out.dtype == torch.float32 else torch.empty(out.numel(), dtype=torch.float32,
                                                                     device=out.device)
        target.zero_()
        decode_accumulate(recv[:, 1:], target, backend=backend)
        if bool(recv[:, 0].any()):
            target.fill_(float("nan"))
        if target is not out:
            out.copy_(target)

    def _count(self, nbytes: int, inter: bool) -> None:
        self.bytes_sent += nbytes
        if inter:
            self.inter_node_bytes_sent += nbytes

    # ---------------------------------------------------------------------------- the collective
    def reduce(self, bucket: Bucket):
        n = self.dp_size
        if n == 1:
            return _Handle(None)
        g = bucket.grad_data
        g.mul_(1.0 / n)
        if self.hierarchical:
            return self._reduce_hierarchical(bucket)
        send = self._encode_rows(g, n, f"b{bucket.index}")
        recv = torch.empty_like(send)
        work = device_mod.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._count(send.numel() * (n - 1) // n, inter=True)
        return _Handle(work, lambda: self._finish_flat(bucket, recv))

    def _finish_flat(self, bucket: Bucket, recv: torch.Tensor) -> None:
        shard = bucket.shard(bucket.grad_data)
        self._decode_sum_into(recv, shard, self.backend)
        if not self.shards:
            self._all_gather_compressed(bucket.grad_data, shard, self.group, self.dp_size,
                                        f"o{bucket.index}", inter=True)

    def _all_gather_compressed(self, full: torch.Tensor, shard: torch.Tensor, group, size: int, key: str,
                               inter: bool) -> None:
        """Owner re-encodes its reduced shard (own error feedback); all ranks decode every shard."""
        send = self._encode_rows(shard, 1, key)
        recv = torch.empty(size, send.numel(), dtype=torch.uint8, device=shard.device)
        device_mod.all_gather_into_tensor(recv, send.view(-1), group=group)
        self._count(send.numel() * (size - 1), inter=inter)
        chunk = shard.numel()
        nonfinite = bool(recv[:, 0].any())
        fp32 = full.dtype == torch.float32
        for r in range(size):
            dst = full[r * chunk:(r + 1) * chunk]
            if fp32:
                decode(recv[r, 1:], chunk, out=dst, backend=self.backend)
            else:
                dst.copy_(decode(recv[r, 1:], chunk, backend=self.backend))
        if nonfinite:
            full.fill_(float("nan"))

    # ------------------------------------------------------------------------------ hierarchical
    def _reduce_hierarchical(self, bucket: Bucket):
        L, M = self.local_size, self.num_nodes
        g = bucket.grad_data
        c = bucket.shard_size
        # Order the DP chunks so that local rank l's slice holds chunks {m * L + l : m}: after the
        # cross-node all-to-all, node m's rank l then owns chunk m * L + l, its DP shard.
        permuted = g.view(M, L, c).transpose(0, 1).contiguous().view(-1)
        node_slice = torch.empty(M * c, dtype=g.dtype, device=g.device)
        device_mod.reduce_scatter_tensor(node_slice, permuted, group=self.intra_group)
        self._count((L - 1) * node_slice.numel() * g.element_size(), inter=False)
        if M == 1:
            return _Handle(None, lambda: self._finish_hier_single_node(bucket, node_slice))
        send = self._encode_rows(node_slice, M, f"b{bucket.index}")
        recv = torch.empty_like(send)
        work = device_mod.all_to_all_single(recv, send, group=self.inter_group, async_op=True)
        self._count(send.numel() * (M - 1) // M, inter=True)
        return _Handle(work, lambda: self._finish_hier(bucket, recv))

    def _finish_hier_single_node(self, bucket: Bucket, node_slice: torch.Tensor) -> None:
        bucket.shard(bucket.grad_data).copy_(node_slice)
        if not self.shards:
            self._intra_all_gather(bucket)

    def _finish_hier(self, bucket: Bucket, recv: torch.Tensor) -> None:
        shard = bucket.shard(bucket.grad_data)
        self._decode_sum_into(recv, shard, self.backend)
        if self.shards:
            return
        L, M, c = self.local_size, self.num_nodes, bucket.shard_size
        # Across nodes: compressed all-gather of the M shards of this local rank's slice.
        local_rank = ps.get_data_parallel_rank() % L
        slice_buf = torch.empty(M * c, dtype=bucket.grad_data.dtype, device=shard.device)
        self._all_gather_compressed(slice_buf, shard, self.inter_group, M, f"o{bucket.index}", inter=True)
        full = bucket.grad_data.view(M, L, c)
        full[:, local_rank, :] = slice_buf.view(M, c)
        self._intra_all_gather(bucket)

    def _intra_all_gather(self, bucket: Bucket) -> None:
        """Inside the node, uncompressed: every local rank contributes its M chunks."""
        L, M, c = self.local_size, self.num_nodes, bucket.shard_size
        local_rank = ps.get_data_parallel_rank() % L
        g = bucket.grad_data.view(M, L, c)
        mine = g[:, local_rank, :].contiguous().view(-1)
        gathered = torch.empty(L, M * c, dtype=g.dtype, device=g.device)
        device_mod.all_gather_into_tensor(gathered, mine, group=self.intra_group)
        self._count((L - 1) * mine.numel() * g.element_size(), inter=False)
        g.copy_(gathered.view(L, M, c).transpose(0, 1))

    # ------------------------------------------------------------------------------------ state
    def step_skipped(self) -> None:
        """A skipped step discards its gradients, including what error feedback carried."""
        for r in self.residuals.values():
            r.zero_()

    def state_dict(self) -> dict:
        state = {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.get("residuals", {}).items():
            if k in self.residuals and self.residuals[k].numel() == v.numel():
                self.residuals[k].copy_(v)
            else:
                self.residuals[k] = v.clone().to(self._device_hint())
        if "generator" in state:
            self._gen(self._device_hint())
            self.generator.set_state(state["generator"])

    def _device_hint(self):
        for v in self.residuals.values():
            return v.device
        return torch.device("cpu")


class _Handle:
    def __init__(self, work, finish=None) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


"""Squinch: 6-bit compressed reduction of data-parallel gradient buckets.

Reduce-scatter (with the distributed optimizer)::

    g /= DP; payload = encode(g + e) (e: error feedback, per bucket); all_to_all(payload chunks)
    shard = sum_w decode(chunk from rank w)           # fp32, in the shard owner, in rank order

All-reduce (plain DP) continues with an owner-side re-encode (its own error feedback), an all-gather
of the payloads and a decode into the full bucket, so every replica ends with identical gradients.
Nothing is ever reduced in a ring over compressed data. The codec steps (per-row encode with the flag
byte, decode-accumulate, the all-gather decode) are ``squinch_collectives``' functions, the ones FSDP2's
reduce-scatter hooks call; this class adds the buckets, the asynchronous staging, the persistent
buffers, the phase timers and the per-bucket error feedback (``SquinchFeedback``: residuals ``b<i>`` and
``o<i>`` for the owner, the stochastic-rounding generator).

Hierarchical mode: an uncompressed reduce-scatter inside each node, the Squinch all-to-all across
nodes among ranks with the same local index (the inter-node group), and (all-reduce mode) the
compressed all-gather across nodes followed by an uncompressed all-gather inside the node.

Overlap. A bucket's reduction is a chain of stages, each an asynchronous collective and what to do
when it completes: [intra-node reduce-scatter ->] encode + all-to-all -> decode-accumulate (+ owner
re-encode + all-gather) -> decode [+ intra-node all-gather]. ``progress()`` runs whenever a bucket is
handed over (during backward with --overlap-grad-reduce) and starts the next stage of every bucket
whose collective has completed, so the second phase of a bucket overlaps the rest of backward instead
of waiting for ``wait()``. The all-gathers run on a duplicate process group of the one the
all-to-alls use (and the intra-node all-gather on a duplicate of the intra-node group), and a bucket
takes a stage only after every bucket handed over before it took it: every group sees its operations
in the same order on every rank, whatever completes first where.

Non-finite gradients. Every row on the wire is ``[6-bit payload | nonfinite flag byte | zero padding]``.
The flag is computed on the device (the OR over the sender's rows) and never read by the host here: a
receiver fills its result with NaN on the device (in the decode kernel on Triton) when any sender flagged.
The decision is taken once per step by the global grad-norm check (which synchronises anyway): a NaN
norm makes every rank skip the step and call :meth:`SquinchReducer.step_skipped`, which drops all error
feedback (the residual of a flagged bucket holds NaN/Inf). No per-bucket host synchronisation.

Stream discipline (accelerators; on CPU everything runs on the host and gloo's own threads):

* Backward produces and accumulates the gradients on the *compute* stream (the current stream when a
  bucket becomes ready). ``reduce()`` makes the reducer's *communication* stream wait for the compute
  stream (``wait_stream``, an event recorded after the bucket's last accumulation), so a gradient is
  never read before it is accumulated.
* On the communication stream: the 1/DP scaling, the encode (straight into the persistent send
  buffer), the collectives (NCCL orders its internal stream after the issuing stream), ``work.wait()``
  (makes the communication stream wait for NCCL), the decode-accumulate (straight from the persistent
  receive buffer), the owner re-encode, the all-gather and the final decode.
* At the end of ``wait()`` the compute stream waits for the communication stream, so the grad-norm,
  the optimizer and the next iteration's ``zero_grad`` see finished gradients, and the next step's
  encode (on the communication stream, after this wait) never overwrites a send buffer still in flight.
* Buffers: the compressed send/receive buffers (and the fp32 accumulator for bf16 gradients) are
  allocated once on the communication stream and reused every step. Full-bucket temporaries of the
  hierarchical mode are allocated on the communication stream and kept alive by the handle until its
  ``wait()``. The gradient bucket, allocated on the compute stream and written on the communication
  stream, is marked with ``record_stream`` once, so freeing the model while a reduction is in flight
  cannot hand its memory to someone else.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from .. import device as device_mod
from .. import parallel_state as ps
from .comm_timing import PhaseTimers
from .grad_buffer import Bucket
from .squinch_collectives import decode_rows_into, decode_sum_into, encode_rows, row_nbytes
from .squinch_feedback import FeedbackReducer, SquinchFeedback

_NULL = contextlib.nullcontext()
_INF = float("inf")
_SECOND_GROUPS: dict[tuple, object] = {}  # (world, ranks) -> duplicate process group for the all-gathers


class SquinchReducer(FeedbackReducer):
    """The Squinch ``contracts.BucketReducer`` (see the module docstring)."""

    def __init__(self, dp_group, dp_size: int, *, error_feedback: bool = True, stochastic: bool = False,
                 hierarchical: bool = False, shard_only: bool = False, seed: int = 0,
                 backend: str | None = None, timing_level: int = 0, device: torch.device | None = None) -> None:
        self.group, self.dp_size = dp_group, dp_size
        self.bytes_sent = self.inter_node_bytes_sent = 0
        self.shards = shard_only
        self.backend = backend
        self.feedback = SquinchFeedback(error_feedback=error_feedback, stochastic=stochastic, seed=seed)
        self.device: torch.device | None = None
        self.timers = PhaseTimers(timing_level)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._comm_stream = None
        self._recorded: set[int] = set()
        self._fifo: list[_Handle] = []  # buckets handed over and not yet complete, in hand-over order
        self._gather_group = self._intra_gather_group = None
        # MEGATRON_CAI_SQUINCH_EARLY_STAGES=0 leaves every later stage to wait() (the bench's "before")
        self.early_stages = os.environ.get("MEGATRON_CAI_SQUINCH_EARLY_STAGES", "1") != "0"
        self.hierarchical = hierarchical and dp_size > 1
        if self.hierarchical:
            self.local_size = ps.get_data_parallel_intra_node_world_size()
            self.num_nodes = ps.get_data_parallel_inter_node_world_size()
            if self.local_size * self.num_nodes != dp_size:
                raise ValueError(f"--squinch-hierarchical: {self.local_size} ranks per node x {self.num_nodes} "
                                 f"nodes does not make the data-parallel size {dp_size}")
            self.intra_group = ps.get_data_parallel_intra_node_group()
            self.inter_group = ps.get_data_parallel_inter_node_group()
        if device is not None:
            self.attach(device)

    def attach(self, device: torch.device | str) -> None:
        """Bind the reducer to the device of the gradient buckets (DistributedDataParallel calls this):
        the error-feedback state lives there (``SquinchFeedback``'s device rule). On an accelerator the
        reducer gets its own communication stream (see the module docstring)."""
        self.device = torch.device(device)
        self.timers.device = self.device
        super().attach(self.device)
        if self.device.type not in ("cpu", "meta") and self.dp_size > 1:
            self._comm_stream = torch.Stream(self.device)

    # ----------------------------------------------------------------------------------- helpers
    def _buf(self, name: tuple, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer kept across steps (allocated on the communication stream when there is one)."""
        b = self._buffers.get(name)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device:
            b = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def _stream(self):
        return self._comm_stream if self._comm_stream is not None else _NULL

    def _encode_rows(self, x: torch.Tensor, rows: int, key: str) -> torch.Tensor:
        """``squinch_collectives.encode_rows`` with this key's residual, into its persistent send buffer."""
        fb = self.feedback
        send = self._buf(("send", key), (rows, row_nbytes(x.numel() // rows)), torch.uint8, x.device)
        return encode_rows(x, rows, fb.residual(key, x.numel(), x.device), out=send, stochastic=fb.stochastic,
                           generator=fb.generator(x.device), backend=self.backend)

    def _decode_sum_into(self, recv: torch.Tensor, out: torch.Tensor, key: str) -> None:
        """``squinch_collectives.decode_sum_into``, with a persistent fp32 accumulator for bf16 buckets."""
        scratch = None if out.dtype == torch.float32 else self._buf(("fp32", key), (out.numel(),), torch.float32,
                                                                     out.device)
        decode_sum_into(recv, out, scratch=scratch, backend=self.backend)

    def _count(self, nbytes: int, inter: bool) -> None:
        self.bytes_sent += nbytes
        if inter:
            self.inter_node_bytes_sent += nbytes

    # ------------------------------------------------------------------------------- scheduling
    def _second_group(self, group):
        """A duplicate of `group` for the operations that progress() may start early (the all-gathers):
        each group then sees its operations in the same order on every rank. Keyed by the group itself, not
        its ranks: two reducers over different groups of the same ranks (MoE's dense and expert-DP groups)
        must not share a duplicate, whose operations they would start in an order that differs by rank."""
        if group is None or not dist.is_initialized():
            return group
        ranks = tuple(dist.get_process_group_ranks(group))
        key = (id(dist.group.WORLD), ranks, group.group_name)
        if key not in _SECOND_GROUPS:
            _SECOND_GROUPS[key] = ps.new_group(list(ranks), use_local_synchronization=True)
        return _SECOND_GROUPS[key]

    def _groups(self) -> None:
        if self._gather_group is None:
            if self.hierarchical:
                self._gather_group = self._second_group(self.inter_group)
                self._intra_gather_group = self._second_group(self.intra_group)
            else:
                self._gather_group = self._second_group(self.group)

    def progress(self) -> None:
        """Start the next stage of every bucket whose collective has completed, without blocking.

        Called whenever a bucket is handed over (from backward with --overlap-grad-reduce), so the
        decode-accumulate, the owner re-encode and the all-gather of a bucket start as soon as its
        all-to-all is done, not in wait(). A bucket takes stage t -> t + 1 only after every earlier
        bucket did, so each process group sees its operations in the same order on every rank."""
        floor = _INF
        for h in self._fifo:
            while not h.done and h.stage < floor and _completed(h.work):
                h.advance()
            if not h.done:
                floor = min(floor, h.stage)
        self._fifo = [h for h in self._fifo if not h.done]

    def _drive(self, target: _Handle) -> None:
        """Block until `target` is complete, completing every earlier bucket first (FIFO)."""
        for h in self._fifo:
            while not h.done:
                h.advance()
            if h is target:
                break
        self._fifo = [h for h in self._fifo if not h.done]

    def _start(self, bucket: Bucket, work, phase: str | None, then) -> _Handle:
        h = _Handle(self, bucket, work, phase, then)
        self._fifo.append(h)
        return h

    # ---------------------------------------------------------------------------- the collective
    def reduce(self, bucket: Bucket):
        n = self.dp_size
        if n == 1:
            return _Handle(self, bucket, None, None, None, done=True)
        self._groups()
        if self.early_stages:
            self.progress()
        stream = self._comm_stream
        if stream is not None:  # the bucket's gradients were accumulated on the compute stream
            stream.wait_stream(torch.accelerator.current_stream(self.device))
            if bucket.index not in self._recorded:
                bucket.grad_data.record_stream(stream)
                self._recorded.add(bucket.index)
        with self._stream():
            bucket.grad_data.mul_(1.0 / n)
            if self.hierarchical:
                return self._reduce_hierarchical(bucket)
            work, recv = self._encode_all_to_all(bucket, bucket.grad_data, n, self.group)
            return self._start(bucket, work, "all-to-all", lambda: self._after_all_to_all(bucket, recv))

    def _encode_all_to_all(self, bucket: Bucket, x: torch.Tensor, rows: int, group):
        t, b = self.timers, bucket.index
        with t.phase(b, "encode"):
            send = self._encode_rows(x, rows, f"b{b}")
        recv = self._buf(("recv", f"b{b}"), tuple(send.shape), torch.uint8, send.device)
        with t.phase(b, "all-to-all"):
            work = device_mod.all_to_all_single(recv, send, group=group, async_op=True)
        self._count(send.numel() * (rows - 1) // rows, inter=True)
        return work, recv

    def _after_all_to_all(self, bucket: Bucket, recv: torch.Tensor):
        """Decode-accumulate this rank's shard; in all-reduce mode start the compressed all-gather."""
        shard = bucket.shard(bucket.grad_data)
        with self.timers.phase(bucket.index, "decode-accumulate"):
            self._decode_sum_into(recv, shard, f"b{bucket.index}")
        if self.shards:
            return None
        if not self.hierarchical:
            work, gathered = self._start_all_gather(bucket, shard, self._gather_group, self.dp_size)
            return work, "all-gather", lambda: self._decode_gathered(bucket, bucket.grad_data, gathered)
        slice_buf = torch.empty(self.num_nodes * bucket.shard_size, dtype=bucket.grad_data.dtype,
                                device=shard.device)
        work, gathered = self._start_all_gather(bucket, shard, self._gather_group, self.num_nodes)
        return work, "all-gather", lambda: self._finish_hier(bucket, gathered, slice_buf)

    def _start_all_gather(self, bucket: Bucket, shard: torch.Tensor, group, size: int):
        """Owner re-encodes its reduced shard (own error feedback) and starts the all-gather."""
        t, key = self.timers, f"o{bucket.index}"
        with t.phase(bucket.index, "owner re-encode"):
            send = self._encode_rows(shard, 1, key)
        recv = self._buf(("gather", key), (size, send.numel()), torch.uint8, shard.device)
        with t.phase(bucket.index, "all-gather"):
            work = _all_gather_async(recv, send, group)
        self._count(send.numel() * (size - 1), inter=True)
        return work, recv

    def _decode_gathered(self, bucket: Bucket, full: torch.Tensor, recv: torch.Tensor) -> None:
        """All ranks decode every owner's payload into `full` (NaN if any owner flagged)."""
        with self.timers.phase(bucket.index, "decode"):
            decode_rows_into(recv, full, backend=self.backend)
        return None

    # ------------------------------------------------------------------------------ hierarchical
    def _reduce_hierarchical(self, bucket: Bucket):
        L, M = self.local_size, self.num_nodes
        g, b, t = bucket.grad_data, bucket.index, self.timers
        c = bucket.shard_size
        with t.phase(b, "intra reduce-scatter"):
            # Order the DP chunks so that local rank l's slice holds chunks {m * L + l : m}: after the
            # cross-node all-to-all, node m's rank l then owns chunk m * L + l, its DP shard.
            permuted = g.view(M, L, c).transpose(0, 1).contiguous().view(-1)
            node_slice = torch.empty(M * c, dtype=g.dtype, device=g.device)
            work = device_mod.reduce_scatter_tensor(node_slice, permuted, group=self.intra_group, async_op=True)
        self._count((L - 1) * node_slice.numel() * g.element_size(), inter=False)

        def after_reduce_scatter(permuted=permuted):  # keeps the scattered buffer alive until done
            if M == 1:
                return self._finish_hier_single_node(bucket, node_slice)
            work2, recv = self._encode_all_to_all(bucket, node_slice, M, self.inter_group)
            return work2, "all-to-all", lambda: self._after_all_to_all(bucket, recv)

        return self._start(bucket, work, "intra reduce-scatter", after_reduce_scatter)

    def _finish_hier_single_node(self, bucket: Bucket, node_slice: torch.Tensor):
        bucket.shard(bucket.grad_data).copy_(node_slice)
        return None if self.shards else self._start_intra_all_gather(bucket)

    def _finish_hier(self, bucket: Bucket, gathered: torch.Tensor, slice_buf: torch.Tensor):
        """Decode the M shards of this local rank's slice, then start the intra-node all-gather."""
        self._decode_gathered(bucket, slice_buf, gathered)
        L, M, c = self.local_size, self.num_nodes, bucket.shard_size
        local_rank = ps.get_data_parallel_rank(with_context_parallel=True) % L
        bucket.grad_data.view(M, L, c)[:, local_rank, :] = slice_buf.view(M, c)
        return self._start_intra_all_gather(bucket)

    def _start_intra_all_gather(self, bucket: Bucket):
        """Inside the node, uncompressed: every local rank contributes its M chunks (asynchronous)."""
        L, M, c = self.local_size, self.num_nodes, bucket.shard_size
        local_rank = ps.get_data_parallel_rank(with_context_parallel=True) % L
        g = bucket.grad_data.view(M, L, c)
        with self.timers.phase(bucket.index, "intra all-gather"):
            mine = g[:, local_rank, :].contiguous().view(-1)
            gathered = torch.empty(L, M * c, dtype=g.dtype, device=g.device)
            work = _all_gather_async(gathered, mine, self._intra_gather_group)
        self._count((L - 1) * mine.numel() * g.element_size(), inter=False)

        def place(mine=mine):  # keeps the sent buffer alive until the gather is done
            g.copy_(gathered.view(L, M, c).transpose(0, 1))
            return None

        return work, "intra all-gather", place


def _all_gather_async(out: torch.Tensor, inp: torch.Tensor, group):
    """Asynchronous all-gather of `inp` into the rows of `out` ([world, numel]). gloo has no
    all_gather_into_tensor (core.device falls back to a blocking one), so it gets the list form."""
    if dist.get_backend(group) == "gloo":
        return dist.all_gather(list(out.unbind(0)), inp.reshape(-1), group=group, async_op=True)
    return dist.all_gather_into_tensor(out.view(-1), inp.reshape(-1), group=group, async_op=True)


def _completed(work) -> bool:
    """Whether an asynchronous collective has finished (without waiting for it)."""
    if work is None:
        return True
    inner = getattr(work, "work", work)  # core.device's gloo reduce-scatter wraps the all-to-all's work
    return inner is None or inner.is_completed()


class _Handle:
    """One bucket's reduction as a chain of stages: (asynchronous collective in flight, what to do when
    it completes). ``advance()`` waits for the current collective and runs the next stage on the
    communication stream; ``wait()`` completes the bucket (and every bucket handed over before it),
    then makes the compute stream wait for the communication stream."""

    def __init__(self, reducer: SquinchReducer, bucket: Bucket, work, phase: str | None, then,
                 done: bool = False) -> None:
        self.reducer, self.bucket, self.work, self.phase, self.then = reducer, bucket, work, phase, then
        self.stage, self.done = 0, done

    def advance(self) -> None:
        r = self.reducer
        with r._stream():
            if self.work is not None:
                with r.timers.phase(self.bucket.index, self.phase):
                    self.work.wait()
            nxt = self.then() if self.then is not None else None
        self.stage += 1
        if nxt is None:
            self.work, self.phase, self.then, self.done = None, None, None, True
        else:
            self.work, self.phase, self.then = nxt

    def wait(self) -> None:
        r = self.reducer
        if not self.done:
            r._drive(self)
        if r._comm_stream is not None:
            torch.accelerator.current_stream(r.device).wait_stream(r._comm_stream)

"""Step-time model of data-parallel gradient reduction: what this package's reducers do, stage by stage.

A step is compute (a backward timeline: when each gradient bucket becomes ready, when backward ends,
and what runs after the gradient sync) plus the reduction of every bucket. A bucket's reduction is the
chain of stages the reducer runs (see ``squinch_reducer``); each stage is some codec work on the
reducer's executor, then one collective on a link tier::

    fp32 / bf16 all-reduce:   [scale]                         -> all-reduce            -> done
    Squinch, flat:            [scale, encode(DP rows)]        -> all-to-all            ->
                              [decode-accumulate, re-encode]  -> all-gather (2nd group) -> [decode] done
    Squinch, hierarchical:    [scale, permute]                -> intra reduce-scatter  ->
                              [encode(nodes rows)]            -> inter all-to-all      ->
                              [decode-accumulate, re-encode]  -> inter all-gather      ->
                              [decode, copy]                  -> intra all-gather      -> [place] done

When stages start (``ReducerMode.stages``): "progress" is what ``SquinchReducer`` does: a bucket's next
stage starts at the first hand-over of a later bucket after its collective completed (``progress()``),
else in ``wait()``, and a bucket takes a stage only after every earlier bucket took it; "wait" leaves
every later stage to ``wait()`` (``MEGATRON_CAI_SQUINCH_EARLY_STAGES=0``, or a host that runs ahead of
the device); "chained" starts a stage the moment its collective completes (a device-side chain).

The executor (``CodecCost.on_host``): on CPU the reducer's work runs on the host thread, inside
backward, so it delays the rest of backward; on an accelerator it runs on the reducer's own stream,
concurrently with compute. Collectives occupy a link tier, first come first served: ``intra`` (inside
a node: NVLink, or the loopback of one namespace) and ``inter`` (between nodes: the NICs of a node, or
the shaped veth). The all-to-alls and all-gathers are on two process groups but share the link.

A collective over ``n`` ranks of which ``g`` share a node (``N = n / g`` nodes), ``S`` bytes per rank
(for an all-gather: ``S`` is each rank's contribution)::

    op              steps     bytes per rank      bytes per node across nodes
    all-reduce      2(n-1)    2(n-1)/n S          2(n-1)/n S          (ring; NCCL: one ring per NIC)
    reduce-scatter  n-1       (n-1)/n S           (n-1)/n S           (ring; gloo: as all-to-all)
    all-to-all      1         (n-1)/n S           g (N-1)/N S         (no pre-reduction inside a node)
    all-gather      n-1       (n-1) S             (n-1) S             (ring)

    time = steps x alpha + max(node bytes / beta_inter x (g / ranks_per_node), rank bytes / beta_intra)

(``ranks_per_node``: the data-parallel group's ranks per node; a hierarchical inter-node group has one
rank per node and shares the node's links with the other local ranks' groups.) Bandwidth figures are
per direction. Everything here is deterministic arithmetic; ``bench/squinch_phases.py`` measures the
inputs and ``bench/squinch_scale.py`` validates the predictions against real runs.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .squinch_collectives import row_nbytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "uint8": 1}
REDUCERS = ("fp32", "bf16", "squinch")
STAGE_POLICIES = ("progress", "wait", "chained")


# ----------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class OpCost:
    """alpha-beta cost of a collective on one tier: ``alpha_s`` per algorithm step, ``bytes_per_s`` per
    direction; ``issue_s`` + ``issue_s_per_byte`` x the bytes a rank sends: executor time to start it
    (gloo: the host enqueues it, and its all-to-all's issue grows with the message: ~0.1 ms at 64 KiB,
    ~8 ms at 64 MiB over the veth; GPU: a launch);
    ``per_peer_s``: an all-to-all's extra latency per peer; ``cpu_s_per_byte``: host CPU time the
    transport spends per byte a rank sends (gloo over TCP: its threads and the kernel's network stack),
    which takes cores from compute when it overlaps backward (``CodecCost.on_host``)."""

    alpha_s: float
    bytes_per_s: float
    issue_s: float = 0.0
    per_peer_s: float = 0.0
    cpu_s_per_byte: float = 0.0
    issue_s_per_byte: float = 0.0


@dataclass(frozen=True)
class Tier:
    """One kind of link. ``ops`` overrides ``default`` per collective: key ``"<op>_<dtype>"`` (e.g.
    ``"allreduce_bf16"``, its reduction's arithmetic included) or ``"<op>"`` (e.g. ``"all_to_all"``).

    ``burst_bytes`` / ``refill_bytes_per_s``: a token-bucket shaper (``tc tbf``): after an idle period
    up to ``burst_bytes`` pass at once, refilled at the shaped rate; 0 for an unshaped link."""

    default: OpCost
    ops: Mapping[str, OpCost] = field(default_factory=dict)
    burst_bytes: float = 0.0
    refill_bytes_per_s: float = 0.0

    def cost(self, op: str, dtype: str) -> OpCost:
        return self.ops.get(f"{op}_{dtype}") or self.ops.get(op) or self.default


@dataclass(frozen=True)
class Topology:
    """The data-parallel group: ``dp`` ranks, ``ranks_per_node`` of them in each node.

    ``inter``: the node's links across nodes as available to this group (a node with several
    data-parallel groups, one per TP x PP position, shares them: give each its share);
    ``reduce_scatter``: "ring" (NCCL) or "all_to_all" (gloo through core.device);
    ``tree_latency``: NCCL picks a tree when cheaper, so an all-reduce pays min(2(n-1), 2 log2 n) steps."""

    dp: int
    ranks_per_node: int
    intra: Tier
    inter: Tier
    reduce_scatter: str = "ring"
    tree_latency: bool = False

    def __post_init__(self) -> None:
        if self.dp % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide DP = {self.dp}")

    @property
    def nodes(self) -> int:
        return self.dp // self.ranks_per_node


@dataclass(frozen=True)
class CodecCost:
    """Squinch codec and memory work on the reducer's executor.

    Rates are elements per second: encode (with error feedback, per input element), decode-accumulate
    (per decoded element: rows x shard), decode (per decoded element); ``memory_bytes_per_s`` for the
    1/DP scaling and copies (read + write counted). ``launch_s``: per kernel launch (GPU) or per
    Python-level call (CPU); ``per_rank_launches``: the codec loops over the DP rows of a bucket (today),
    else one launch per bucket per codec step. ``on_host``: the executor is the host thread (CPU);
    ``launch_overlaps_work``: launches pipeline with the kernels (GPU: max of the two, CPU: sum)."""

    encode_elems_per_s: float
    decode_accumulate_elems_per_s: float
    decode_elems_per_s: float
    memory_bytes_per_s: float
    launch_s: float
    per_rank_launches: bool = True
    on_host: bool = True
    launch_overlaps_work: bool = False

    @classmethod
    def memory_bound(cls, bytes_per_s: float, launch_s: float, per_rank_launches: bool = True) -> CodecCost:
        """A GPU codec costed by its memory traffic at ``bytes_per_s`` (projected, not measured):
        encode 12.75 B/element (read gradient and residual, write residual: 3 x 4 B; payload 0.75 B),
        decode-accumulate and decode 4.75 B/element (payload 0.75 B, fp32 result 4 B)."""
        return cls(encode_elems_per_s=bytes_per_s / ENCODE_TRAFFIC,
                   decode_accumulate_elems_per_s=bytes_per_s / DECODE_TRAFFIC,
                   decode_elems_per_s=bytes_per_s / DECODE_TRAFFIC, memory_bytes_per_s=bytes_per_s,
                   launch_s=launch_s, per_rank_launches=per_rank_launches, on_host=False, launch_overlaps_work=True)


ENCODE_TRAFFIC = 12.75
DECODE_TRAFFIC = 4.75


@dataclass(frozen=True)
class ReducerMode:
    """The reducer: ``reducer`` one of REDUCERS ("fp32"/"bf16": plain all-reduce of that dtype;
    "squinch": fp32 buckets through Squinch); ``hierarchical`` (Squinch); ``overlap``
    (--overlap-grad-reduce: buckets handed over in backward); ``shard_only`` (distributed optimizer:
    reduce-scatter semantics); ``stages``: one of STAGE_POLICIES."""

    reducer: str
    hierarchical: bool = False
    overlap: bool = True
    shard_only: bool = False
    stages: str = "progress"

    def __post_init__(self) -> None:
        if self.reducer not in REDUCERS:
            raise ValueError(f"reducer {self.reducer!r} is not one of {REDUCERS}")
        if self.stages not in STAGE_POLICIES:
            raise ValueError(f"stages {self.stages!r} is not one of {STAGE_POLICIES}")
        if self.hierarchical and self.reducer != "squinch":
            raise ValueError("hierarchical mode is Squinch's")

    @property
    def grad_dtype(self) -> str:
        return "bf16" if self.reducer == "bf16" else "fp32"


@dataclass(frozen=True)
class BackwardTimeline:
    """Compute of one step, on a compute-only clock from the step's start (seconds).

    ``bucket_elems`` / ``ready_s``: the buckets in hand-over order and when each becomes ready with
    --overlap-grad-reduce; ``backward_end_s``: the end of the last backward; ``after_sync_s``: from the
    end of the gradient sync to the end of the step (gradient norm, optimizer, small collectives)."""

    bucket_elems: tuple[int, ...]
    ready_s: tuple[float, ...]
    backward_end_s: float
    after_sync_s: float

    def __post_init__(self) -> None:
        if len(self.bucket_elems) != len(self.ready_s) or not self.bucket_elems:
            raise ValueError("a timeline needs one ready time per bucket, and at least one bucket")
        if any(b > a for a, b in zip(self.ready_s[1:], self.ready_s)) or self.ready_s[-1] > self.backward_end_s:
            raise ValueError("bucket ready times must be non-decreasing and no later than the end of backward")

    @property
    def compute_s(self) -> float:
        return self.backward_end_s + self.after_sync_s

    def single_bucket(self) -> BackwardTimeline:
        """Without overlap the buffer is one bucket, handed over when backward ends."""
        return replace(self, bucket_elems=(sum(self.bucket_elems),), ready_s=(self.backward_end_s,))

    @classmethod
    def uniform(cls, elems: int, bucket_elems: int, forward_s: float, backward_s: float, after_sync_s: float,
                microbatches: int = 1) -> BackwardTimeline:
        """Synthetic: ``microbatches`` forward+backward pairs; buckets of ``bucket_elems`` (the last one
        smaller) become ready during the last backward, each when the backward has produced its share."""
        sizes, left = [], elems
        while left > 0:
            sizes.append(min(bucket_elems, left))
            left -= sizes[-1]
        start = (microbatches - 1) * (forward_s + backward_s) + forward_s
        cum, ready = 0, []
        for s in sizes:
            cum += s
            ready.append(start + backward_s * cum / elems)
        return cls(tuple(sizes), tuple(ready), start + backward_s, after_sync_s)


# ------------------------------------------------------------------------------------ collectives
@dataclass(frozen=True)
class Collective:
    """One collective as the model costs it; ``nbytes``: per rank (all-gather: each rank's part)."""

    op: str
    dtype: str
    nbytes: float
    ranks: int
    per_node: int  # of those ranks, how many share a node (1: one per node; == ranks: all in one node)


def wire_bytes(c: Collective) -> tuple[float, float]:
    """(bytes one rank sends, bytes one node of the group sends across nodes), per the table above."""
    n, g, S = c.ranks, c.per_node, c.nbytes
    nodes = n // g
    cross = nodes > 1
    if c.op == "allreduce":
        return 2 * (n - 1) / n * S, (2 * (n - 1) / n * S if cross else 0.0)
    if c.op in ("all_to_all", "reduce_scatter_a2a"):
        return (n - 1) / n * S, (g * (nodes - 1) / nodes * S if cross else 0.0)
    if c.op == "reduce_scatter":
        return (n - 1) / n * S, ((n - 1) / n * S if cross else 0.0)
    if c.op == "all_gather":
        return (n - 1) * S, ((n - 1) * S if cross else 0.0)
    raise ValueError(f"unknown collective {c.op!r}")


def _steps(op: str, n: int, tree: bool) -> int:
    if op == "allreduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n))) if tree and n > 2 else 2 * (n - 1)
    if op in ("all_to_all", "reduce_scatter_a2a"):
        return 1
    return n - 1


def collective_time(topo: Topology, c: Collective, tokens: float = 0.0) -> tuple[str, float, float]:
    """(the tier it occupies, its duration in seconds, executor time to issue it); ``tokens``: bytes the
    inter-node shaper lets through at once (its bucket's fill when the collective starts)."""
    if c.ranks == 1:
        return "intra", 0.0, 0.0
    op = "reduce_scatter_a2a" if c.op == "reduce_scatter" and topo.reduce_scatter == "all_to_all" else c.op
    key = "reduce_scatter" if op == "reduce_scatter_a2a" else op
    rank_bytes, node_bytes = wire_bytes(replace(c, op=op))
    nodes = c.ranks // c.per_node
    tier_name = "inter" if nodes > 1 else "intra"
    main = (topo.inter if nodes > 1 else topo.intra).cost(key, c.dtype)
    t = _steps(op, c.ranks, topo.tree_latency) * main.alpha_s
    if op in ("all_to_all", "reduce_scatter_a2a"):
        t += (c.ranks - 1) * main.per_peer_s
    if nodes > 1:
        share = c.per_node / topo.ranks_per_node
        t_bw = max(0.0, node_bytes - tokens * share) / (main.bytes_per_s * share)
        if c.per_node > 1:  # the ring's hops inside a node, or the all-to-all's local peers
            intra = topo.intra.cost(key, c.dtype)
            ring = op in ("allreduce", "reduce_scatter", "all_gather")
            local = rank_bytes if ring else (c.per_node - 1) / c.ranks * c.nbytes
            t_bw = max(t_bw, local / intra.bytes_per_s)
    else:
        t_bw = rank_bytes / main.bytes_per_s
    return tier_name, t + t_bw, main.issue_s + main.issue_s_per_byte * rank_bytes


# -------------------------------------------------------------------------------------- the stages
@dataclass(frozen=True)
class Work:
    """Codec or memory work of a stage: ``kind`` in encode / decode_accumulate / decode (``elems``
    elements over ``rows`` rows) or memory (``elems`` bytes moved)."""

    kind: str
    elems: float
    rows: int = 1


@dataclass(frozen=True)
class Stage:
    work: tuple[Work, ...]
    collective: Collective | None
    name: str = ""


def launches(w: Work, codec: CodecCost) -> int:
    """Kernel launches (CPU: calls) of one piece of work, as squinch_collectives issues them: encode_rows
    and decode_rows_into loop over their rows (+2: the flag byte), decode_sum_into is 3, a copy 1."""
    if w.kind == "memory":
        return 1
    if w.kind == "decode_accumulate":
        return 3
    per_row = w.rows if codec.per_rank_launches else 1
    return per_row + (2 if w.rows > 1 else 1)


def work_time(w: Work, codec: CodecCost) -> float:
    rate = {"encode": codec.encode_elems_per_s, "decode_accumulate": codec.decode_accumulate_elems_per_s,
            "decode": codec.decode_elems_per_s, "memory": codec.memory_bytes_per_s}[w.kind]
    busy, launch = w.elems / rate, launches(w, codec) * codec.launch_s
    return max(busy, launch) if codec.launch_overlaps_work else busy + launch


def bucket_stages(elems: int, topo: Topology, mode: ReducerMode) -> list[Stage]:
    """The stages of one bucket of ``elems`` elements (padded as the grad buffer pads them)."""
    n, b = topo.dp, DTYPE_BYTES[mode.grad_dtype]
    scale = Work("memory", 2 * elems * b)
    if n == 1:
        return [Stage((), None, "none")]
    if mode.reducer != "squinch":
        op = "reduce_scatter" if mode.shard_only else "allreduce"
        done = Stage((Work("memory", 2 * elems // n * b),) if mode.shard_only else (), None, "done")
        return [Stage((scale,), Collective(op, mode.grad_dtype, elems * b, n, topo.ranks_per_node), op), done]
    c = elems // n  # the shard
    if not mode.hierarchical:
        stages = [Stage((scale, Work("encode", elems, n)),
                        Collective("all_to_all", "uint8", n * row_nbytes(c), n, topo.ranks_per_node), "all-to-all")]
        if mode.shard_only:
            return stages + [Stage((Work("decode_accumulate", n * c),), None, "done")]
        return stages + [
            Stage((Work("decode_accumulate", n * c), Work("encode", c, 1)),
                  Collective("all_gather", "uint8", row_nbytes(c), n, topo.ranks_per_node), "all-gather"),
            Stage((Work("decode", n * c, n),), None, "done")]
    L, M = topo.ranks_per_node, topo.nodes
    slice_elems = M * c
    stages = [Stage((scale, Work("memory", 2 * elems * b)),
                    Collective("reduce_scatter", mode.grad_dtype, elems * b, L, L), "intra reduce-scatter")]
    intra_gather = Collective("all_gather", mode.grad_dtype, slice_elems * b, L, L)
    if M == 1:
        if mode.shard_only:
            return stages + [Stage((Work("memory", 2 * c * b),), None, "done")]
        return stages + [Stage((Work("memory", 2 * c * b),), intra_gather, "intra all-gather"),
                         Stage((Work("memory", 2 * elems * b),), None, "done")]
    stages.append(Stage((Work("encode", slice_elems, M),),
                        Collective("all_to_all", "uint8", M * row_nbytes(c), M, 1), "all-to-all"))
    if mode.shard_only:
        return stages + [Stage((Work("decode_accumulate", M * c),), None, "done")]
    return stages + [
        Stage((Work("decode_accumulate", M * c), Work("encode", c, 1)),
              Collective("all_gather", "uint8", row_nbytes(c), M, 1), "all-gather"),
        Stage((Work("decode", M * c, M), Work("memory", 2 * slice_elems * b)), intra_gather, "intra all-gather"),
        Stage((Work("memory", 2 * elems * b),), None, "done")]


def padded(elems: int, dp: int) -> int:
    """A bucket's element count as the grad buffer pads it (a multiple of lcm(8 DP, 128))."""
    pad = math.lcm(8 * dp, 128)
    return -(-elems // pad) * pad


# ------------------------------------------------------------------------------------- simulation
@dataclass
class Prediction:
    """``step_s``: predicted step time; ``exposed_s``: its excess over compute alone (communication and
    codec work on the critical path); ``host_in_backward_s``: reducer work that delayed backward (CPU);
    ``rank_bytes`` / ``node_bytes``: per step, what one rank sends / what one node of the group sends
    across nodes; ``launches``: per step on the executor; ``events``: (bucket, stage, tier, start, end)."""

    step_s: float
    compute_s: float
    exposed_s: float
    host_in_backward_s: float
    rank_bytes: float
    node_bytes: float
    launches: int
    events: list[tuple[int, str, str, float, float]]


@dataclass
class _Flight:
    index: int
    stages: list[Stage]
    stage: int = 0
    finish: float = 0.0  # when the collective of the current stage completes

    @property
    def done(self) -> bool:
        return self.stage >= len(self.stages)


class _Sim:
    def __init__(self, topo: Topology, codec: CodecCost, mode: ReducerMode) -> None:
        self.topo, self.codec, self.mode = topo, codec, mode
        self.free = {"intra": 0.0, "inter": 0.0}
        self.tokens = topo.inter.burst_bytes  # the inter-node shaper's bucket at self.free["inter"]
        self.exe = 0.0  # the executor's clock: the host on CPU, the reducer's stream on an accelerator
        self.fifo: list[_Flight] = []
        self.events: list[tuple[int, str, str, float, float]] = []
        self.rank_bytes = self.node_bytes = 0.0
        self.launches = 0
        self.cpu: list[tuple[float, float, float]] = []  # (begin, end, transport CPU seconds) per collective

    def run_stage(self, f: _Flight, start: float) -> None:
        st = f.stages[f.stage]
        t = max(self.exe, start)
        for w in st.work:
            t += work_time(w, self.codec)
            self.launches += launches(w, self.codec)
        if st.collective is not None:
            c = st.collective
            a2a = c.op == "reduce_scatter" and self.topo.reduce_scatter == "all_to_all"
            rb, nb = wire_bytes(replace(c, op="reduce_scatter_a2a") if a2a else c)
            inter = self.topo.inter
            t += collective_time(self.topo, c)[2]
            begin = max(t, self.free["inter"]) if nb else t
            tokens = min(inter.burst_bytes, self.tokens + (begin - self.free["inter"]) * inter.refill_bytes_per_s)
            tier, dur, _ = collective_time(self.topo, c, tokens if nb else 0.0)
            begin = max(t, self.free[tier])
            f.finish = self.free[tier] = begin + dur
            if nb:
                self.tokens = max(0.0, tokens - nb * self.topo.ranks_per_node / c.per_node)
            tier_obj = self.topo.inter if tier == "inter" else self.topo.intra
            cpu = tier_obj.cost("reduce_scatter" if c.op == "reduce_scatter" else c.op, c.dtype).cpu_s_per_byte * rb
            if cpu:
                self.cpu.append((begin, f.finish, cpu))
            self.rank_bytes += rb
            self.node_bytes += nb * self.topo.ranks_per_node / c.per_node  # every local rank's group
            self.events.append((f.index, st.name, tier, begin, f.finish))
        self.exe = t
        f.stage += 1

    def transport_cpu(self, a: float, b: float) -> float:
        """Transport CPU seconds of the collectives in flight during [a, b] (spread over each one)."""
        out = 0.0
        for begin, end, cpu in self.cpu:
            overlap = min(b, end) - max(a, begin)
            if overlap > 0:
                out += cpu * overlap / max(end - begin, 1e-12)
        return out

    def pause_wire(self, since: float, stolen: float) -> None:
        """The transport took ``stolen`` s of CPU from backward after ``since``: with every core computing, its
        threads waited as long for one, so what is on the wire after ``since`` ends that much later."""
        if stolen <= 0:
            return

        def later(t: float) -> float:
            return t + stolen if t > since else t

        for f in self.fifo:
            if not f.done:
                f.finish = later(f.finish)
        self.free = {tier: later(free) for tier, free in self.free.items()}
        self.cpu = [(later(b), later(e), c) for b, e, c in self.cpu]
        self.events = [(i, n, t, later(b), later(e)) for i, n, t, b, e in self.events]

    def progress(self, poll: float | None) -> None:
        """SquinchReducer.progress(): later stages of buckets whose collective completed by the poll time
        (None: the executor's clock, which advances as stages run: the CPU host), in FIFO order."""
        floor = math.inf
        for f in self.fifo:
            while not f.done and f.stage < floor and f.finish <= (self.exe if poll is None else poll):
                self.run_stage(f, f.finish if self.mode.stages == "chained" else (self.exe if poll is None else poll))
            if not f.done:
                floor = min(floor, f.stage)
        self.fifo = [f for f in self.fifo if not f.done]

    def hand_over(self, index: int, elems: int, at: float) -> None:
        squinch = self.mode.reducer == "squinch"
        if squinch and self.mode.stages != "wait":
            self.progress(None if self.codec.on_host else at)
        f = _Flight(index, bucket_stages(elems, self.topo, self.mode))
        self.run_stage(f, at)
        self.fifo.append(f)

    def drive(self) -> None:
        """wait() of every bucket, in hand-over order: block on each collective, run the next stage."""
        for f in self.fifo:
            while not f.done:
                self.run_stage(f, f.finish)
        self.fifo = []


def predict(timeline: BackwardTimeline, topo: Topology, codec: CodecCost, mode: ReducerMode) -> Prediction:
    """The step time of ``mode`` on ``topo`` with compute ``timeline`` (see the module docstring)."""
    tl = timeline if mode.overlap else timeline.single_bucket()
    sim = _Sim(topo, codec, mode)
    delay = 0.0  # CPU: reducer work the host did inside backward, and the transport's CPU next to it
    for i, (elems, ready) in enumerate(zip(tl.bucket_elems, tl.ready_s)):
        at = ready + delay
        if codec.on_host:
            stolen = sim.transport_cpu(sim.exe, at)
            sim.pause_wire(sim.exe, stolen)
            delay, at = delay + stolen, at + stolen
            sim.exe = max(sim.exe, at)
        sim.hand_over(i, padded(elems, topo.dp), at)
        if codec.on_host and mode.overlap:
            delay = sim.exe - ready
    if codec.on_host and mode.overlap:
        stolen = sim.transport_cpu(sim.exe, tl.backward_end_s + delay)
        sim.pause_wire(sim.exe, stolen)
        delay += stolen
    backward_end = tl.backward_end_s + delay
    if codec.on_host:
        sim.exe = max(sim.exe, backward_end)
    sim.drive()
    sync_end = max(sim.exe, backward_end)
    step = sync_end + tl.after_sync_s
    return Prediction(step_s=step, compute_s=timeline.compute_s, exposed_s=step - timeline.compute_s,
                      host_in_backward_s=delay, rank_bytes=sim.rank_bytes, node_bytes=sim.node_bytes,
                      launches=sim.launches, events=sim.events)


def launches_per_bucket(elems: int, topo: Topology, codec: CodecCost, mode: ReducerMode) -> int:
    """Codec launches of one bucket's reduction (``codec.per_rank_launches`` decides the DP loop)."""
    return sum(launches(w, codec) for st in bucket_stages(padded(elems, topo.dp), topo, mode) for w in st.work)

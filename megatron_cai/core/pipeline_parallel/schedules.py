"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, and interleaved 1F1B.

Common contract (Megatron's)::

    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss, stats: dict[str, Tensor])      # only on the last stage

Each micro-batch's loss is divided by the number of micro-batches before backward. Model chunks are
``contracts.ModelChunk``s (the DDP or the FSDP2 wrapper); only the last micro-batch's backward lets
them start reducing gradients.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from .. import parallel_state as ps
from ..distributed.contracts import ModelChunk
from .p2p_communication import P2P


def forward_step(forward_step_func: Callable, data_iterator: Iterator, model: ModelChunk, input_tensor,
                 num_microbatches: int, losses: list[dict], forward_context=None) -> torch.Tensor:
    """Run one micro-batch through one model chunk; on the last stage turn its output into the loss."""
    model.module.set_input_tensor(input_tensor)
    with forward_context() if forward_context else contextlib.nullcontext():
        output, loss_func = forward_step_func(data_iterator, model)
    if model.module.post_process:
        loss, stats = loss_func(output)
        losses.append(stats)
        output = loss / num_microbatches
    return output


def backward_step(input_tensor, output_tensor, output_tensor_grad) -> torch.Tensor | None:
    """Backward through one chunk; returns the gradient w.r.t. its input (for the previous stage)."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def forward_backward_no_pipelining(forward_step_func, data_iterator, model: list[ModelChunk], num_microbatches: int,
                                   tensor_shape=None, dtype=torch.float32, forward_only: bool = False,
                                   forward_context=None) -> list[dict]:
    """Gradient accumulation over micro-batches on a single stage."""
    (chunk,) = model
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    losses: list[dict] = []
    for i in range(num_microbatches):
        chunk.set_is_last_microbatch(i == num_microbatches - 1)
        output = forward_step(forward_step_func, iterator, chunk, None, num_microbatches, losses, forward_context)
        if not forward_only:
            backward_step(None, output, None)
    return losses


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model: list[ModelChunk],
                                                     num_microbatches: int, tensor_shape=None,
                                                     dtype=torch.float32, forward_only: bool = False,
                                                     forward_context=None) -> list[dict]:
    """1F1B: warm-up forwards, then one forward / one backward, then cool-down backwards."""
    (chunk,) = model
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    p2p = P2P(tensor_shape, dtype, _device(chunk), requires_grad=not forward_only)
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    num_warmup = min(pp - rank - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup
    losses: list[dict] = []
    inputs, outputs = [], []
    backwards_done = 0

    def run_backward(inp, out, out_grad):
        nonlocal backwards_done
        chunk.set_is_last_microbatch(backwards_done == num_microbatches - 1)
        backwards_done += 1
        return backward_step(inp, out, out_grad)

    def fwd(inp):
        out = forward_step(forward_step_func, iterator, chunk, inp, num_microbatches, losses, forward_context)
        return out

    for _ in range(num_warmup):
        inp = None if first else p2p.recv_forward()
        out = fwd(inp)
        if not last:
            p2p.send_forward(out)
        if not forward_only:
            inputs.append(inp)
            outputs.append(out)
    inp = None
    if num_remaining > 0 and not first:
        inp = p2p.recv_forward()
    for i in range(num_remaining):
        last_iteration = i == num_remaining - 1
        out = fwd(inp)
        if forward_only:
            if not last:
                p2p.send_forward(out)
            if not last_iteration and not first:
                inp = p2p.recv_forward()
            continue
        out_grad = None
        if not last:
            _, out_grad = p2p.communicate(send_next=out, recv_next=True)
        inputs.append(inp)
        outputs.append(out)
        b_inp, b_out = inputs.pop(0), outputs.pop(0)
        in_grad = run_backward(b_inp, b_out, out_grad)
        if last_iteration:
            inp = None
            if not first:
                p2p.send_backward(in_grad)
        elif not first:
            inp, _ = p2p.communicate(send_prev=in_grad, recv_prev=True)
    if not forward_only:
        for _ in range(num_warmup):
            b_inp, b_out = inputs.pop(0), outputs.pop(0)
            out_grad = None if last else p2p.recv_backward()
            in_grad = run_backward(b_inp, b_out, out_grad)
            if not first:
                p2p.send_backward(in_grad)
    return losses


def schedule_table(num_microbatches: int, num_model_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """``(micro-batch, model chunk)`` of each virtual micro-batch, in forward order (megatron-core's
    ``get_schedule_table``): groups of ``group_size`` consecutive micro-batches run through every chunk before the
    next group starts; the last group takes what is left."""
    table = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        table += [(microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in group]
    return table


def interleaving_problem(num_microbatches: int, pp: int, group_size: int) -> str | None:
    """Why the interleaved schedule cannot run ``num_microbatches`` in groups of ``group_size`` over ``pp`` stages
    (megatron-core's two checks and texts); None when it can."""
    if not pp <= group_size <= num_microbatches:
        return (f"The number of contiguous micro-batches in a virtual pipeline stage should range in "
                f"[PP={pp} , M={num_microbatches}]")
    final_group = num_microbatches % group_size
    if 0 < final_group < pp:
        return ("The remainder of M (the total micro-batches) divided by N (number of contiguous micro-batches in a "
                "virtual pipeline stage) should be 0, or larger than or equal to the pipeline-parallel size, but it "
                f"is {final_group}. Otherwise, it introduces dependency bubbles in the pipeline and reduces "
                "throughput.")
    return None


def num_warmup_microbatches(num_microbatches: int, num_model_chunks: int, group_size: int, pp: int, rank: int,
                            forward_only: bool) -> int:
    """Forwards before the first backward on pipeline rank ``rank`` (megatron-core's ``get_pp_rank_microbatches``):
    ``(V - 1)`` groups on every rank, plus two per later stage."""
    total = num_microbatches * num_model_chunks
    if forward_only:
        return total
    return min((pp - rank - 1) * 2 + (num_model_chunks - 1) * group_size, total)


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator: list, model: list[ModelChunk],
                                                  num_microbatches: int, tensor_shape=None,
                                                  dtype=torch.float32, forward_only: bool = False,
                                                  forward_context=None,
                                                  microbatch_group_size: int | None = None) -> list[dict]:
    """Interleaved 1F1B over V model chunks per rank (Megatron's schedule): micro-batches run through the chunks in
    groups of ``microbatch_group_size`` (default: the pipeline size; ``schedule_table``)."""
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    V, M = len(model), num_microbatches
    group_size = microbatch_group_size or pp
    problem = interleaving_problem(M, pp, group_size)
    if problem:
        raise ValueError(problem)
    microbatch_ids, chunk_ids = zip(*schedule_table(M, V, group_size))
    p2p = P2P(tensor_shape, dtype, _device(model[0]), requires_grad=not forward_only)
    total = M * V
    num_warmup = num_warmup_microbatches(M, V, group_size, pp, rank, forward_only)
    all_warmup = num_warmup == total
    num_remaining = total - num_warmup
    inputs = [[] for _ in range(V)]
    outputs = [[] for _ in range(V)]
    out_grads = [[] for _ in range(V)]
    backward_counts = [0] * V
    losses: list[dict] = []

    def chunk_id(k: int, forward: bool) -> int:
        c = chunk_ids[k % total]
        return c if forward else V - c - 1

    def set_vrank(c: int) -> None:
        ps.set_virtual_pipeline_model_parallel_rank(c)

    def num_released(k: int, c: int) -> int:
        """Inputs of chunk ``c`` already dropped (after their backward) when virtual micro-batch ``k`` runs."""
        if forward_only:
            return chunk_ids[:k].count(c)
        return chunk_ids[:max(k - num_warmup, 0)].count(V - c - 1)

    def next_recv(k: int, forward: bool) -> tuple[bool, int]:
        """Whether a tensor arrives after step ``k`` and for which chunk. The leading stage (the first in forward,
        the last in backward) runs PP - 1 steps ahead of the stage that feeds it."""
        leading = ps.is_pipeline_first_stage(True) if forward else ps.is_pipeline_last_stage(True)
        if not leading:
            return True, chunk_id(k + 1, forward)
        if k < pp - 1:  # the feeding stage has produced nothing yet
            return False, 0
        sender = chunk_id(k - (pp - 1), forward)
        if sender == (V - 1 if forward else 0):  # its last chunk feeds no one
            return False, 0
        return True, sender + 1 if forward else sender - 1

    def fwd_helper(k: int):
        c = chunk_id(k, True)
        set_vrank(c)
        if ps.is_pipeline_first_stage() and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        inp = inputs[c][microbatch_ids[k] - num_released(k, c)]
        out = forward_step(forward_step_func, data_iterator[c], model[c], inp, M, losses, forward_context)
        outputs[c].append(out)
        if forward_only:
            inputs[c].pop(0)
            outputs[c].pop()
        return out

    def bwd_helper(k: int):
        c = chunk_id(k, False)
        set_vrank(c)
        if ps.is_pipeline_last_stage() and len(out_grads[c]) == 0:
            out_grads[c].append(None)
        model[c].set_is_last_microbatch(backward_counts[c] == M - 1)
        backward_counts[c] += 1
        return backward_step(inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))

    set_vrank(0)
    inputs[0].append(None if ps.is_pipeline_first_stage() else p2p.recv_forward())
    for k in range(num_warmup):
        out = fwd_helper(k)  # leaves the virtual rank at this step's chunk
        if ps.is_pipeline_last_stage():
            out = None
        recv_prev, next_c = next_recv(k, True)
        recv_prev = recv_prev and k != total - 1
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            recv_next = not ps.is_pipeline_last_stage(ignore_virtual=True)
            inp, og = p2p.communicate(send_next=out, recv_prev=recv_prev, recv_next=recv_next)
            if recv_next:
                out_grads[V - 1].append(og)
        else:
            inp, _ = p2p.communicate(send_next=out, recv_prev=recv_prev)
        if recv_prev:
            inputs[next_c].append(inp)

    for i in range(num_remaining):
        fk = i + num_warmup
        out = fwd_helper(fk)
        in_grad = bwd_helper(i)
        set_vrank(chunk_id(fk, True))
        if ps.is_pipeline_last_stage():
            out = None
        set_vrank(chunk_id(i, False))
        if ps.is_pipeline_first_stage():
            in_grad = None
        recv_prev, next_fc = next_recv(fk, True)
        recv_next, next_bc = next_recv(i, False)
        recv_prev = recv_prev and i != num_remaining - 1
        inp, og = p2p.communicate(send_next=out, send_prev=in_grad, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_fc].append(inp)
        if recv_next:
            out_grads[next_bc].append(og)

    if not forward_only:
        if all_warmup and not ps.is_pipeline_last_stage(ignore_virtual=True):
            out_grads[V - 1].append(p2p.recv_backward())
        for k in range(num_remaining, total):
            in_grad = bwd_helper(k)
            if ps.is_pipeline_first_stage():
                in_grad = None
            recv_next, next_bc = next_recv(k, False)
            recv_next = recv_next and k != total - 1
            _, og = p2p.communicate(send_prev=in_grad, recv_next=recv_next)
            if recv_next:
                out_grads[next_bc].append(og)
    set_vrank(0)
    return losses


def get_forward_backward_func(pp_size: int, vpp_size: int | None = None,
                              microbatch_group_size: int | None = None) -> Callable:
    """The schedule of this layout; ``microbatch_group_size``: the interleaved schedule's
    ``--microbatch-group-size-per-virtual-pipeline-stage`` (None: the pipeline size)."""
    if pp_size > 1:
        if vpp_size and vpp_size > 1:
            return functools.partial(forward_backward_pipelining_with_interleaving,
                                     microbatch_group_size=microbatch_group_size)
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _device(model: ModelChunk) -> torch.device:
    return next(model.module.parameters()).device

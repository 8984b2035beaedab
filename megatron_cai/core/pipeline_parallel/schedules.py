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


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator: list, model: list[ModelChunk],
                                                  num_microbatches: int, tensor_shape=None,
                                                  dtype=torch.float32, forward_only: bool = False,
                                                  forward_context=None) -> list[dict]:
    """Interleaved 1F1B over V model chunks per rank (Megatron's schedule). Needs M % PP == 0."""
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    V, M = len(model), num_microbatches
    if M % pp != 0:
        raise ValueError(f"interleaved pipeline schedule needs the number of micro-batches ({M}) to be a "
                         f"multiple of pipeline-model-parallel-size ({pp})")
    p2p = P2P(tensor_shape, dtype, _device(model[0]), requires_grad=not forward_only)
    total = M * V
    all_warmup = False
    if forward_only:
        num_warmup = total
    elif M == pp:
        num_warmup, all_warmup = total, True
    else:
        num_warmup = min((pp - rank - 1) * 2 + (V - 1) * pp, total)
    num_remaining = total - num_warmup
    inputs = [[] for _ in range(V)]
    outputs = [[] for _ in range(V)]
    out_grads = [[] for _ in range(V)]
    backward_counts = [0] * V
    losses: list[dict] = []

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (pp * V)) // pp
        return c if forward else V - c - 1

    def set_vrank(c: int) -> None:
        ps.set_virtual_pipeline_model_parallel_rank(c)

    def fwd_helper(k: int):
        c = chunk_id(k, True)
        set_vrank(c)
        if ps.is_pipeline_first_stage() and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        out = forward_step(forward_step_func, data_iterator[c], model[c], inputs[c][-1], M, losses,
                           forward_context)
        outputs[c].append(out)
        if forward_only:
            inputs[c].pop()
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
        out = fwd_helper(k)
        next_c = chunk_id(k + 1, True)
        recv_prev = not (ps.is_pipeline_first_stage(ignore_virtual=True) and next_c == 0) and k != total - 1
        if ps.is_pipeline_last_stage():
            out = None
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
        recv_prev = True
        if ps.is_pipeline_first_stage(ignore_virtual=True):
            next_fc = chunk_id(fk - (pp - 1), True)
            if next_fc == V - 1:
                recv_prev = False
            next_fc += 1
        else:
            next_fc = chunk_id(fk + 1, True)
        recv_next = True
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            next_bc = chunk_id(i - (pp - 1), False)
            if next_bc == 0:
                recv_next = False
            next_bc -= 1
        else:
            next_bc = chunk_id(i + 1, False)
        if i == num_remaining - 1:
            recv_prev = False
        inp, og = p2p.communicate(send_next=out, send_prev=in_grad, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_fc].append(inp)
        if recv_next:
            out_grads[next_bc].append(og)

    if not forward_only:
        if all_warmup:
            og = p2p.recv_backward() if not ps.is_pipeline_last_stage(ignore_virtual=True) else None
            if og is not None:
                out_grads[V - 1].append(og)
        for k in range(num_remaining, total):
            in_grad = bwd_helper(k)
            if ps.is_pipeline_first_stage():
                in_grad = None
            next_bc = chunk_id(k + 1, False)
            recv_next = not (ps.is_pipeline_last_stage(ignore_virtual=True) and next_bc == V - 1) and k != total - 1
            _, og = p2p.communicate(send_prev=in_grad, recv_next=recv_next)
            if recv_next:
                out_grads[next_bc].append(og)
    set_vrank(0)
    return losses


def get_forward_backward_func(pp_size: int, vpp_size: int | None = None) -> Callable:
    if pp_size > 1:
        if vpp_size and vpp_size > 1:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _device(model: ModelChunk) -> torch.device:
    return next(model.module.parameters()).device

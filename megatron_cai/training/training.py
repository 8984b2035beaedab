"""The training loop: set up model, optimizer and data, then iterate, log, evaluate and checkpoint.

``pretrain(config, datasets_provider, forward_step_func)`` is what ``pretrain_gpt.py`` calls, with the
:class:`~megatron_cai.training.config.TrainConfig` built once from the flags. One code path serves a
single CPU process and TP x PP x DP runs on GPU clusters.

The user-supplied pieces are called as::

    datasets_provider(config, tokenizer, (n_train, n_valid, n_test)) -> (train, valid, test) datasets
    forward_step_func(data_iterator, model)                  -> (output, loss_func)
    forward_step_func(data_iterator, model, distiller=...)   with distillation on (bound by the Trainer)
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.datasets.device_prefetch import DevicePrefetcher
from ..core.distributed.comm_timing import StepTimeline, timeline_log_lines, timing_log_lines, timing_scalars
from ..core.distributed.ddp import DistributedDataParallel
from ..core.distributed.fsdp import build_fsdp2
from ..core.distributed.memory import MemoryReport, max_over_ranks, memory_report
from ..core.distributed.reducers import build_reducer
from ..core.models.gpt.model import build_model_chunks
from ..core.num_microbatches_calculator import NumMicroBatchesCalculator
from ..core.optimizer.grad_scaler import build_grad_scaler
from ..core.optimizer.lr_scheduler import OptimizerParamScheduler
from ..core.optimizer.optimizer import build_optimizer
from ..core.pipeline_parallel.schedules import get_forward_backward_func
from ..core.transformer.compile import compile_transformer_layers
from ..core.transformer.lse_stats import LseStatsCollector
from . import divergence
from .arguments import rebuild_for_world_size
from .checkpoint import Checkpointer, iteration_dir, open_run_dirs, same_path, tp_layout, warn_if_short_of_space
from .config import ArgumentError, TrainConfig, format_config
from .errors import DataError
from .features import rerun
from .features.diloco import DilocoCheckpoint, DilocoSeam
from .features.distill import setup_distillation
from .features.moe import MoEMetrics
from .features.weight_hash import check_weight_replicas
from .flags.megatron_compat import no_op_message
from .initialize import discover_env, initialize_distributed
from .logging import (
    LogWindow,
    StepProfiler,
    TensorBoard,
    WandbWriter,
    gpt_flops_per_iteration,
    parameter_count_line,
    print_rank_0,
    print_rank_last,
    training_log_line,
    validation_log_lines,
)
from .preemption import exit_signal
from .step_readback import Deadline, StepReadback, loss_means, read_step
from .training_log import (
    IterationStats,
    log_line_timers,
    megatron_scalars,
    megatron_wandb,
    prints_log_line,
    validation_scalars,
)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    extra: dict = field(default_factory=dict)
    exit_code: int = 0  # the rerun state machine's verdict (16: resume elsewhere, 17: failed validation)

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "consumed_train_samples": self.consumed_train_samples,
                "consumed_valid_samples": self.consumed_valid_samples,
                "skipped_iterations": self.skipped_iterations}


@dataclass(frozen=True)
class StepResult:
    losses: dict[str, float]  # averaged over micro-batches and DP (last pipeline stage; {} elsewhere)
    grad_norm: float          # nan when some gradient was not finite
    finite: bool              # the optimizer stepped (False: skipped on every rank)
    exit_requested: bool      # some rank received an exit signal (read back with the step, see step_readback)
    time_up: bool = False     # --exit-duration-in-mins passed on rank 0's clock (read back with the step)
    rerun: rerun.Verdict | None = None  # the rerun state machine stops the job (no optimizer step was taken)


def empty_device_cache(device: torch.device) -> None:
    """--empty-unused-memory-level: release the CUDA caching allocator's unused blocks (no-op on CPU)."""
    device_mod.empty_cache(device)


class _RecordingIterator:
    """Yields the micro-batches and remembers the last one (its loss mask weighs its loss)."""

    def __init__(self, batches: list[dict]) -> None:
        self._it, self.last = iter(batches), None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.last = next(self._it)
        return self.last


def per_token_loss_step(step_func: Callable, batches: list[dict], model_chunks: list, num_microbatches: int,
                        device: torch.device) -> tuple[Callable, list]:
    """--calculate-per-token-loss: the loss is the sum over every loss-mask token of the global batch divided
    by their number (Megatron-LM's rule), instead of the mean of per-micro-batch means.

    Each micro-batch's mean loss is weighted by n_mb * M * DP / N (N: tokens of the global batch), so that
    the schedule's 1/M and the data-parallel mean turn it into sum / N; the logged stats likewise. The
    weights stay on the device: nothing is read back before the forward pass."""
    counts = [b["loss_mask"].float().sum().to(torch.float64) for b in batches]
    total = torch.stack(counts).sum()
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        dist.all_reduce(total, group=ps.get_data_parallel_group())
    scale = (num_microbatches * dp) / total.clamp_min(1.0)
    weights = {id(b): (c * scale).float() for b, c in zip(batches, counts)}  # device scalars

    def step(data_iterator: _RecordingIterator, model):
        output, loss_func = step_func(data_iterator, model)
        weight = weights[id(data_iterator.last)]

        def weighted(out):
            loss, stats = loss_func(out)
            return loss * weight, {k: v * weight for k, v in stats.items()}

        return output, weighted

    return step, [_RecordingIterator(batches) for _ in model_chunks]


def _check_train_split(train_ds, train_iters: int, data_path, split: str) -> None:
    """An empty train split (an empty corpus, or a --split that gives training none) is one error, not a crash."""
    if train_ds is None and train_iters > 0:
        raise DataError(f"--data-path {' '.join(map(str, data_path or []))}: the train split is empty (the corpus has "
                        f"no documents with at least 2 tokens, or --split {split} gives training none); nothing to "
                        f"train on")


class Trainer:
    """Holds everything one run needs; ``train()`` runs the loop.

    ``config`` is the run's :class:`TrainConfig`; if it was built for another world size than the
    launcher's, it is rebuilt from its flags for this one (and the difference printed).
    """

    def __init__(self, config: TrainConfig, datasets_provider, forward_step_func, tokenizer=None) -> None:
        env = discover_env()
        if env.world_size != config.parallel.world_size:
            print(f" the configuration was built for {config.parallel.world_size} ranks; this job has "
                  f"{env.world_size}: rebuilding it from its flags", flush=True)
            config = rebuild_for_world_size(config, env.world_size)
        if tokenizer is not None and tokenizer.vocab_size != config.model.vocab_size:
            raise ArgumentError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model configuration "
                                f"{config.model.vocab_size}: build the config with vocab_size=tokenizer.vocab_size")
        self.config = config
        self.env, self.device = initialize_distributed(config.parallel, config.training.seed, env,
                                                       islands=config.diloco.islands)
        print_rank_0(format_config(config))
        self.run_lock = open_run_dirs(config.checkpoint)  # collective: paths, the run lock, no overwrite
        model_cfg, run = config.model, config.training
        if model_cfg.qat.gemm_backend == "transformer_engine" and self.device.type != "cuda":
            raise ArgumentError(f"--transformer-impl transformer_engine runs on CUDA only; this run is on "
                                f"{self.device.type}")
        self.tokenizer = tokenizer
        self.lse_stats = LseStatsCollector()
        vpp = config.parallel.virtual_pipeline_model_parallel_size
        chunks = build_model_chunks(model_cfg, run.seed, vpp, lse_stats=self.lse_stats)
        if run.compile:  # --compile: each transformer layer, before DDP / FSDP2 wrap the chunks
            for m in chunks:
                compile_transformer_layers(m)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)  # gradients reduce over DP x CP
        # each parameter's TP split, read before FSDP2 replaces the parameters (torch_dist checkpoints)
        param_layout = tp_layout(chunks)
        for m in chunks:
            m.to(self.device)
        self.moe = MoEMetrics(chunks, model_cfg.moe, model_cfg.num_layers, self.device)
        self.timelines: list[StepTimeline] = []  # --timing-log-level 2: the backward timeline per DDP chunk
        if config.ddp.use_torch_fsdp2:  # FSDP2 over the DP (x CP) mesh (core/distributed/fsdp.py)
            self.model = build_fsdp2(chunks, self.device, config.ddp, bf16=run.bf16, seed=run.seed + ps.get_rank())
        else:
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)  # gradients reduce over DP x CP
            self.timelines = [StepTimeline(config.logging.timing_log_level >= 2, self.device,
                                           group=dp_group) for _ in chunks]
            self.model = [DistributedDataParallel(m, build_reducer(config.ddp, dp_group, dp,
                                                                   seed=run.seed + ps.get_rank(),
                                                                   timing_level=config.logging.timing_log_level),
                                                  config.ddp, device=self.device, timeline=t,
                                                  expert_reducer=self._expert_reducer(run.seed))
                          for m, t in zip(chunks, self.timelines)]
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.grad_scaler = build_grad_scaler(run.loss_scale) if run.fp16 else None  # --fp16 loss scaling
        self.optimizer.grad_scaler = self.grad_scaler  # saved with the optimizer state, as in Megatron
        diloco_state = DilocoCheckpoint.for_config(config.diloco)  # None unless --diloco-inner-steps
        # per-rank state saved beside the model: Squinch error feedback, DiLoCo's outer state
        self.rank_states = [m.reducer for m in self.model] + ([diloco_state] if diloco_state else [])
        self.scheduler = OptimizerParamScheduler(config.scheduler)
        self.microbatches = NumMicroBatchesCalculator(  # --rampup-batch-size
            run.global_batch_size, run.micro_batch_size, config.parallel.data_parallel_size, run.rampup_batch_size,
            run.decrease_batch_size_if_needed, step_schedule=run.step_batch_size_schedule)
        self.num_microbatches = run.num_microbatches  # this iteration's (changes during a batch ramp-up)
        self._log_memory("at start-up")
        self.state = TrainState()
        self.divergence = divergence.DivergenceMonitor(run.divergence, self.device)
        self.rerun, self.rerun_snapshot = rerun.build(run.divergence.rerun, run.seed, self.device,
                                                      [m.reducer for m in self.model])
        self.deadline = Deadline(None)  # --exit-duration-in-mins: set when train() starts
        ckpt = config.checkpoint
        local = sum(p.numel() for m in chunks for p in m.parameters())
        tp_pp = config.parallel.tensor_model_parallel_size * config.parallel.pipeline_model_parallel_size
        warn_if_short_of_space(ckpt, local * tp_pp * (12 if ckpt.save_optim else 4))  # fp32 weights, Adam
        self._saved_iteration: int | None = None  # the iteration saved (or started saving) last
        self._np_saved_iteration: int | None = None  # the same, of the non-persistent saves
        self.checkpointer = Checkpointer(config, self.model, self.optimizer, self.scheduler, param_layout,
                                         self.device)  # collective (--async-save with torch_dist)
        if ckpt.load:
            counters = self.checkpointer.load(self.rank_states)  # either format
            if counters:
                self.state.iteration = counters["iteration"]
                self.state.consumed_train_samples = counters.get("consumed_train_samples", 0)
                self.state.consumed_valid_samples = counters.get("consumed_valid_samples", 0)
                self.state.skipped_iterations = counters.get("skipped_iterations", 0)
                loaded = self.checkpointer.loaded_root  # --load, or its non-persistent directory when newer
                print_rank_0(f" loaded checkpoint from {loaded} at iteration {self.state.iteration}")
                self.divergence.last_good_checkpoint = iteration_dir(loaded, self.state.iteration)
                self.divergence.load_state_dict(counters)
                rerun.resume(self.rerun, loaded, self.state.iteration)
                if same_path(ckpt.load, ckpt.save):  # that iteration is saved already: never written again
                    self._saved_iteration = self.state.iteration
            elif not ckpt.finetune:
                print_rank_0(f" no checkpoint found in {ckpt.load}: starting from scratch")
        self.diloco = DilocoSeam.build(config.diloco, self.model, self.optimizer, diloco_state)  # on the loaded weights
        num_samples = self._num_samples()
        train_ds, valid_ds, test_ds = datasets_provider(config, self.tokenizer, num_samples)
        _check_train_split(train_ds, run.train_iters, config.data.data_path, config.data.split)
        self.distiller, train_ds = setup_distillation(config.distill, model_cfg, seed=run.seed,
                                                      num_train_samples=num_samples[0], device=self.device,
                                                      train_ds=train_ds)
        self.forward_step_func = _bind_distiller(forward_step_func, self.distiller)
        self.train_ds, self.valid_ds, self.test_ds = train_ds, valid_ds, test_ds
        # pinned host batches, copied to the device one step ahead (training) or when taken (validation)
        self.train_iter = self._loader(train_ds, self.state.consumed_train_samples, lookahead=None)
        self.valid_iter = self._loader(valid_ds, self.state.consumed_valid_samples, lookahead=False)
        log = config.logging
        self.tb = TensorBoard(log.tensorboard_dir, log.tensorboard_queue_size)
        self.wandb = WandbWriter(log, ckpt.save, config.to_dict())
        self.profiler = StepProfiler(log, ps.get_rank())
        self.forward_backward = get_forward_backward_func(config.parallel.pipeline_model_parallel_size, vpp,
                                                          config.parallel.microbatch_group_size_per_vp_stage)
        tp, cp = config.parallel.tensor_model_parallel_size, config.parallel.context_parallel_size
        seq = model_cfg.seq_length // cp  # this rank's tokens of each sequence
        seq = seq // tp if model_cfg.sequence_parallel else seq
        self.tensor_shape = (run.micro_batch_size, seq, model_cfg.hidden_size)
        self._te_recipe = None
        self.num_zeros_in_grad: float | None = None

    # --------------------------------------------------------------------------------------- setup
    def _expert_reducer(self, seed: int):
        """MoE: the reducer of expert gradients, over the expert-data-parallel group (None without MoE)."""
        if self.config.model.moe is None:
            return None
        return build_reducer(self.config.ddp, ps.get_expert_data_parallel_group(),
                             ps.get_expert_data_parallel_world_size(), seed=seed + ps.get_rank(),
                             timing_level=self.config.logging.timing_log_level)

    def _log_memory(self, when: str) -> dict:
        """Log the memory report (max over ranks, collective); return this rank's figures."""
        mine = memory_report(self.model, self.optimizer, self.device)
        print_rank_0(max_over_ranks(mine, self.device).line(f"max over ranks, {when}"))
        return mine.to_dict()

    def _num_samples(self) -> tuple[int, int, int]:
        run, log = self.config.training, self.config.logging
        gbs, eval_gbs = run.global_batch_size, log.eval_global_batch_size or run.global_batch_size
        # megatron-core's get_train_valid_test_num_samples: every periodic evaluation and the final one
        periodic = run.train_iters // log.eval_interval if log.eval_interval else 0
        evals = (periodic + 1) * log.eval_iters
        return (run.train_iters * gbs, evals * eval_gbs, log.eval_iters * eval_gbs)

    def _loader(self, dataset, consumed: int, lookahead: bool | None = False) -> DevicePrefetcher | None:
        """``lookahead``: copy the next step's micro-batches during this one (None: on accelerators)."""
        from ..core.datasets.data_samplers import build_pretraining_data_loader

        if dataset is None:
            return None
        loader = build_pretraining_data_loader(dataset, consumed, self.config.training.micro_batch_size,
                                               *ps.get_data_shard(),  # DP rank among every island's
                                               num_workers=self.config.data.num_workers,
                                               pin_memory=self.device.type == "cuda")
        return DevicePrefetcher(iter(loader), self.device, lookahead=lookahead)

    def _next_microbatches(self, prefetcher: DevicePrefetcher) -> list[dict]:
        try:
            return prefetcher.take(self.num_microbatches)
        except StopIteration:
            raise RuntimeError("the dataset ran out of samples; it was built for fewer iterations than "
                               "requested (rebuild the index cache or lower --train-iters)") from None

    def _forward_context(self):
        run = self.config.training
        autocast = device_mod.autocast(self.device, run.bf16 or run.fp16, torch.float16 if run.fp16 else torch.bfloat16)
        qat = self.config.model.qat
        if qat.gemm_backend != "transformer_engine":
            return autocast
        from ..core.quantization.gemm_backends import te_fp8_autocast, te_fp8_recipe

        if self._te_recipe is None:  # each rank scales by its own amax: no amax collective
            self._te_recipe = te_fp8_recipe(qat.fp8_format, reduce_amax=False)
        stack = contextlib.ExitStack()
        stack.enter_context(autocast)
        stack.enter_context(te_fp8_autocast(True, recipe=self._te_recipe))
        return stack

    def _scaled_forward_step(self, data_iterator, model):
        """The forward step with its loss multiplied by the fp16 loss scale (the stats stay unscaled)."""
        output, loss_func = self.forward_step_func(data_iterator, model)
        scale = self.grad_scaler.scale

        def scaled_loss_func(output_tensor):
            loss, stats = loss_func(output_tensor)
            return loss * scale, stats
        return output, scaled_loss_func

    def _run_schedule(self, batches: list[dict], forward_only: bool) -> list[dict]:
        iters = [iter(batches) for _ in self.model]
        step_func = self._scaled_forward_step if self.grad_scaler and not forward_only else self.forward_step_func
        if self.config.training.calculate_per_token_loss:
            step_func, iters = per_token_loss_step(step_func, batches, self.model, self.num_microbatches, self.device)
        return self.forward_backward(step_func, iters, self.model, self.num_microbatches,
                                     tensor_shape=self.tensor_shape, dtype=torch.float32,
                                     forward_only=forward_only, forward_context=self._forward_context)

    # ---------------------------------------------------------------------------------------- step
    def train_step(self) -> StepResult:
        """One iteration: forward/backward over the micro-batches, grad sync, clip, update.

        Reads the device once (``step_readback.read_step``), after the gradient-norm reduction."""
        self.microbatches.update(self.state.consumed_train_samples)
        self.num_microbatches = self.microbatches.num_microbatches
        batches = self._next_microbatches(self.train_iter)
        read, verdict = self.rerun.run_iteration(  # once, or twice on the same batches (features/rerun.py)
            self.state.iteration, functools.partial(self._forward_backward, batches), self.rerun.step_checks,
            self.rerun_snapshot)
        if verdict is not None:  # Megatron's should_checkpoint_and_exit: no optimizer step
            return StepResult(read.losses, read.grad_norm, False, read.exit_requested, read.time_up, verdict)
        finite = math.isfinite(read.grad_norm) and not read.found_inf
        if finite:
            self.optimizer.clip(read.grad_norm, self.config.optimizer.clip_grad)
        # --log-num-zeros-in-grad: zero gradient elements over the distinct parameters (collective, one more read)
        self.num_zeros_in_grad = (float(self.optimizer.num_zeros_in_grad())
                                  if self.config.logging.log_num_zeros_in_grad else None)
        if self.grad_scaler is not None:
            old_scale = self.grad_scaler.scale
            self.grad_scaler.update(not finite)
            if finite and self.grad_scaler.scale != old_scale:  # error feedback follows the loss scale
                for m in self.model:
                    m.reducer.rescale_feedback(self.grad_scaler.scale / old_scale)
        if self.divergence.cfg.check_for_nan_in_loss_and_grad:  # a non-finite loss on any rank skips the step
            finite = finite and not read.nonfinite_loss
        if finite:
            sched = self.scheduler
            self.optimizer.step(sched.get_lr(), sched.get_lr(decoupled=True), sched.get_lr(mup=True))
            self.scheduler.step(self.microbatches.running_global_batch_size)  # in samples, as Megatron's
        else:
            for m in self.model:
                m.reducer.step_skipped()
        self.moe.after_step()
        if self.config.training.empty_unused_memory_level >= 1:
            empty_device_cache(self.device)
        self._mark_timelines("step end")
        return StepResult(read.losses, read.grad_norm, finite, read.exit_requested, read.time_up)

    def _forward_backward(self, batches: list[dict]) -> StepReadback:
        """Forward and backward over the micro-batches, gradient sync, then the step's one read-back."""
        for t in self.timelines:
            t.step_start()
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.lse_stats.reset()
        self.moe.before_schedule(self._loss_scale(), self.num_microbatches)
        stats = self.moe.add_to_stats(self._run_schedule(batches, forward_only=False), self.num_microbatches)
        self._mark_timelines("backward end")
        for m in self.model:
            m.finish_grad_sync()
        self._mark_timelines("sync end")
        if self.config.training.empty_unused_memory_level >= 2:
            empty_device_cache(self.device)
        found_inf = (self.optimizer.unscale_and_check(self.grad_scaler.inv_scale)  # before the norm and clipping
                     if self.grad_scaler is not None else None)
        return read_step(self.optimizer.local_norm_sq(), stats, exit_signal.received() is not None, self.device,
                         time_up=self.deadline.passed(), found_inf=found_inf)

    def _mark_timelines(self, name: str) -> None:
        for t in self.timelines:
            t.mark(name)

    def _average_stats(self, stats: list[dict]) -> dict[str, float]:
        """Each statistic's mean over micro-batches and DP x CP ranks (CP ranks hold shares of a mean), read
        back (validation)."""
        keys, means = loss_means(stats, ps.get_data_parallel_group(with_context_parallel=True),
                                 ps.get_data_parallel_world_size(with_context_parallel=True))
        return dict(zip(keys, means.tolist())) if means is not None else {}

    @torch.no_grad()
    def evaluate(self, iterator: DevicePrefetcher | None = None) -> dict[str, float]:
        """--eval-iters iterations of forward passes on the validation set (or ``iterator``'s set): the mean
        of each loss."""
        iterator = self.valid_iter if iterator is None else iterator
        if iterator is None:
            return {}
        self.optimizer.finish_param_sync()
        for m in self.model:
            m.eval()
        totals: dict[str, float] = {}
        eval_iters = self.config.logging.eval_iters
        train_microbatches = self.num_microbatches
        run = self.config.training
        eval_gbs = self.config.logging.eval_global_batch_size or run.global_batch_size  # --eval-global-batch-size
        self.num_microbatches = eval_gbs // (run.micro_batch_size * self.config.parallel.data_parallel_size)
        for _ in range(eval_iters):
            stats = self._average_stats(self._run_schedule(self._next_microbatches(iterator), True))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / eval_iters
            if iterator is self.valid_iter:
                self.state.consumed_valid_samples += eval_gbs
            if self.config.training.empty_unused_memory_level >= 1:
                empty_device_cache(self.device)
        self.num_microbatches = train_microbatches
        for m in self.model:
            m.train()
        return totals

    # ---------------------------------------------------------------------------------------- loop
    def save(self, non_persistent: bool = False) -> None:
        """Save now (collective), unless the state is not finite: the checkpointer picks format and mode;
        ``non_persistent``: into the non-persistent directory (``--non-persistent-save-interval``)."""
        last = self._np_saved_iteration if non_persistent else self._saved_iteration
        if not self.config.checkpoint.save or last == self.state.iteration:
            return  # the same iteration reached twice (a signal or --exit-interval on a save iteration)
        self.finalize_async_save(blocking=True)  # one save in flight at most
        self.optimizer.finish_param_sync()
        if self.checkpointer.asynchronous and not self.divergence.consecutive_skipped:
            refused = None  # --async-save: finiteness is checked on the staged copy, in the writer thread
        else:
            refused = self.divergence.refuse_save(self.model, self.optimizer)  # collective
        if refused:
            print_rank_0(f" WARNING: not saving a checkpoint at iteration {self.state.iteration}: {refused}; the "
                         f"last good checkpoint stays current: {self.divergence.last_good_checkpoint or 'none'}")
            return
        counters = {**self.state.to_dict(), **self.divergence.state_dict()}
        path = self.checkpointer.save(counters, [r.state_dict() for r in self.rank_states], non_persistent)
        if non_persistent:
            self._np_saved_iteration = self.state.iteration
        else:
            self._saved_iteration = self.state.iteration
        if path is None:  # --async-save: staged, written in the background, published by finalize_async_save
            kind = "non-persistent " if non_persistent else ""
            print_rank_0(f" started an asynchronous {kind}save at iteration {self.state.iteration:7d}")
            return
        self._saved(path, self.state.iteration)

    def _saved(self, path: str, iteration: int) -> None:
        self.divergence.last_good_checkpoint = path
        print_rank_0(f" saved checkpoint at iteration {iteration:7d} to {os.path.dirname(path)}")

    def finalize_async_save(self, blocking: bool) -> None:
        """Make an --async-save in flight current once every rank has written it (collective)."""
        done = self.checkpointer.finalize_async(blocking)
        if done is not None:
            if done.refused:
                print_rank_0(f" WARNING: dropped the asynchronous save of iteration {done.iteration}: "
                             f"parameters or optimizer state hold non-finite values; the last good checkpoint "
                             f"stays current: "
                             f"{self.divergence.last_good_checkpoint or 'none'}")
            else:
                self._saved(done.final, done.iteration)

    def train(self) -> TrainState:
        run, log, st = self.config.training, self.config.logging, self.state
        save_interval = self.config.checkpoint.save_interval
        np_interval = self.config.checkpoint.non_persistent_save_interval
        self.deadline = Deadline(run.exit_duration_in_mins)  # rank 0's monotonic clock decides for every rank
        window = LogWindow()
        history = []
        if run.manual_gc:  # Megatron-LM's --manual-gc: no automatic collection; collect at fixed steps
            gc.disable()
            gc.collect()
        exited = False  # an exit (signal, --exit-interval, --exit-duration-in-mins): no final evaluation
        if run.skip_train:
            print_rank_0("skipping training (--skip-train is on) ...")
        stopped = self._signalled_during_start_up()
        while not stopped and st.iteration < run.train_iters and not run.skip_train:
            self.profiler.before_step(st.iteration)
            bytes_before = sum(m.grad_comm_bytes for m in self.model)
            lr = self.scheduler.get_lr()  # the rate this iteration's update uses (the history's "lr")
            step = self.train_step()
            if step.rerun is not None:  # Megatron's rerun verdict: a checkpoint of this iteration's start, exit
                self._rerun_exit(step.rerun)
                exited = True
                break
            losses, grad_norm, finite = step.losses, step.grad_norm, step.finite
            st.iteration += 1
            if self.diloco is not None:  # the outer steps due after this inner step (docs/diloco.md)
                self.diloco.after_step(st.iteration, last=st.iteration == run.train_iters)
            batch = self.microbatches.running_global_batch_size
            st.consumed_train_samples += batch
            self.profiler.after_step(st.iteration)
            self.finalize_async_save(blocking=False)  # an --async-save that every rank has written
            # an fp16 loss-scale overflow (finite loss, non-finite gradients) is only counted, as in Megatron
            overflow = not finite and self.grad_scaler is not None and all(math.isfinite(v) for v in losses.values())
            if not finite:
                st.skipped_iterations += 1
            if not finite and not overflow:
                print_rank_last(f" iteration {st.iteration}: non-finite loss or gradient (grad norm {grad_norm}) on "
                                f"some rank; skipped the optimizer step on every rank")
            # raises when the run has diverged
            spike = self.divergence.observe(st.iteration, losses, skipped=not finite and not overflow)
            if spike:
                print_rank_last(spike)
                st.extra["loss_spikes"] = self.divergence.spikes
            comm_bytes = sum(m.grad_comm_bytes for m in self.model) - bytes_before
            window.add(losses, skipped=not finite)
            loss_scale = {"loss scale": self.grad_scaler.scale} if self.grad_scaler else {}
            history.append({**losses, "grad norm": grad_norm, "lr": lr, "skipped": not finite,
                            "grad comm bytes": comm_bytes, "global batch size": batch, **loss_scale})
            if run.manual_gc and run.manual_gc_interval and st.iteration % run.manual_gc_interval == 0:
                gc.collect()
            hash_interval = run.check_weight_hash_across_dp_replicas_interval
            if hash_interval and st.iteration % hash_interval == 0:
                self.optimizer.finish_param_sync()  # the replicas' updated parameters, all gathered
                check_weight_replicas([m.module for m in self.model], st.iteration, self.device)
            stats = self._iteration_stats(losses, grad_norm, finite, batch)
            if st.iteration % log.tensorboard_log_interval == 0:  # Megatron's tags, this iteration's values
                self.tb.add(megatron_scalars(stats, log, self.config.parallel.world_size))
                if self.config.model.moe is not None and self.config.model.moe.per_layer_logging:
                    self.tb.scalars(self.moe.per_layer_scalars(), st.iteration)
                self.wandb.log(megatron_wandb(stats, log, self.config.parallel.world_size), st.iteration)
            first = len(history) == 1  # Megatron prints the run's first iteration too, without resetting
            if prints_log_line(st.iteration, log.log_interval, first):
                self._log(window, stats, comm_bytes, first)
                outer_line = self.diloco.log_line(st.iteration) if self.diloco is not None else None
                if outer_line:
                    print_rank_last(outer_line)
                if not first:
                    window = LogWindow()
            if log.eval_interval and st.iteration % log.eval_interval == 0 and self.valid_iter is not None:
                val = self.evaluate()
                if val:
                    st.extra.setdefault("validation", []).append({"iteration": st.iteration, **val})
                    print_rank_last(validation_log_lines(st.iteration, val))
                    self._validation_scalars(val)
            if save_interval and st.iteration % save_interval == 0:
                self.save()
            elif np_interval and st.iteration % np_interval == 0:  # Megatron-LM: the persistent save wins
                self.save(non_persistent=True)
            if step.exit_requested:
                self.save()  # the checkpoint first: a failing log write must not lose it
                print_rank_0(f" exit signal received at iteration {st.iteration}: saved and exiting")
                exited = True
                break
            if run.exit_interval and st.iteration % run.exit_interval == 0:
                self.save()
                print_rank_0(f" exiting at iteration {st.iteration} (--exit-interval)")
                exited = True
                break
            if step.time_up:  # decided by rank 0's clock in the step's read-back: the same iteration everywhere
                self.save()
                print_rank_0(f" exiting at iteration {st.iteration} after {run.exit_duration_in_mins} minutes "
                             f"(--exit-duration-in-mins, rank 0's clock)")
                exited = True
                break
        else:
            at_interval = save_interval and st.iteration % save_interval == 0
            if not stopped and self.config.checkpoint.save and not run.skip_train and not at_interval:
                self.save()
        if not exited and not stopped:
            self._final_evaluation(write_to_tensorboard=not run.skip_train)
        if "memory" not in st.extra:  # no iteration logged
            st.extra["memory"] = self._log_memory("at the end of training")
        self.finalize_async_save(blocking=True)  # exit paths and the end of training wait for the write
        self.optimizer.finish_param_sync()
        self.profiler.close()
        if run.manual_gc:
            gc.enable()
        st.extra["history"] = history
        if self.diloco is not None:
            self.diloco.close()
            st.extra["diloco"] = dict(vars(self.diloco.outer.stats))
        self.tb.close()
        self.wandb.close()
        return st

    def _rerun_exit(self, verdict: rerun.Verdict) -> None:
        """Save (the iteration's start, with the rerun state beside it) when the verdict asks, then set the
        exit code that ``pretrain`` exits with."""
        if verdict.checkpoint:
            self.save()
            rerun.save_state(self.rerun, self.config.checkpoint.save, self.state.iteration, self.device)
        self.state.exit_code = verdict.exit_code

    def _final_evaluation(self, write_to_tensorboard: bool) -> None:
        """megatron-core's end of ``pretrain``: with --eval-iters > 0, evaluate the validation set, then the test
        set, each printed as "validation loss at iteration N on validation set / test set"; TensorBoard gets
        Megatron's validation tags (both sets write them, as in megatron-core) unless --skip-train."""
        if not self.config.logging.eval_iters:
            return
        st = self.state
        test_iter = self._loader(self.test_ds, 0, lookahead=False)
        for name, iterator in (("validation set", self.valid_iter), ("test set", test_iter)):
            if iterator is None:
                continue
            val = self.evaluate(iterator)
            st.extra.setdefault("final_evaluation", {})[name] = val
            print_rank_last(validation_log_lines(st.iteration, val, on=name))
            if write_to_tensorboard:
                self.tb.add(validation_scalars(val, st.iteration, st.consumed_train_samples,
                                               self.config.logging.log_validation_ppl_to_tensorboard))
                self.wandb.log({f"{k} validation": v for k, v in val.items()}, st.iteration)

    def _signalled_during_start_up(self) -> bool:
        """Whether some rank received an exit signal before the first iteration (collective, read once): the
        run then stops without training and without saving, so a loaded checkpoint stays as it was."""
        flag = torch.tensor(float(exit_signal.received() is not None), device=self.device)
        if ps.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return False
        where = f"the checkpoint at iteration {self.state.iteration} is current" if self.state.iteration else \
            "nothing was trained"
        print_rank_0(f" exit signal ({exit_signal.received() or 'on another rank'}) during start-up: exiting "
                     f"before the first iteration, nothing saved ({where})")
        return True

    def _loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without a loss scaler, as Megatron-LM logs it for bf16 / fp32)."""
        scaler = self.grad_scaler
        return float(scaler.scale) if scaler is not None else 1.0

    def _iteration_stats(self, losses: dict[str, float], grad_norm: float, finite: bool, batch: int) -> IterationStats:
        """This iteration's figures for the log (collective with --log-params-norm)."""
        log, st = self.config.logging, self.state
        return IterationStats(
            iteration=st.iteration, consumed_samples=st.consumed_train_samples, losses=losses,
            learning_rate=_fp32(self.scheduler.get_lr()), batch_size=batch, loss_scale=self._loss_scale(),
            grad_norm=_fp32(grad_norm) if finite or self.grad_scaler is None else None, skipped=not finite,
            num_zeros=_fp32(self.num_zeros_in_grad), memory=device_mod.memory_stats(self.device)
            if log.log_memory_to_tensorboard else None,
            params_norm=self.optimizer.params_norm() if log.log_params_norm else None)

    def _log(self, window: LogWindow, stats: IterationStats, comm_bytes: int, first: bool) -> None:
        run, log, st = self.config.training, self.config.logging, self.state
        # the read waits for the queued work, so the window's time below covers it
        # Megatron-LM's memory report comes with the first log line; st.extra keeps this rank's figures
        mine = memory_report(self.model, self.optimizer, self.device) if "memory" not in st.extra else None
        extra, most = self._log_readback(mine)
        if mine is not None:
            print_rank_0(most.line("max over ranks, at the first log"))
            st.extra["memory"] = mine.to_dict()
        elapsed = window.seconds_per_iteration()
        tps = stats.batch_size * self.config.model.seq_length / max(elapsed, 1e-9)
        throughput = None
        if log.log_throughput:
            flops = gpt_flops_per_iteration(self.config.model, run.global_batch_size)
            throughput = flops / (elapsed * 1e12 * self.config.parallel.world_size)
        line_extra = None
        if extra:
            line_extra = {"attention lse mean": sum(v for k, v in extra.items() if k.endswith("-mean"))
                          / (len(extra) // 2),
                          "attention lse max": max(v for k, v in extra.items() if k.endswith("-max"))}
        print_rank_last(training_log_line(
            st.iteration, run.train_iters, st.consumed_train_samples, elapsed * 1000, stats.learning_rate,
            stats.batch_size, window.averages(), stats.grad_norm, window.skipped, tps, grad_comm_bytes=comm_bytes,
            extra=line_extra, loss_scale=stats.loss_scale, nan_iters=window.nan, throughput_tflops=throughput,
            num_zeros=stats.num_zeros, params_norm=stats.params_norm))
        scalars = {**log_line_timers(elapsed, throughput, log, first), "tokens-per-second": tps,
                   "grad-comm-bytes": comm_bytes, **extra}
        self.tb.scalars(scalars, st.iteration)
        if log.timing_log_level and st.iteration % log.log_interval == 0:  # phase timers, per full window
            timings = [m.reducer.timers.collect() for m in self.model]
            for line in timing_log_lines(st.iteration, timings, log.timing_log_level, window.iterations):
                print_rank_last(line)
            for line in timeline_log_lines(st.iteration, [t.collect() for t in self.timelines]):
                print_rank_last(line)
            if log.log_timers_to_tensorboard:
                self.tb.scalars(timing_scalars(timings, window.iterations), st.iteration)

    def _validation_scalars(self, val: dict[str, float]) -> None:
        log, it = self.config.logging, self.state.iteration
        self.tb.scalars({f"validation/{k.replace(' ', '-')}": v for k, v in val.items()}, it)  # ours
        self.tb.add(validation_scalars(val, it, self.state.consumed_train_samples,
                                       log.log_validation_ppl_to_tensorboard))
        self.wandb.log({f"{k} validation": v for k, v in val.items()}, it)

    def _log_readback(self, memory: MemoryReport | None) -> tuple[dict[str, float], MemoryReport | None]:
        """A logging iteration's one read (every rank calls it): the attention lse mean / max per layer in this
        iteration's last micro-batch, and ``memory``'s figures maxed over ranks when given.

        Each layer's stats come from the ranks that hold it (its pipeline stage, every TP/DP rank): the
        mean is the mean of those ranks' means (equal row counts per rank), the max their max.
        """
        layers = self.config.model.num_layers
        sums = torch.zeros(layers, 2, device=self.device)  # [sum of means, ranks]
        maxes = torch.full((layers,), float("-inf"), device=self.device)
        for layer, mean_max in self.lse_stats.per_layer().items():
            mean, mx = mean_max.to(self.device)
            sums[layer] = torch.stack([mean, torch.ones_like(mean)])
            maxes[layer] = mx
        maxes = maxes.to(torch.float64)
        if memory is not None:
            maxes = torch.cat([maxes, memory.as_tensor(self.device)])
        if ps.get_island_world_size() > 1:  # with DiLoCo's islands: the island's (its line), nothing over the link
            dist.all_reduce(sums, group=ps.get_island_group())
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=ps.get_island_group())
        values = torch.cat([sums.to(torch.float64).flatten(), maxes]).tolist()
        out = {}
        for layer in range(layers):
            total, ranks, mx = values[2 * layer], values[2 * layer + 1], values[2 * layers + layer]
            if ranks > 0:
                out[f"attention-lse/layer{layer}-mean"] = total / ranks
                out[f"attention-lse/layer{layer}-max"] = mx
        return out, memory.from_values(values[3 * layers:]) if memory is not None else None


def _fp32(value: float | None) -> float | None:
    """A figure as Megatron-LM logs it: its reduce_max_stat_across_model_parallel_group rounds the learning rate,
    the grad norm and the zero count through an fp32 tensor (here through struct: no tensor, no device read)."""
    if value is None:
        return None
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond fp32's range: inf, as the fp32 tensor gives
        return math.copysign(math.inf, value)


def _bind_distiller(forward_step_func, distiller):
    """``forward_step_func`` with the distiller bound as its ``distiller=`` argument (unchanged without one)."""
    if distiller is None:
        return forward_step_func
    if "distiller" not in inspect.signature(forward_step_func).parameters:
        raise ArgumentError("distillation (--distill-*) is on but the forward step function takes no `distiller` "
                            "argument: define it as forward_step(data_iterator, model, distiller=None)")
    return functools.partial(forward_step_func, distiller=distiller)


def pretrain(config: TrainConfig, datasets_provider, forward_step_func, tokenizer=None) -> TrainState:
    """Build a Trainer and run it; returns the final TrainState (its ``extra['history']`` holds losses)."""
    message = no_op_message(list(config.logging.megatron_no_op_flags))
    for line in ([message] if message else []) + list(config.logging.megatron_notes):
        print_rank_0(line)
    if config.logging.logging_level is not None:  # --logging-level, as Megatron-LM's setup_logging
        logging.getLogger().setLevel(config.logging.logging_level)
    with exit_signal.handling(config.training.exit_signal_handler):  # SIGTERM / SIGINT / SIGUSR1: save, exit
        return _pretrain(config, datasets_provider, forward_step_func, tokenizer)


def _pretrain(config: TrainConfig, datasets_provider, forward_step_func, tokenizer) -> TrainState:
    trainer = Trainer(config, datasets_provider, forward_step_func, tokenizer)
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        print(parameter_count_line(sum(p.numel() for m in trainer.model for p in m.module.parameters()),
                                   ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()),
              flush=True)
    par = trainer.config.parallel
    print_rank_0(f" > model: {sum(p.numel() for m in trainer.model for p in m.module.parameters()):,} parameters "
                 f"on rank 0; TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
                 + (f"CP={par.context_parallel_size} " if par.context_parallel_size > 1 else "")
                 + f"DP={par.data_parallel_size}; {trainer.config.training.num_microbatches} micro-batches per "
                 f"iteration; device {trainer.device.type}")
    try:
        state = trainer.train()
        if state.exit_code:  # Megatron's sys.exit(exit_code): the launcher restarts on 16
            raise SystemExit(state.exit_code)
        return state
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()

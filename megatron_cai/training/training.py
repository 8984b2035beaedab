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
import math
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.datasets.device_prefetch import DevicePrefetcher
from ..core.distributed.comm_timing import timing_log_lines, timing_scalars
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
from . import divergence, startup_checks
from .arguments import rebuild_for_world_size
from .checkpoint import Checkpointer, check_run_dirs, iteration_dir, tp_layout
from .config import ArgumentError, TrainConfig, format_config
from .distill import setup_distillation
from .initialize import discover_env, initialize_distributed
from .logging import (
    TensorBoard,
    gpt_flops_per_iteration,
    parameter_count_line,
    print_rank_0,
    print_rank_last,
    training_log_line,
    validation_log_lines,
)
from .megatron_compat import no_op_message
from .step_readback import loss_means, read_step
from .train_extras import LogWindow, StepProfiler, WandbWriter, empty_device_cache, per_token_loss_step


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "consumed_train_samples": self.consumed_train_samples,
                "consumed_valid_samples": self.consumed_valid_samples,
                "skipped_iterations": self.skipped_iterations}


class _ExitSignal:
    """SIGTERM / SIGUSR1 (Slurm preemption) request a checkpoint and a clean exit."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                try:
                    signal.signal(sig, self._handler)
                except (ValueError, OSError):  # not the main thread
                    pass

    def _handler(self, signum, frame) -> None:
        self.received = True


@dataclass(frozen=True)
class StepResult:
    losses: dict[str, float]  # averaged over micro-batches and DP (last pipeline stage; {} elsewhere)
    grad_norm: float          # nan when some gradient was not finite
    finite: bool              # the optimizer stepped (False: skipped on every rank)
    exit_requested: bool      # some rank received an exit signal (read back with the step, see step_readback)


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
        self.env, self.device = initialize_distributed(config.parallel, config.training.seed, env)
        print_rank_0(format_config(config))
        check_run_dirs(config.checkpoint.load, config.checkpoint.save, config.checkpoint.ckpt_step)
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
        dp = ps.get_data_parallel_world_size()
        # each parameter's TP split, read before FSDP2 replaces the parameters (torch_dist checkpoints)
        param_layout = tp_layout(chunks)
        for m in chunks:
            m.to(self.device)
        if config.ddp.use_torch_fsdp2:  # FSDP2 over the DP mesh (core/distributed/fsdp.py)
            self.model = build_fsdp2(chunks, self.device, config.ddp, bf16=run.bf16, seed=run.seed + ps.get_rank())
        else:
            self.model = [DistributedDataParallel(m, build_reducer(config.ddp, ps.get_data_parallel_group(), dp,
                                                                   seed=run.seed + ps.get_rank(),
                                                                   timing_level=config.logging.timing_log_level),
                                                  config.ddp, device=self.device) for m in chunks]
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.grad_scaler = build_grad_scaler(run.loss_scale) if run.fp16 else None  # --fp16 loss scaling
        self.optimizer.grad_scaler = self.grad_scaler  # saved with the optimizer state, as in Megatron
        self.scheduler = OptimizerParamScheduler(config.scheduler)
        self.microbatches = NumMicroBatchesCalculator(  # --rampup-batch-size
            run.global_batch_size, run.micro_batch_size, config.parallel.data_parallel_size, run.rampup_batch_size,
            run.decrease_batch_size_if_needed)
        self.num_microbatches = run.num_microbatches  # this iteration's (changes during a batch ramp-up)
        self._log_memory("at start-up")
        self.state = TrainState()
        self.divergence = divergence.DivergenceMonitor(run.divergence, self.device)
        ckpt = config.checkpoint
        self.checkpointer = Checkpointer(config, self.model, self.optimizer, self.scheduler, param_layout,
                                         self.device)  # collective (--async-save with torch_dist)
        if ckpt.load:
            counters = self.checkpointer.load([m.reducer for m in self.model])  # either format
            if counters:
                self.state.iteration = counters["iteration"]
                self.state.consumed_train_samples = counters.get("consumed_train_samples", 0)
                self.state.consumed_valid_samples = counters.get("consumed_valid_samples", 0)
                self.state.skipped_iterations = counters.get("skipped_iterations", 0)
                print_rank_0(f" loaded checkpoint from {ckpt.load} at iteration {self.state.iteration}")
                self.divergence.last_good_checkpoint = iteration_dir(ckpt.load, self.state.iteration)
                self.divergence.load_state_dict(counters)
            elif not ckpt.finetune:
                print_rank_0(f" no checkpoint found in {ckpt.load}: starting from scratch")
        num_samples = self._num_samples()
        train_ds, valid_ds, test_ds = datasets_provider(config, self.tokenizer, num_samples)
        startup_checks.raise_if(startup_checks.empty_train_split(train_ds, run.train_iters, config.data.data_path,
                                                                 config.data.split))
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
        self.exit_signal = _ExitSignal(run.exit_signal_handler)
        self.forward_backward = get_forward_backward_func(config.parallel.pipeline_model_parallel_size, vpp)
        tp = config.parallel.tensor_model_parallel_size
        seq = model_cfg.seq_length // tp if model_cfg.sequence_parallel else model_cfg.seq_length
        self.tensor_shape = (run.micro_batch_size, seq, model_cfg.hidden_size)
        self._te_recipe = None

    # --------------------------------------------------------------------------------------- setup
    def _log_memory(self, when: str) -> dict:
        """Log the memory report (max over ranks, collective); return this rank's figures."""
        mine = memory_report(self.model, self.optimizer, self.device)
        print_rank_0(max_over_ranks(mine, self.device).line(f"max over ranks, {when}"))
        return mine.to_dict()

    def _num_samples(self) -> tuple[int, int, int]:
        run, log = self.config.training, self.config.logging
        gbs = run.global_batch_size
        evals = 0
        if log.eval_iters and log.eval_interval:
            evals = (run.train_iters // log.eval_interval + 1) * log.eval_iters
        return (run.train_iters * gbs, evals * gbs, log.eval_iters * gbs)

    def _loader(self, dataset, consumed: int, lookahead: bool | None = False) -> DevicePrefetcher | None:
        """``lookahead``: copy the next step's micro-batches during this one (None: on accelerators)."""
        from ..core.datasets.data_samplers import build_pretraining_data_loader

        if dataset is None:
            return None
        loader = build_pretraining_data_loader(dataset, consumed, self.config.training.micro_batch_size,
                                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
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
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.lse_stats.reset()
        self.microbatches.update(self.state.consumed_train_samples)
        self.num_microbatches = self.microbatches.num_microbatches
        batches = self._next_microbatches(self.train_iter)
        stats = self._run_schedule(batches, forward_only=False)
        for m in self.model:
            m.finish_grad_sync()
        level = self.config.training.empty_unused_memory_level
        if level >= 2:
            empty_device_cache(self.device)
        if self.grad_scaler is not None:
            self.optimizer.scale_grads(self.grad_scaler.inv_scale)
        read = read_step(self.optimizer.local_norm_sq(), stats, self.exit_signal.received, self.device)
        finite = math.isfinite(read.grad_norm)
        if finite:
            self.optimizer.clip(read.grad_norm, self.config.optimizer.clip_grad)
        if self.grad_scaler is not None:
            old_scale = self.grad_scaler.scale
            self.grad_scaler.update(not finite)
            if finite and self.grad_scaler.scale != old_scale:  # error feedback follows the loss scale
                for m in self.model:
                    m.reducer.rescale_feedback(self.grad_scaler.scale / old_scale)
        if self.divergence.cfg.check_for_nan_in_loss_and_grad:  # a non-finite loss on any rank skips the step
            finite = finite and not read.nonfinite_loss
        if finite:
            self.optimizer.step(self.scheduler.get_lr(), self.scheduler.get_lr(decoupled=True))
            self.scheduler.step(self.microbatches.running_global_batch_size)  # in samples, as Megatron's
        else:
            for m in self.model:
                m.reducer.step_skipped()
        if level >= 1:
            empty_device_cache(self.device)
        return StepResult(read.losses, read.grad_norm, finite, read.exit_requested)

    def _average_stats(self, stats: list[dict]) -> dict[str, float]:
        """Each statistic's mean over micro-batches and DP ranks, read back (validation)."""
        keys, means = loss_means(stats, ps.get_data_parallel_group(), ps.get_data_parallel_world_size())
        return dict(zip(keys, means.tolist())) if means is not None else {}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.valid_iter is None:
            return {}
        self.optimizer.finish_param_sync()
        for m in self.model:
            m.eval()
        totals: dict[str, float] = {}
        eval_iters = self.config.logging.eval_iters
        train_microbatches = self.num_microbatches
        self.num_microbatches = self.config.training.num_microbatches  # validation: the full global batch
        for _ in range(eval_iters):
            stats = self._average_stats(self._run_schedule(self._next_microbatches(self.valid_iter), True))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / eval_iters
            self.state.consumed_valid_samples += self.config.training.global_batch_size
            if self.config.training.empty_unused_memory_level >= 1:
                empty_device_cache(self.device)
        self.num_microbatches = train_microbatches
        for m in self.model:
            m.train()
        return totals

    # ---------------------------------------------------------------------------------------- loop
    def save(self) -> None:
        """Save now (collective), unless the state is not finite: the checkpointer picks format and mode."""
        if not self.config.checkpoint.save:
            return
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
        path = self.checkpointer.save(counters, [m.reducer.state_dict() for m in self.model])
        if path is None:  # --async-save: staged, written in the background, published by finalize_async_save
            print_rank_0(f" started an asynchronous save at iteration {self.state.iteration:7d} to "
                         f"{self.config.checkpoint.save}")
            return
        self._saved(path, self.state.iteration)

    def _saved(self, path: str, iteration: int) -> None:
        self.divergence.last_good_checkpoint = path
        print_rank_0(f" saved checkpoint at iteration {iteration:7d} to {self.config.checkpoint.save}")

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
        start_time = time.time()
        window = LogWindow()
        history = []
        if run.manual_gc:  # Megatron-LM's --manual-gc: no automatic collection; collect at fixed steps
            gc.disable()
            gc.collect()
        while st.iteration < run.train_iters:
            self.profiler.before_step(st.iteration)
            bytes_before = sum(m.grad_comm_bytes for m in self.model)
            lr = self.scheduler.get_lr()
            step = self.train_step()
            losses, grad_norm, finite = step.losses, step.grad_norm, step.finite
            st.iteration += 1
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
            if self.tb.writer is not None and st.iteration % log.tensorboard_log_interval == 0:
                self._per_iteration_scalars()
            self.wandb.log({**losses, "learning-rate": lr, "grad-norm": grad_norm, "loss-scale": self._loss_scale()},
                           st.iteration)
            if st.iteration % log.log_interval == 0:
                self._log(window, lr, grad_norm, comm_bytes)
                window = LogWindow()
            if log.eval_interval and st.iteration % log.eval_interval == 0 and self.valid_iter is not None:
                val = self.evaluate()
                if val:
                    st.extra.setdefault("validation", []).append({"iteration": st.iteration, **val})
                    print_rank_last(validation_log_lines(st.iteration, val))
                    self._validation_scalars(val)
            if save_interval and st.iteration % save_interval == 0:
                self.save()
            if step.exit_requested:
                self.save()  # the checkpoint first: a failing log write must not lose it
                print_rank_0(f" exit signal received at iteration {st.iteration}: saved and exiting")
                break
            if run.exit_interval and st.iteration % run.exit_interval == 0:
                self.save()
                print_rank_0(f" exiting at iteration {st.iteration} (--exit-interval)")
                break
            if run.exit_duration_in_mins and (time.time() - start_time) / 60 > run.exit_duration_in_mins:
                self.save()
                print_rank_0(f" exiting after {run.exit_duration_in_mins} minutes (--exit-duration-in-mins)")
                break
        else:
            if self.config.checkpoint.save and not (save_interval and st.iteration % save_interval == 0):
                self.save()
        if "memory" not in st.extra:  # no iteration logged
            st.extra["memory"] = self._log_memory("at the end of training")
        self.finalize_async_save(blocking=True)  # exit paths and the end of training wait for the write
        self.optimizer.finish_param_sync()
        self.profiler.close()
        if run.manual_gc:
            gc.enable()
        st.extra["history"] = history
        self.tb.close()
        self.wandb.close()
        return st

    def _loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without a loss scaler, as Megatron-LM logs it for bf16 / fp32)."""
        scaler = getattr(self.optimizer, "grad_scaler", None)
        return float(scaler.scale) if scaler is not None else 1.0

    def _log(self, window: LogWindow, lr: float, grad_norm: float, comm_bytes: int) -> None:
        run, log, st = self.config.training, self.config.logging, self.state
        # the read waits for the queued work, so the window's time below covers it
        # Megatron-LM's memory report comes with the first log line; st.extra keeps this rank's figures
        mine = memory_report(self.model, self.optimizer, self.device) if "memory" not in st.extra else None
        extra, most = self._log_readback(mine)
        if mine is not None:
            print_rank_0(most.line("max over ranks, at the first log"))
            st.extra["memory"] = mine.to_dict()
        elapsed = window.seconds_per_iteration()
        batch = self.microbatches.running_global_batch_size  # this iteration's (--rampup-batch-size)
        tps = batch * self.config.model.seq_length / max(elapsed, 1e-9)
        throughput = None
        if log.log_throughput:
            flops = gpt_flops_per_iteration(self.config.model, run.global_batch_size)
            throughput = flops / (elapsed * 1e12 * self.config.parallel.world_size)
        line_extra = None
        if extra:
            line_extra = {"attention lse mean": sum(v for k, v in extra.items() if k.endswith("-mean"))
                          / (len(extra) // 2),
                          "attention lse max": max(v for k, v in extra.items() if k.endswith("-max"))}
        avg = window.averages()
        print_rank_last(training_log_line(
            st.iteration, run.train_iters, st.consumed_train_samples, elapsed * 1000, lr, batch,
            avg, grad_norm, window.skipped, tps, grad_comm_bytes=comm_bytes, extra=line_extra,
            loss_scale=self._loss_scale(), nan_iters=window.nan, throughput_tflops=throughput))
        scalars = {**{k.replace(" ", "-"): v for k, v in avg.items()}, "learning-rate": lr, "grad-norm": grad_norm,
                   "tokens-per-second": tps, "grad-comm-bytes": comm_bytes, **extra}
        if log.log_timers_to_tensorboard:
            scalars["iteration-time"] = elapsed
            if throughput is not None:
                scalars["throughput"] = throughput
        self.tb.scalars(scalars, st.iteration)
        if log.timing_log_level:  # gradient-reduction phase timers (--timing-log-level)
            timings = [m.reducer.timers.collect() for m in self.model]
            for line in timing_log_lines(st.iteration, timings, log.timing_log_level, window.iterations):
                print_rank_last(line)
            if log.log_timers_to_tensorboard:
                self.tb.scalars(timing_scalars(timings, window.iterations), st.iteration)

    def _per_iteration_scalars(self) -> None:
        """Megatron-LM's per-iteration TensorBoard scalars (every --tensorboard-log-interval iterations)."""
        log = self.config.logging
        values = {"batch-size": self.config.training.global_batch_size}
        if log.log_loss_scale_to_tensorboard:
            values["loss-scale"] = self._loss_scale()
        if log.log_world_size_to_tensorboard:
            values["world-size"] = self.config.parallel.world_size
        self.tb.scalars(values, self.state.iteration)

    def _validation_scalars(self, val: dict[str, float]) -> None:
        log, it = self.config.logging, self.state.iteration
        values = {f"validation/{k.replace(' ', '-')}": v for k, v in val.items()}
        for k, v in val.items():
            values[f"{k} validation"] = v
            if log.log_validation_ppl_to_tensorboard:
                values[f"{k} validation ppl"] = math.exp(min(20.0, v))
        self.tb.scalars(values, it)
        if log.log_validation_ppl_to_tensorboard:
            self.tb.scalars({f"{k} validation ppl vs samples": math.exp(min(20.0, v)) for k, v in val.items()},
                            self.state.consumed_train_samples)
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
        if ps.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        values = torch.cat([sums.to(torch.float64).flatten(), maxes]).tolist()
        out = {}
        for layer in range(layers):
            total, ranks, mx = values[2 * layer], values[2 * layer + 1], values[2 * layers + layer]
            if ranks > 0:
                out[f"attention-lse/layer{layer}-mean"] = total / ranks
                out[f"attention-lse/layer{layer}-max"] = mx
        return out, memory.from_values(values[3 * layers:]) if memory is not None else None


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
    if message:
        print_rank_0(message)
    trainer = Trainer(config, datasets_provider, forward_step_func, tokenizer)
    if ps.get_data_parallel_rank() == 0:
        print(parameter_count_line(sum(p.numel() for m in trainer.model for p in m.module.parameters()),
                                   ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()),
              flush=True)
    par = trainer.config.parallel
    print_rank_0(f" > model: {sum(p.numel() for m in trainer.model for p in m.module.parameters()):,} parameters "
                 f"on rank 0; TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
                 f"DP={par.data_parallel_size}; {trainer.config.training.num_microbatches} micro-batches per "
                 f"iteration; device {trainer.device.type}")
    return trainer.train()

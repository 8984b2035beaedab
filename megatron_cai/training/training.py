"""The training loop: set up model, optimizer and data, then iterate, log, evaluate and checkpoint.

``pretrain(args, datasets_provider, forward_step_func)`` is what ``pretrain_gpt.py`` calls. One code
path serves a single CPU process and TP x PP x DP runs on GPU clusters.
"""
from __future__ import annotations

import contextlib
import gc
import math
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.distributed.ddp import DistributedDataParallel
from ..core.distributed.reducers import build_reducer
from ..core.models.gpt.config import GPTConfig
from ..core.models.gpt.model import build_model_chunks
from ..core.optimizer.lr_scheduler import OptimizerParamScheduler
from ..core.optimizer.optimizer import DistributedAdamW
from ..core.pipeline_parallel.schedules import get_forward_backward_func
from ..core.transformer.self_attention import SelfAttention
from . import checkpointing
from .arguments import ArgumentError, padded_vocab_size
from .distill import setup_distillation
from .initialize import initialize_distributed
from .logging import (
    TensorBoard,
    gpt_flops_per_iteration,
    parameter_count_line,
    print_rank_0,
    print_rank_last,
    training_log_line,
    validation_log_lines,
)
from .megatron_compat import attention_backend_for, no_op_message
from .train_extras import LogWindow, StepProfiler, WandbWriter, empty_device_cache, per_token_loss_step


def config_from_args(args, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size),
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, qk_layernorm=args.qk_layernorm, apply_layernorm_1p=args.apply_layernorm_1p,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, activation=args.activation,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        attention_backend=attention_backend_for(args.attention_backend), attention_zreg_coeff=args.attention_zreg_coeff,
        output_zreg_coeff=args.output_zreg_coeff, window_size=args.window_size,
        qat=qat_settings(args))


def qat_settings(args) -> dict:
    if getattr(args, "qat", "none") == "none":
        return {}
    settings = {"fmt": args.qat, "clamp": args.qat_clamp, "alpha": args.qat_clamp_alpha,
                "static_value": args.qat_static_clamp, "fp8_format": args.fp8_format,
                "granularity": getattr(args, "qat_granularity", "tensor")}
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        settings["gemm_backend"] = "transformer_engine"
    return settings


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

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if ps.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Trainer:
    """Holds everything one run needs; ``train()`` runs the loop."""

    def __init__(self, args, datasets_provider, forward_step_func, tokenizer=None) -> None:
        self.args = args
        self.env, self.device = initialize_distributed(args)
        if getattr(args, "transformer_impl", "local") == "transformer_engine" and self.device.type != "cuda":
            raise ArgumentError(f"--transformer-impl transformer_engine runs on CUDA only; this run is on "
                                f"{self.device.type}")
        self.tokenizer = tokenizer
        vocab = tokenizer.vocab_size if tokenizer is not None else args.vocab_size
        self.config = config_from_args(args, vocab)
        self.forward_step_func = forward_step_func
        vpp = args.virtual_pipeline_model_parallel_size
        chunks = build_model_chunks(self.config, args.seed, vpp)
        self._apply_model_options(chunks)
        kind = "squinch" if args.squinch else ("reducescatter" if args.use_distributed_optimizer else "allreduce")
        grad_dtype = torch.bfloat16 if args.grad_reduce_in_bf16 else torch.float32
        dp = ps.get_data_parallel_world_size()
        bucket_size = args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
        self.model = []
        for m in chunks:
            m.to(self.device)
            reducer = build_reducer(kind, ps.get_data_parallel_group(), dp, **self._reducer_kwargs())
            self.model.append(DistributedDataParallel(m, reducer, device=self.device, grad_dtype=grad_dtype,
                                                      bucket_size=bucket_size,
                                                      overlap_grad_reduce=args.overlap_grad_reduce))
        self.optimizer = DistributedAdamW(self.model, lr=args.lr, weight_decay=args.weight_decay,
                                          betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                          distributed=args.use_distributed_optimizer, kind=args.optimizer,
                                          sgd_momentum=args.sgd_momentum,
                                          overlap_param_gather=args.overlap_param_gather)
        self.scheduler = OptimizerParamScheduler(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                                                 args.lr_decay_style)
        self.state = TrainState()
        if args.load:
            counters = checkpointing.load_checkpoint(
                args.load, self.model, self.optimizer, self.scheduler, self.config,
                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, finetune=args.finetune,
                step=args.ckpt_step, exit_on_missing=args.exit_on_missing_checkpoint,
                reducers=[m.reducer for m in self.model])
            if counters:
                self.state.iteration = counters["iteration"]
                self.state.consumed_train_samples = counters.get("consumed_train_samples", 0)
                self.state.consumed_valid_samples = counters.get("consumed_valid_samples", 0)
                self.state.skipped_iterations = counters.get("skipped_iterations", 0)
                print_rank_0(f" loaded checkpoint from {args.load} at iteration {self.state.iteration}")
            elif not args.finetune:
                print_rank_0(f" no checkpoint found in {args.load}: starting from scratch")
        train_ds, valid_ds, test_ds = datasets_provider(args, self.tokenizer, self._num_samples())
        train_ds = setup_distillation(args, self.config, self.device, train_ds)  # teacher samples / teacher
        self.train_ds, self.valid_ds, self.test_ds = train_ds, valid_ds, test_ds
        self.train_iter = self._loader(train_ds, self.state.consumed_train_samples)
        self.valid_iter = self._loader(valid_ds, self.state.consumed_valid_samples)
        self.tb = TensorBoard(args.tensorboard_dir, args.tensorboard_queue_size)
        self.wandb = WandbWriter(args)
        self.profiler = StepProfiler(args, ps.get_rank())
        self.exit_signal = _ExitSignal(args.exit_signal_handler)
        self.forward_backward = get_forward_backward_func(args.pipeline_model_parallel_size, vpp)
        seq = args.seq_length // args.tensor_model_parallel_size if self.config.sequence_parallel else args.seq_length
        self.tensor_shape = (args.micro_batch_size, seq, args.hidden_size)

    # --------------------------------------------------------------------------------------- setup
    def _apply_model_options(self, chunks) -> None:
        self._attention = [mod for m in chunks for mod in m.modules() if isinstance(mod, SelfAttention)]
        for mod in self._attention:
            mod.zreg_scale = 1.0 / self.args.num_microbatches
        if self.config.qat:
            from ..core.quantization.qat_linear import apply_qat

            for m in chunks:
                apply_qat(m, self.config.qat)

    def _reducer_kwargs(self) -> dict:
        a = self.args
        if not a.squinch:
            return {}
        return {"error_feedback": a.squinch_error_feedback, "stochastic": a.squinch_stochastic_rounding,
                "hierarchical": a.squinch_hierarchical, "shard_only": a.use_distributed_optimizer,
                "seed": a.seed + ps.get_rank()}

    def _num_samples(self) -> tuple[int, int, int]:
        a = self.args
        evals = (a.train_iters // a.eval_interval + 1) * a.eval_iters if a.eval_iters and a.eval_interval else 0
        return (a.train_iters * a.global_batch_size, evals * a.global_batch_size, a.eval_iters * a.global_batch_size)

    def _loader(self, dataset, consumed: int):
        from ..core.datasets.data_samplers import build_pretraining_data_loader

        if dataset is None:
            return None
        loader = build_pretraining_data_loader(dataset, consumed, self.args.micro_batch_size,
                                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                               num_workers=self.args.num_workers)
        return iter(loader)

    def _next_microbatches(self, iterator) -> list[dict]:
        batches = []
        for _ in range(self.args.num_microbatches):
            try:
                batch = next(iterator)
            except StopIteration:
                raise RuntimeError("the dataset ran out of samples; it was built for fewer iterations than "
                                   "requested (rebuild the index cache or lower --train-iters)") from None
            batches.append({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
        return batches

    def _forward_context(self):
        autocast = device_mod.autocast(self.device, self.args.bf16)
        if self.config.qat.get("gemm_backend") != "transformer_engine":
            return autocast
        from ..core.quantization.gemm_backends import te_fp8_autocast, te_fp8_recipe

        if not hasattr(self, "_te_recipe"):  # each rank scales by its own amax: no amax collective
            self._te_recipe = te_fp8_recipe(self.args.fp8_format, reduce_amax=False)
        stack = contextlib.ExitStack()
        stack.enter_context(autocast)
        stack.enter_context(te_fp8_autocast(True, recipe=self._te_recipe))
        return stack

    def _run_schedule(self, batches: list[dict], forward_only: bool) -> list[dict]:
        iters = [iter(batches) for _ in self.model]
        step_func = self.forward_step_func
        if self.args.calculate_per_token_loss:
            step_func, iters = per_token_loss_step(step_func, batches, self.model, self.args.num_microbatches,
                                                   self.device)
        return self.forward_backward(step_func, iters, self.model, self.args.num_microbatches,
                                     tensor_shape=self.tensor_shape, dtype=torch.float32,
                                     forward_only=forward_only, forward_context=self._forward_context)

    # ---------------------------------------------------------------------------------------- step
    def train_step(self) -> tuple[dict[str, float], float, bool]:
        """One iteration: forward/backward over the micro-batches, grad sync, clip, update."""
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        for mod in self._attention:
            mod.last_lse_stats = None
        batches = self._next_microbatches(self.train_iter)
        stats = self._run_schedule(batches, forward_only=False)
        for m in self.model:
            m.finish_grad_sync()
        if self.args.empty_unused_memory_level >= 2:
            empty_device_cache(self.device)
        grad_norm, finite = self.optimizer.clip_and_check(self.args.clip_grad)
        if finite:
            self.optimizer.step(self.scheduler.get_lr())
            self.scheduler.step()
        else:
            for m in self.model:
                m.reducer.step_skipped()
        if self.args.empty_unused_memory_level >= 1:
            empty_device_cache(self.device)
        return self._average_stats(stats), grad_norm, finite

    def _average_stats(self, stats: list[dict]) -> dict[str, float]:
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        keys = stats[0].keys() if stats else []
        vec = torch.stack([torch.stack([s[k].float() for s in stats]).mean() for k in keys]) if keys else None
        if vec is None:
            return {}
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(vec, group=ps.get_data_parallel_group())
            vec /= ps.get_data_parallel_world_size()
        return {k: v.item() for k, v in zip(keys, vec)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.valid_iter is None:
            return {}
        self.optimizer.finish_param_sync()
        for m in self.model:
            m.eval()
        totals: dict[str, float] = {}
        for _ in range(self.args.eval_iters):
            stats = self._average_stats(self._run_schedule(self._next_microbatches(self.valid_iter), True))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / self.args.eval_iters
            self.state.consumed_valid_samples += self.args.global_batch_size
            if self.args.empty_unused_memory_level >= 1:
                empty_device_cache(self.device)
        for m in self.model:
            m.train()
        return totals

    # ---------------------------------------------------------------------------------------- loop
    def save(self) -> None:
        a = self.args
        if not a.save:
            return
        self.optimizer.finish_param_sync()
        tok_files = [a.tokenizer_model] if a.tokenizer_model else []
        checkpointing.save_checkpoint(a.save, self.state.iteration, self.model, self.optimizer, self.scheduler,
                                      self.config, {k: v for k, v in vars(a).items()}, self.state.to_dict(),
                                      reducer_states=[m.reducer.state_dict() for m in self.model],
                                      save_optim=not a.no_save_optim, tokenizer_files=tok_files)
        print_rank_0(f" saved checkpoint at iteration {self.state.iteration:7d} to {a.save}")

    def train(self) -> TrainState:
        a, st = self.args, self.state
        start_time = time.time()
        window = LogWindow()
        history = []
        if a.manual_gc:  # Megatron-LM's --manual-gc: no automatic collection; collect at fixed steps
            gc.disable()
            gc.collect()
        while st.iteration < a.train_iters:
            self.profiler.before_step(st.iteration)
            bytes_before = sum(m.grad_comm_bytes for m in self.model)
            lr = self.scheduler.get_lr()
            step_start = time.time()
            losses, grad_norm, finite = self.train_step()
            st.iteration += 1
            st.consumed_train_samples += a.global_batch_size
            self.profiler.after_step(st.iteration)
            if not finite:
                st.skipped_iterations += 1
                print_rank_last(f" iteration {st.iteration}: non-finite gradient (grad norm {grad_norm}) on some "
                                f"rank; skipped the optimizer step on every rank")
            comm_bytes = sum(m.grad_comm_bytes for m in self.model) - bytes_before
            window.add(losses, skipped=not finite)
            history.append({**losses, "grad norm": grad_norm, "lr": lr, "skipped": not finite,
                            "grad comm bytes": comm_bytes})
            if a.manual_gc and a.manual_gc_interval and st.iteration % a.manual_gc_interval == 0:
                gc.collect()
            if self.tb.writer is not None and st.iteration % a.tensorboard_log_interval == 0:
                self._per_iteration_scalars(lr, grad_norm)
            self.wandb.log({**losses, "learning-rate": lr, "grad-norm": grad_norm, "loss-scale": self._loss_scale(),
                            "step-time": time.time() - step_start}, st.iteration)
            if st.iteration % a.log_interval == 0:
                self._log(window, lr, grad_norm, comm_bytes)
                window = LogWindow()
            if a.eval_interval and st.iteration % a.eval_interval == 0 and self.valid_iter is not None:
                val = self.evaluate()
                if val:
                    st.extra.setdefault("validation", []).append({"iteration": st.iteration, **val})
                    print_rank_last(validation_log_lines(st.iteration, val))
                    self._validation_scalars(val)
            if a.save_interval and st.iteration % a.save_interval == 0:
                self.save()
            if self.exit_signal.any_rank(self.device):
                print_rank_0(f" exit signal received at iteration {st.iteration}: saving and exiting")
                self.save()
                break
            if a.exit_interval and st.iteration % a.exit_interval == 0:
                self.save()
                print_rank_0(f" exiting at iteration {st.iteration} (--exit-interval)")
                break
            if a.exit_duration_in_mins and (time.time() - start_time) / 60 > a.exit_duration_in_mins:
                self.save()
                print_rank_0(f" exiting after {a.exit_duration_in_mins} minutes (--exit-duration-in-mins)")
                break
        else:
            if a.save and not (a.save_interval and st.iteration % a.save_interval == 0):
                self.save()
        self.optimizer.finish_param_sync()
        self.profiler.close()
        if a.manual_gc:
            gc.enable()
        st.extra["history"] = history
        self.tb.close()
        self.wandb.close()
        return st

    def _loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without a loss scaler, as Megatron-LM logs it for bf16 / fp32)."""
        scaler = getattr(self.optimizer, "grad_scaler", None) or getattr(self, "grad_scaler", None)
        return float(getattr(scaler, "scale", 1.0)) if scaler is not None else 1.0

    def _log(self, window: LogWindow, lr: float, grad_norm: float, comm_bytes: int) -> None:
        a, st = self.args, self.state
        device_mod.synchronize(self.device)
        elapsed = window.seconds_per_iteration()
        tps = a.global_batch_size * a.seq_length / max(elapsed, 1e-9)
        throughput = None
        if a.log_throughput:
            flops = gpt_flops_per_iteration(a, a.global_batch_size, self.config.padded_vocab_size)
            throughput = flops / (elapsed * 1e12 * a.world_size)
        extra = self._lse_stats()
        line_extra = None
        if extra:
            line_extra = {"attention lse mean": sum(v for k, v in extra.items() if k.endswith("-mean"))
                          / (len(extra) // 2),
                          "attention lse max": max(v for k, v in extra.items() if k.endswith("-max"))}
        avg = window.averages()
        print_rank_last(training_log_line(
            st.iteration, a.train_iters, st.consumed_train_samples, elapsed * 1000, lr, a.global_batch_size, avg,
            grad_norm, window.skipped, tps, grad_comm_bytes=comm_bytes, extra=line_extra,
            loss_scale=self._loss_scale(), nan_iters=window.nan, throughput_tflops=throughput))
        scalars = {**{k.replace(" ", "-"): v for k, v in avg.items()}, "learning-rate": lr, "grad-norm": grad_norm,
                   "tokens-per-second": tps, "grad-comm-bytes": comm_bytes, **extra}
        if a.log_timers_to_tensorboard:
            scalars["iteration-time"] = elapsed
            if throughput is not None:
                scalars["throughput"] = throughput
        self.tb.scalars(scalars, st.iteration)

    def _per_iteration_scalars(self, lr: float, grad_norm: float) -> None:
        """Megatron-LM's per-iteration TensorBoard scalars (every --tensorboard-log-interval iterations)."""
        a, it = self.args, self.state.iteration
        values = {"batch-size": a.global_batch_size}
        if a.log_loss_scale_to_tensorboard:
            values["loss-scale"] = self._loss_scale()
        if a.log_world_size_to_tensorboard:
            values["world-size"] = a.world_size
        self.tb.scalars(values, it)

    def _validation_scalars(self, val: dict[str, float]) -> None:
        a, it = self.args, self.state.iteration
        values = {f"validation/{k.replace(' ', '-')}": v for k, v in val.items()}
        for k, v in val.items():
            values[f"{k} validation"] = v
            if a.log_validation_ppl_to_tensorboard:
                values[f"{k} validation ppl"] = math.exp(min(20.0, v))
        self.tb.scalars(values, it)
        if a.log_validation_ppl_to_tensorboard:
            self.tb.scalars({f"{k} validation ppl vs samples": math.exp(min(20.0, v)) for k, v in val.items()},
                            self.state.consumed_train_samples)
        self.wandb.log({f"{k} validation": v for k, v in val.items()}, it)

    def _lse_stats(self) -> dict[str, float]:
        """Attention lse mean / max per layer in this iteration's last micro-batch (every rank calls it).

        Each layer's stats come from the ranks that hold it (its pipeline stage, every TP/DP rank): the
        mean is the mean of those ranks' means (equal row counts per rank), the max their max.
        """
        layers = self.config.num_layers
        stats = torch.zeros(layers, 3, device=self.device)  # [sum of means, ranks, max]
        stats[:, 2] = float("-inf")
        for mod in self._attention:
            if mod.last_lse_stats is not None:
                mean, mx = mod.last_lse_stats.detach().float().to(self.device)
                stats[mod.layer_number] = torch.stack([stats[mod.layer_number, 0] + mean,
                                                       stats[mod.layer_number, 1] + 1,
                                                       torch.maximum(stats[mod.layer_number, 2], mx)])
        if ps.get_world_size() > 1:
            sums, maxes = stats[:, :2].contiguous(), stats[:, 2].contiguous()
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            stats = torch.cat([sums, maxes.unsqueeze(1)], dim=1)
        out = {}
        for layer, (total, ranks, mx) in enumerate(stats.cpu().tolist()):
            if ranks > 0:
                out[f"attention-lse/layer{layer}-mean"] = total / ranks
                out[f"attention-lse/layer{layer}-max"] = mx
        return out


def pretrain(args, datasets_provider, forward_step_func, tokenizer=None) -> TrainState:
    """Build a Trainer and run it; returns the final TrainState (its ``extra['history']`` holds losses)."""
    message = no_op_message(getattr(args, "megatron_no_op_flags", []))
    if message:
        print_rank_0(message)
    trainer = Trainer(args, datasets_provider, forward_step_func, tokenizer)
    if ps.get_data_parallel_rank() == 0:
        print(parameter_count_line(sum(p.numel() for m in trainer.model for p in m.module.parameters()),
                                   ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()),
              flush=True)
    print_rank_0(f" > model: {sum(p.numel() for m in trainer.model for p in m.module.parameters()):,} parameters "
                 f"on rank 0; TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
                 f"DP={args.data_parallel_size}; {args.num_microbatches} micro-batches per iteration; "
                 f"device {trainer.device.type}")
    return trainer.train()

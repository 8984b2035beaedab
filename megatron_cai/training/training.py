"""The training loop: set up model, optimizer and data, then iterate, log, evaluate and checkpoint.

``pretrain(args, datasets_provider, forward_step_func)`` is what ``pretrain_gpt.py`` calls. One code
path serves a single CPU process and TP x PP x DP runs on GPU clusters.
"""
from __future__ import annotations

import contextlib
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
from ..core.num_microbatches_calculator import NumMicroBatchesCalculator
from ..core.optimizer.grad_scaler import LossScaleConfig, build_grad_scaler
from ..core.optimizer.lr_scheduler import OptimizerParamScheduler, lr_schedule_config_from_args
from ..core.optimizer.optimizer import DistributedAdamW
from ..core.pipeline_parallel.schedules import get_forward_backward_func
from ..core.transformer.self_attention import SelfAttention
from . import checkpointing
from .arguments import ArgumentError, padded_vocab_size
from .distill import setup_distillation
from .initialize import initialize_distributed
from .logging import TensorBoard, print_rank_0, print_rank_last, training_log_line, validation_log_lines


def config_from_args(args, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size),
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, activation=args.activation,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        attention_backend=args.attention_backend, attention_zreg_coeff=args.attention_zreg_coeff,
        output_zreg_coeff=args.output_zreg_coeff, window_size=args.window_size,
        qat=qat_settings(args))


def loss_scale_config(args) -> LossScaleConfig:
    return LossScaleConfig(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                           min_loss_scale=args.min_loss_scale, loss_scale_window=int(args.loss_scale_window),
                           hysteresis=args.hysteresis)


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
                                          distributed=args.use_distributed_optimizer)
        self.grad_scaler = build_grad_scaler(loss_scale_config(args)) if getattr(args, "fp16", False) else None
        self.optimizer.grad_scaler = self.grad_scaler  # saved with the optimizer state, as in Megatron
        self.scheduler = OptimizerParamScheduler(lr_schedule_config_from_args(args))
        self.state = TrainState()
        self.microbatches = NumMicroBatchesCalculator(  # --rampup-batch-size (validated in arguments)
            args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
            getattr(args, "rampup_batch_size", None), getattr(args, "decrease_batch_size_if_needed", False))
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
        self.tb = TensorBoard(args.tensorboard_dir)
        self.exit_signal = _ExitSignal(args.exit_signal_handler)
        self.forward_backward = get_forward_backward_func(args.pipeline_model_parallel_size, vpp)
        seq = args.seq_length // args.tensor_model_parallel_size if self.config.sequence_parallel else args.seq_length
        self.tensor_shape = (args.micro_batch_size, seq, args.hidden_size)

    # --------------------------------------------------------------------------------------- setup
    def _apply_model_options(self, chunks) -> None:
        self._attention = [mod for m in chunks for mod in m.modules() if isinstance(mod, SelfAttention)]
        for m in chunks:
            m.decoder.recompute = self.args.recompute_granularity == "full"
            for layer in (getattr(m, "embedding", None), getattr(m, "output_layer", None)):  # --decoupled-lr
                weight = getattr(getattr(layer, "word_embeddings", layer), "weight", None)
                if weight is not None:
                    weight.is_embedding_or_output_parameter = True
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
        fp16 = getattr(self.args, "fp16", False)
        autocast = device_mod.autocast(self.device, self.args.bf16 or fp16, torch.float16 if fp16 else torch.bfloat16)
        if self.config.qat.get("gemm_backend") != "transformer_engine":
            return autocast
        from ..core.quantization.gemm_backends import te_fp8_autocast, te_fp8_recipe

        if not hasattr(self, "_te_recipe"):  # each rank scales by its own amax: no amax collective
            self._te_recipe = te_fp8_recipe(self.args.fp8_format, reduce_amax=False)
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
        return self.forward_backward(step_func, iters, self.model, self.args.num_microbatches,
                                     tensor_shape=self.tensor_shape, dtype=torch.float32,
                                     forward_only=forward_only, forward_context=self._forward_context)

    # ---------------------------------------------------------------------------------------- step
    def train_step(self) -> tuple[dict[str, float], float, bool]:
        """One iteration: forward/backward over the micro-batches, grad sync, clip, update."""
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.microbatches.update(self.state.consumed_train_samples)
        self.args.num_microbatches = self.microbatches.num_microbatches
        for mod in self._attention:
            mod.last_lse_stats = None  # the injected Z-Reg gradient is scaled like the loss
            mod.zreg_scale = (self.grad_scaler.scale if self.grad_scaler else 1.0) / self.args.num_microbatches
        batches = self._next_microbatches(self.train_iter)
        stats = self._run_schedule(batches, forward_only=False)
        for m in self.model:
            m.finish_grad_sync()
        if self.grad_scaler is not None:
            self.optimizer.scale_grads(self.grad_scaler.inv_scale)
        grad_norm, finite = self.optimizer.clip_and_check(self.args.clip_grad)
        if self.grad_scaler is not None:
            self.grad_scaler.update(not finite)
        if finite:
            self.optimizer.step(self.scheduler.get_lr(), self.scheduler.get_lr(decoupled=True))
            self.scheduler.step(self.microbatches.running_global_batch_size)  # in samples, as Megatron's
        else:
            for m in self.model:
                m.reducer.step_skipped()
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
        for m in self.model:
            m.eval()
        totals: dict[str, float] = {}
        train_microbatches = self.args.num_microbatches  # validation uses the full global batch
        self.args.num_microbatches = self.args.global_batch_size // (self.args.micro_batch_size
                                                                     * self.args.data_parallel_size)
        for _ in range(self.args.eval_iters):
            stats = self._average_stats(self._run_schedule(self._next_microbatches(self.valid_iter), True))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / self.args.eval_iters
            self.state.consumed_valid_samples += self.args.global_batch_size
        self.args.num_microbatches = train_microbatches
        for m in self.model:
            m.train()
        return totals

    # ---------------------------------------------------------------------------------------- loop
    def save(self) -> None:
        a = self.args
        if not a.save:
            return
        tok_files = [a.tokenizer_model] if a.tokenizer_model else []
        checkpointing.save_checkpoint(a.save, self.state.iteration, self.model, self.optimizer, self.scheduler,
                                      self.config, {k: v for k, v in vars(a).items()}, self.state.to_dict(),
                                      reducer_states=[m.reducer.state_dict() for m in self.model],
                                      save_optim=not a.no_save_optim, tokenizer_files=tok_files)
        print_rank_0(f" saved checkpoint at iteration {self.state.iteration:7d} to {a.save}")

    def train(self) -> TrainState:
        a, st = self.args, self.state
        start_time = time.time()
        window_time, window_iters = time.time(), 0
        window_losses: dict[str, float] = {}
        history = []
        while st.iteration < a.train_iters:
            bytes_before = sum(m.grad_comm_bytes for m in self.model)
            lr = self.scheduler.get_lr()
            losses, grad_norm, finite = self.train_step()
            st.iteration += 1
            st.consumed_train_samples += self.microbatches.running_global_batch_size
            if not finite:
                st.skipped_iterations += 1
            if not finite and self.grad_scaler is None:  # an fp16 overflow is only counted, as in Megatron
                print_rank_last(f" iteration {st.iteration}: non-finite gradient (grad norm {grad_norm}) on some "
                                f"rank; skipped the optimizer step on every rank")
            comm_bytes = sum(m.grad_comm_bytes for m in self.model) - bytes_before
            for k, v in losses.items():
                window_losses[k] = window_losses.get(k, 0.0) + v
            window_iters += 1
            history.append({**losses, "grad norm": grad_norm, "lr": lr, "skipped": not finite,
                            "grad comm bytes": comm_bytes,
                            "global batch size": self.microbatches.running_global_batch_size,
                            **({"loss scale": self.grad_scaler.scale} if self.grad_scaler else {})})
            if st.iteration % a.log_interval == 0:
                device_mod.synchronize(self.device)
                elapsed = (time.time() - window_time) / window_iters
                avg = {k: v / window_iters for k, v in window_losses.items()}
                batch = self.microbatches.running_global_batch_size
                tps = batch * a.seq_length / max(elapsed, 1e-9)
                extra = self._lse_stats()
                line_extra = None
                if extra:
                    line_extra = {"attention lse mean": sum(v for k, v in extra.items() if k.endswith("-mean"))
                                  / (len(extra) // 2),
                                  "attention lse max": max(v for k, v in extra.items() if k.endswith("-max"))}
                print_rank_last(training_log_line(
                    st.iteration, a.train_iters, st.consumed_train_samples, elapsed * 1000, lr,
                    batch, avg, grad_norm, st.skipped_iterations, tps,
                    grad_comm_bytes=comm_bytes, extra=line_extra))
                self.tb.scalars({**{k.replace(" ", "-"): v for k, v in avg.items()}, "learning-rate": lr,
                                 "grad-norm": grad_norm, "tokens-per-second": tps,
                                 "grad-comm-bytes": comm_bytes, **extra,
                                 **({"loss-scale": self.grad_scaler.scale} if self.grad_scaler else {})},
                                st.iteration)
                window_time, window_iters, window_losses = time.time(), 0, {}
            if a.eval_interval and st.iteration % a.eval_interval == 0 and self.valid_iter is not None:
                val = self.evaluate()
                if val:
                    st.extra.setdefault("validation", []).append({"iteration": st.iteration, **val})
                    print_rank_last(validation_log_lines(st.iteration, val))
                    self.tb.scalars({f"validation/{k.replace(' ', '-')}": v for k, v in val.items()}, st.iteration)
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
        st.extra["history"] = history
        self.tb.close()
        return st

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
    trainer = Trainer(args, datasets_provider, forward_step_func, tokenizer)
    print_rank_0(f" > model: {sum(p.numel() for m in trainer.model for p in m.module.parameters()):,} parameters "
                 f"on rank 0; TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
                 f"DP={args.data_parallel_size}; {args.num_microbatches} micro-batches per iteration; "
                 f"device {trainer.device.type}")
    return trainer.train()

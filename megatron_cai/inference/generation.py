"""Autoregressive sampling from a GPTModel with a KV cache (greedy, temperature, top-k, top-p).

``generate(model, prompt, max_new_tokens, ...)`` runs one prefill forward over the prompt and then one
single-token forward per new token, reusing the keys and values of earlier tokens (``KVCache``). The
three steps are separate functions (``prefill``, ``decode_step``, ``sample_next``) so that other
decoding schemes (visibility-mask / branch decoding) can reuse them. ``load_model`` builds a TP = 1,
PP = 1 model from a checkpoint of any layout (in memory, through the checkpoint converter).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.models.gpt.config import GPTConfig
from ..core.models.gpt.model import GPTModel
from ..core.transformer.int8_kv_cache import make_kv_cache
from ..core.transformer.self_attention import KVCache
from ..training.checkpoint import CanonicalCheckpoint, check_shapes, load_any_canonical


@dataclass
class GenerationOutput:
    tokens: torch.Tensor                  # [batch, prompt + generated] token ids
    prompt_length: int
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [batch, vocab] (return_logits=True)
    text: list[str] | None = None         # prompt + continuation, when a tokenizer was given

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_length:]


# ---------------------------------------------------------------------------------------- sampling
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (rows of [batch, vocab]).

    top-p keeps the smallest set of most likely tokens whose probability reaches p (at least one).
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [batch] from last-position logits [batch, vocab]; temperature 0 is greedy (argmax)."""
    if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0 (got {temperature}, {top_p}, "
                         f"{top_k})")
    if temperature == 0:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_step(logits: torch.Tensor, done: torch.Tensor, eos_id: int | None, temperature: float, top_k: int,
                top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One decoding step for a batch: sample, keep finished rows at EOS and mark rows that hit it."""
    nxt = sample_next(logits, temperature, top_k, top_p, generator)
    if eos_id is not None:
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        done |= nxt == eos_id
    return nxt


# ------------------------------------------------------------------------------------------ forward
def ensure_single_process() -> None:
    """Set up a TP = PP = 1 parallel state for inference unless one exists; refuse a model-parallel one."""
    if not ps.model_parallel_is_initialized():
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("generation runs in one process: call it outside a distributed job (or after "
                               "initialize_model_parallel with TP = PP = 1)")
        ps.initialize_model_parallel(1, 1)
    elif ps.get_tensor_model_parallel_world_size() != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
        raise RuntimeError("generation needs a single-process model (TP = PP = 1); this process has "
                           f"TP={ps.get_tensor_model_parallel_world_size()}, "
                           f"PP={ps.get_pipeline_model_parallel_world_size()}")


def _positions(start: int, length: int, batch: int, device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).unsqueeze(0).expand(batch, -1)


@torch.no_grad()
def full_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a whole sequence, without a cache (the reference path)."""
    ensure_single_process()
    out = model(tokens, _positions(0, tokens.shape[1], tokens.shape[0], tokens.device))
    return model.gather_logits(out).float()


@torch.no_grad()
def prefill(model: GPTModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt [batch, seq] through the model, filling ``cache``; returns the last logits [batch, vocab]."""
    out = model(tokens, _positions(cache.length, tokens.shape[1], tokens.shape[0], tokens.device), kv_cache=cache)
    _append_causal(cache, tokens.shape[0], tokens.shape[1], tokens.device)
    return model.gather_logits(out)[:, -1].float()


@torch.no_grad()
def decode_step(model: GPTModel, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One new token per row [batch] at position ``cache.length``; returns its logits [batch, vocab]."""
    out = model(token.unsqueeze(1), _positions(cache.length, 1, token.shape[0], token.device), kv_cache=cache)
    _append_causal(cache, token.shape[0], 1, token.device)
    return model.gather_logits(out)[:, -1].float()


def _append_causal(cache: KVCache, batch: int, length: int, device) -> None:
    start = _positions(cache.length, length, batch, device)
    cache.append_visibility(start, torch.full_like(start, torch.iinfo(torch.int64).max))


# --------------------------------------------------------------------------------------- generate
def generation_length(prompt_tokens: int, max_new_tokens: int, trained_context: int,
                      max_position_embeddings: int | None, learned_positions: bool) -> tuple[str | None, str | None]:
    """(error, warning) for generating ``max_new_tokens`` after a prompt of ``prompt_tokens`` tokens."""
    if max_new_tokens < 0:
        return f"--max-new-tokens must be >= 0, got {max_new_tokens}", None
    total = prompt_tokens + max_new_tokens
    if learned_positions and max_position_embeddings is not None and total > max_position_embeddings:
        return (f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} = {total} tokens exceeds "
                f"the {max_position_embeddings} learned positions of this model"), None
    if total > trained_context:
        return None, (f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} = {total} tokens goes "
                      f"past the trained context of {trained_context} tokens (the run's --seq-length): positions "
                      f"beyond it were never trained, expect degraded text")
    return None, None


@torch.no_grad()
def generate(model: GPTModel, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int, *,
             tokenizer=None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, generator: torch.Generator | None = None, eos_id: int | None = None,
             use_cache: bool = True, return_logits: bool = False, kv_cache_dtype: str = "auto") -> GenerationOutput:
    """Sample ``max_new_tokens`` tokens after ``prompt`` (text with ``tokenizer``, ids, or ids [batch, seq]).

    ``temperature=0`` is greedy; ``top_k``/``top_p`` restrict sampling (0 / 1.0: off); ``seed`` or
    ``generator`` makes sampling reproducible. Generation stops early once every row has produced
    ``eos_id``. ``use_cache=False`` recomputes the whole sequence at every step (reference path);
    ``kv_cache_dtype="int8"`` stores the cache as int8 blocks (``core.transformer.int8_kv_cache``).
    """
    ensure_single_process()
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        prompt = tokenizer.tokenize(prompt)
    device = next(model.parameters()).device
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    cfg = model.config
    total = tokens.shape[1] + max_new_tokens
    if cfg.position_embedding_type == "learned_absolute" and total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({tokens.shape[1]} tokens) + {max_new_tokens} new tokens exceed the "
                         f"{cfg.max_position_embeddings} learned positions of this model")
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    prompt_length = tokens.shape[1]
    step_logits = []
    cache = make_kv_cache(kv_cache_dtype) if use_cache else None
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    try:
        logits = prefill(model, tokens, cache) if use_cache else full_logits(model, tokens)[:, -1]
        for i in range(max_new_tokens):
            if return_logits:
                step_logits.append(logits)
            nxt = sample_step(logits, done, eos_id, temperature, top_k, top_p, generator)
            tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
            if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                break
            logits = decode_step(model, nxt, cache) if use_cache else full_logits(model, tokens)[:, -1]
    finally:
        model.train(was_training)
    text = [tokenizer.detokenize(row.tolist()) for row in tokens] if tokenizer is not None else None
    return GenerationOutput(tokens, prompt_length, step_logits, text)


# ------------------------------------------------------------------------------------- load model
def inference_config(config: GPTConfig) -> GPTConfig:
    """The config of a single-process copy for inference: no TP/SP, no dropout, no training-only terms."""
    cfg = GPTConfig.from_dict(config.to_dict())
    cfg.sequence_parallel = False
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    cfg.attention_zreg_coeff = cfg.output_zreg_coeff = 0.0  # gradients only: the forward is the same
    if cfg.attention_backend == "triton" and not device_mod.cuda_available():
        cfg.attention_backend = None
    return cfg


def model_from_canonical(ck: CanonicalCheckpoint, device: str | torch.device = "cpu",
                         where: str = "(canonical)") -> GPTModel:
    """A TP = 1, PP = 1 GPTModel holding the canonical weights (vocabulary rows as saved); a tensor that does not
    fit is one error naming ``where`` (the checkpoint directory), the tensor and both shapes."""
    ensure_single_process()
    cfg = inference_config(ck.config)
    rows = ck.model["embedding.word_embeddings.weight"].shape[0]
    cfg.padded_vocab_size = rows
    model = GPTModel(cfg)  # attaches the QAT quantizers when cfg.qat is enabled
    check_shapes(where, {k: v.shape for k, v in ck.model.items()}, {k: v.shape for k, v in model.state_dict().items()},
                 saved_params=ck.model, collective=False)
    model.load_state_dict(ck.model)
    return model.to(device).eval()


def load_model(root: str, step: int | None = None, device: str | torch.device = "cpu"
               ) -> tuple[GPTModel, CanonicalCheckpoint]:
    """Load a checkpoint of either format and any layout as one single-process model (weights only), its
    files checked against their content hashes first."""
    ck = load_any_canonical(root, step, load_optimizer=False)
    return model_from_canonical(ck, device, where=root), ck


def checkpoint_tokenizer(ck: CanonicalCheckpoint, tokenizer_model: str | None = None,
                         tokenizer_type: str | None = None):
    """The tokenizer a checkpoint was trained with: its ``tokenizer/`` copy (or ``tokenizer_model``);
    ``NullTokenizer`` over the model's vocabulary when the run had none (mock data)."""
    from ..training.tokenizer import NullTokenizer, build_tokenizer

    args = ck.args
    ttype = tokenizer_type or args.get("tokenizer_type") or "SentencePieceTokenizer"
    path = tokenizer_model
    if path is None and args.get("tokenizer_model") and ck.tokenizer_dir:
        candidate = os.path.join(ck.tokenizer_dir, os.path.basename(str(args["tokenizer_model"]).rstrip("/")))
        path = candidate if os.path.exists(candidate) else None
    if path is None and ck.tokenizer_dir and ttype == "HuggingFaceTokenizer":
        path = ck.tokenizer_dir
    if ttype == "NullTokenizer":
        return NullTokenizer(args.get("vocab_size") or ck.config.vocab_size - 1)
    if path is None:
        if args.get("tokenizer_model"):
            raise FileNotFoundError(f"the checkpoint's tokenizer {args['tokenizer_model']} is not in "
                                    f"{ck.tokenizer_dir}: pass --tokenizer-model")
        return NullTokenizer(ck.config.vocab_size)  # a --mock-data run without a tokenizer: ids as text
    return build_tokenizer(ttype, path, args.get("vocab_size"))

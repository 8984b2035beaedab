"""Branch decoding: several continuations of one shared prompt, the prompt computed once.

``decode_branches(model, prompt, max_new_tokens, branches=[...])`` runs the prompt through the model
once (batch 1, filling a KV cache), expands the cache to one row per branch, feeds each branch's own
suffix tokens (padded to a common length; padding keys are visible only to themselves) and then
decodes all branches together, one token per branch per step. Each row attends to the cached prompt
keys through visibility intervals (key-side, see ``core.transformer.visibility``), so:

- a plain prompt is seen whole by every branch: branch b decodes exactly as ``prompt + branches[b]``
  fed alone;
- a tree prompt (:class:`TreePrompt`: nodes in DFS preorder, visibility from ``from_tree``) is seen
  through ``attach[b]``: branch b continues node ``attach[b]`` and sees only that node's ancestors
  and itself, exactly as the root-to-node path fed alone (RoPE positions continue from the node's
  depth). Cached prompt keys on that path get an unbounded limit in row b; every other prompt key
  keeps its limit (<= prompt length), which no new token reaches.

Greedy branch decoding therefore produces the same tokens as decoding every branch separately
(``generation.generate`` on the branch's own sequence), at the cost of one prompt forward instead
of one per branch. Sliding windows are measured on the cached keys' positions, so windowed models
(``--window-size``, per-layer patterns) branch exactly too; ``kv_cache_dtype="int8"`` keeps the prompt and
the branches in the int8 cache (``core.transformer.int8_kv_cache``), the prompt's blocks quantized once.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core.models.gpt.model import GPTModel
from ..core.transformer import visibility_layouts as V
from ..core.transformer.int8_kv_cache import make_kv_cache
from .generation import ensure_single_process, sample_step

INF = torch.iinfo(torch.int64).max

__all__ = ["TreePrompt", "BranchOutput", "decode_branches"]


@dataclass
class TreePrompt:
    """A tree-structured prompt: ``tokens`` in layout order for nodes in DFS preorder (``parents[n]``,
    -1 for a root; children after their parent, subtrees contiguous) with ``lengths[n]`` tokens each."""

    tokens: Sequence[int] | torch.Tensor
    parents: Sequence[int]
    lengths: Sequence[int]
    bidirectional: Sequence[bool] | None = None

    def layout(self) -> V.TreeLayout:
        lay = V.from_tree(self.parents, self.lengths, self.bidirectional)
        if not torch.equal(lay.order, torch.arange(len(self.parents))):
            raise ValueError("TreePrompt nodes must be in DFS preorder (each subtree contiguous, children in order)")
        if lay.num_tokens != len(self.tokens):
            raise ValueError(f"TreePrompt has {len(self.tokens)} tokens but its nodes hold {lay.num_tokens}")
        return lay


@dataclass
class BranchOutput:
    new_tokens: list[torch.Tensor]  # per branch: the generated ids (up to and including eos_id)
    forward_tokens: int  # token positions run through the model (the prompt once, suffixes padded)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [branches, vocab] (return_logits)


def _path_mask(lay: V.TreeLayout, node: int) -> torch.Tensor:
    """Bool [T]: tokens of ``node`` and its ancestors."""
    path = set()
    n = int(node)
    while n >= 0:
        path.add(n)
        n = int(lay.parents[n])
    return torch.tensor([int(m) in path for m in lay.node_of_token.tolist()], dtype=torch.bool)


@torch.no_grad()
def decode_branches(model: GPTModel, prompt: Sequence[int] | torch.Tensor | TreePrompt, max_new_tokens: int, *,
                    branches: Sequence[Sequence[int]] | None = None, num_branches: int | None = None,
                    attach: Sequence[int] | None = None, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, generator: torch.Generator | None = None, seed: int | None = None,
                    eos_id: int | None = None, return_logits: bool = False,
                    kv_cache_dtype: str = "auto") -> BranchOutput:
    """Decode ``max_new_tokens`` after ``prompt`` for every branch (see the module docstring).

    ``branches``: per-branch suffix ids fed before decoding (may be empty lists); or ``num_branches``
    branches without suffix (several samples of one prompt). ``attach`` (tree prompts only): the node
    each branch continues (default: the last node in layout order). Sampling as in ``generate``;
    ``temperature=0`` is greedy. ``kv_cache_dtype``: as in ``generate``.
    """
    ensure_single_process()
    cfg = model.config
    if branches is None:
        if not num_branches or num_branches < 1:
            raise ValueError("give branches (suffix ids per branch) or num_branches >= 1")
        branches = [[] for _ in range(num_branches)]
    n_br = len(branches)
    if n_br == 0:
        raise ValueError("no branches to decode")
    device = next(model.parameters()).device
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    # The shared prompt: token ids, intervals, positions, and per branch its visible prompt keys.
    if isinstance(prompt, TreePrompt):
        lay = prompt.layout()
        tokens = torch.as_tensor(prompt.tokens, dtype=torch.long)
        attach = [int(lay.order[-1])] * n_br if attach is None else [int(a) for a in attach]
        if len(attach) != n_br:
            raise ValueError(f"attach has {len(attach)} entries for {n_br} branches")
        start, limit, pos = lay.start.long(), lay.limit.long(), lay.position_ids
        visible = torch.stack([_path_mask(lay, a) for a in attach])  # [branches, T]
        last = [int(torch.nonzero(v).max()) if v.any() else -1 for v in visible]
        base = [int(pos[i]) + 1 if i >= 0 else 0 for i in last]  # position of the branch's next token
        vis_prompt = (start[None], limit[None])
    else:
        if attach is not None:
            raise ValueError("attach applies to TreePrompt prompts only")
        tokens = torch.as_tensor(prompt, dtype=torch.long).flatten()
        t = tokens.numel()
        start, limit, pos = torch.arange(t), torch.full((t,), INF), torch.arange(t)
        visible = torch.ones(n_br, t, dtype=torch.bool)
        last, base = [t - 1] * n_br, [t] * n_br
        vis_prompt = None  # plain causal prefill: the fast path
    p_len = tokens.numel()
    if p_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    suffix_len = [len(s) for s in branches]
    if any(n == 0 and i < 0 for n, i in zip(suffix_len, last)):
        raise ValueError("a branch without suffix tokens needs at least one prompt token on its path")
    if cfg.position_embedding_type == "learned_absolute":
        need = max(b + n for b, n in zip(base, suffix_len)) + max_new_tokens
        if need > cfg.max_position_embeddings:
            raise ValueError(f"branches reach position {need}, beyond the model's {cfg.max_position_embeddings}")

    was_training = model.training
    model.eval()
    counted = 0
    try:
        cache = make_kv_cache(kv_cache_dtype)
        vis = None if vis_prompt is None else tuple(x.to(device) for x in vis_prompt)
        out = model(tokens[None].to(device), pos[None].to(device), visibility=vis, kv_cache=cache)
        counted += p_len
        prompt_logits = model.gather_logits(out)[0].float()  # [T, vocab]
        cache.expand_rows(n_br)
        row_limit = torch.where(visible, torch.tensor(INF), limit[None])
        cache.visibility_start = start[None].expand(n_br, -1).to(device)
        cache.visibility_limit = row_limit.to(device)
        next_pos = torch.tensor(base, dtype=torch.long, device=device)

        def step(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
            """Feed ids [branches, s] (real: bool, False = padding); returns logits [branches, s, vocab]."""
            nonlocal counted, next_pos
            s = ids.shape[1]
            idx = cache.length + torch.arange(s, device=device)[None].expand(n_br, -1)
            new_start, new_limit = idx, torch.where(real, torch.full_like(idx, INF), idx + 1)
            offs = torch.cumsum(real.long(), 1) - real.long()
            positions = next_pos[:, None] + offs
            all_vis = (torch.cat([cache.visibility_start, new_start], 1), torch.cat([cache.visibility_limit,
                                                                                     new_limit], 1))
            logits = model(ids, positions, visibility=all_vis, kv_cache=cache)
            cache.append_visibility(new_start, new_limit)
            next_pos = next_pos + real.long().sum(1)
            counted += ids.numel()
            return model.gather_logits(logits).float()

        width = max(suffix_len)
        logits = prompt_logits[torch.tensor([max(i, 0) for i in last], device=device)]  # [branches, vocab]
        if width:
            ids = torch.zeros(n_br, width, dtype=torch.long, device=device)
            real = torch.zeros(n_br, width, dtype=torch.bool, device=device)
            for b, s in enumerate(branches):
                ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
                real[b, :len(s)] = True
            suffix_logits = step(ids, real)
            has = torch.tensor(suffix_len, device=device) > 0
            at = (torch.tensor(suffix_len, device=device) - 1).clamp_min(0)
            logits = torch.where(has[:, None], suffix_logits[torch.arange(n_br, device=device), at], logits)

        generated, step_logits = [], []
        done = torch.zeros(n_br, dtype=torch.bool, device=device)
        ones = torch.ones(n_br, 1, dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            if return_logits:
                step_logits.append(logits)
            nxt = sample_step(logits, done, eos_id, temperature, top_k, top_p, generator)
            generated.append(nxt)
            if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                break
            logits = step(nxt[:, None], ones)[:, -1]
    finally:
        model.train(was_training)
    new = torch.stack(generated, 1) if generated else torch.zeros(n_br, 0, dtype=torch.long, device=device)
    rows = []
    for row in new:
        if eos_id is not None and (row == eos_id).any():
            row = row[: int(torch.nonzero(row == eos_id)[0]) + 1]
        rows.append(row)
    return BranchOutput(rows, counted, step_logits)

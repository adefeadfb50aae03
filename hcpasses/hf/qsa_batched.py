"""qwen4_exp's QSA token selection for all query positions at once: what ``Qwen4ExpTextQSAIndexer._select_tokens``
computes with a Python loop over the queries (a ``nonzero``, a host sync and a few small kernels each), as a few
batched tensor ops, where every query's visible keys are one run of positions from a start its sequence shares.

Why: at real size the loop runs T iterations per prefill in eager as compiled (``hcpasses::qsa_select_tokens`` made
it one op, not faster): a 4096-token prompt is 4096 host syncs in the indexed-attention layer alone.

What the loop computes, per sequence b and query i (transformers 5.25): the visible keys (the mask's row) grouped in
blocks of ``compress_ratio`` consecutive visible keys; each complete block's key is the mean of its raw keys (fp32,
then the keys' dtype), the key norm, then RoPE at the block's first position; a block's score is
``relu(q_i @ key).sum(heads) / sqrt(head_dim)``; the ``min(block_topk, complete blocks)`` best blocks' keys and
the visible keys after the last complete block (the tail) are selected. Where the visible keys are the run
``start_b .. start_b + n_i - 1`` (a causal mask, left padding included: one start per sequence), the blocks are the
same for every query of the sequence (query i sees the first ``n_i // ratio`` of them), so the block keys are
computed once and the scores of a chunk of queries are one batched product; blocks a query cannot see score -inf.

Equal to the loop's selection wherever the topk's choice is unambiguous; blocks of equal score (a tie at the k-th
place: all heads' products negative make a score exactly 0) are chosen by ``topk``'s implementation, which runs over
a different length here (all blocks of the sequence, the unseen at -inf) than in the loop, so a tie may be broken
differently. The per-query products are summed in another order too (one batched GEMM, not one per query), so two
scores within a rounding error of each other may swap. Hence opt-in (``qsa_selection_as_one_op(batched=True)``),
and a visibility of any other shape (a sliding window, a start that differs between queries) returns ``None``: the
caller runs the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

QUERY_CHUNK = 1024  # queries scored at once: [chunk, heads, blocks] fp32 (1024 x 16 x 4096 x 4 B = 256 MiB at T = 16K)


def shared_start_runs(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``visible [B, S, K]`` bool -> ``(start [B], count [B, S])`` where query (b, i) sees exactly the keys
    ``start[b] .. start[b] + count[b, i] - 1``, else ``None``. One comparison of the whole mask (a host sync)."""
    count = visible.sum(-1)
    start = visible.any(dim=1).int().argmax(-1)  # each sequence's first key any query sees (0 where none does)
    position = torch.arange(visible.shape[-1], device=visible.device)
    offset = position - start[:, None, None]
    runs = (offset >= 0) & (offset < count[..., None])
    return (start, count) if torch.equal(runs, visible) else None


def block_keys(
    raw_keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    start: int,
    ratio: int,
    key_norm: nn.Module,
    rope: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """One sequence's block keys ``[blocks, D]`` for the blocks of ``ratio`` keys from ``start``: the loop's mean of
    the raw keys in fp32, key norm, RoPE at the block's first position."""
    blocks = (raw_keys.shape[0] - start) // ratio
    grouped = raw_keys[start : start + blocks * ratio].unflatten(0, (blocks, ratio))
    pooled = key_norm(grouped.float().mean(dim=1).to(raw_keys.dtype))
    firsts = torch.arange(blocks, device=raw_keys.device) * ratio + start
    return rope(pooled.unsqueeze(1), cos=cos.index_select(0, firsts), sin=sin.index_select(0, firsts)).squeeze(1)


def select_tokens_batched(
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    full_cos: torch.Tensor,
    full_sin: torch.Tensor,
    visible: torch.Tensor,
    token_budget: int,
    ratio: int,
    key_norm: nn.Module,
    rope: Callable[..., torch.Tensor],
) -> torch.Tensor | None:
    """The selection mask ``[B, 1, S, K]`` (bool) for ``q [B, S, H, D]``, ``raw_keys [B, K, D]``, the RoPE tables
    ``[B, K, rot]`` and ``visible [B, S, K]``; ``None`` where the visible keys are not shared-start runs."""
    runs = shared_start_runs(visible)
    if runs is None:
        return None
    starts, counts = runs
    batch, queries, keys = visible.shape
    mask = torch.zeros(batch, queries, keys, dtype=torch.bool, device=visible.device)
    position = torch.arange(keys, device=visible.device)
    for b, start in enumerate(starts.tolist()):
        keys_b = block_keys(raw_keys[b], full_cos[b], full_sin[b], start, ratio, key_norm, rope).float()
        blocks = keys_b.shape[0]
        block_id = torch.arange(blocks, device=visible.device)
        offset = position - start
        for first in range(0, queries, QUERY_CHUNK):
            count = counts[b, first : first + QUERY_CHUNK]
            complete = count // ratio
            selected = torch.zeros(count.shape[0], keys, dtype=torch.bool, device=visible.device)
            if blocks:
                products = torch.matmul(q[b, first : first + QUERY_CHUNK].float(), keys_b.T)  # [C, H, blocks]
                scores = torch.relu(products).sum(dim=1) / math.sqrt(q.shape[-1])
                scores = scores.masked_fill(block_id >= complete[:, None], float("-inf"))
                top = scores.topk(min(token_budget // ratio, blocks), dim=-1).indices
                top = torch.where(top < complete[:, None], top, blocks)  # a pick past the complete blocks: none
                chosen = torch.zeros(count.shape[0], blocks + 1, dtype=torch.bool, device=visible.device)
                chosen = chosen.scatter(-1, top, True)[:, :blocks].repeat_interleave(ratio, dim=-1)
                selected[:, start : start + blocks * ratio] = chosen
            tail = (offset >= complete[:, None] * ratio) & (offset < count[:, None])
            mask[b, first : first + QUERY_CHUNK] = selected | tail
    return mask.unsqueeze(1)

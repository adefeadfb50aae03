"""An HC model whose token mixers solve a chunked delta rule by forward substitution, as pure-torch linear
attention code does (transformers' ``torch_chunk_gated_delta_rule`` on its export path, flash-linear-attention's
naive reference): the solve's inner step is a gated sum over a ``[..., n, S]`` value, the very algebra of the
stacked mHC collapse, but over chunk positions, not HC streams. Neither pass may take it for an HC block.

Two spellings of the step (``SOLVES``), both in fp32 as those code bases compute it:

- ``row_times_rows``: ``a[..., i, :i] = row + (row.unsqueeze(-1) * a[..., :i, :i]).sum(-2)`` (n = S = i);
- ``column_block``: ``a[..., i, :i] += (a[..., i, :].unsqueeze(-1) * a[..., :, :i]).sum(-2)`` (n = chunk, S = i).

The mixer is TP over heads (column-parallel q/k/v, row-parallel output, one all-reduce), reads all T rows of
its input (it mixes tokens) and pads T to whole chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from .gated_residual import UserHC


def solve_row_times_rows(a: torch.Tensor) -> torch.Tensor:
    for i in range(1, a.shape[-1]):
        row = a[..., i, :i].clone()
        sub = a[..., :i, :i].clone()
        a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return a


def solve_column_block(a: torch.Tensor) -> torch.Tensor:
    for i in range(1, a.shape[-1]):
        column = a[..., i, :].clone()
        a[..., i, :i] = a[..., i, :i] + (column.unsqueeze(-1) * a[..., :, :i]).sum(-2)
    return a


SOLVES = {"row_times_rows": solve_row_times_rows, "column_block": solve_column_block}


class ChunkedDeltaMixer(nn.Module):
    """Heads ``[rank*h/tp, (rank+1)*h/tp)`` of a chunked delta-rule mixer over T tokens ``[T, hidden]``."""

    def __init__(
        self, hidden: int, heads: int, head_dim: int, chunk: int, solve: str, tp: int, rank: int, g: torch.Generator
    ) -> None:
        super().__init__()
        qkv = torch.randn(3, heads, head_dim, hidden, generator=g) * hidden**-0.5
        out = torch.randn(hidden, heads, head_dim, generator=g) * (heads * head_dim) ** -0.5
        mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
        self.qkv = nn.Parameter(qkv[:, mine].reshape(-1, hidden), requires_grad=False)
        self.out = nn.Parameter(out[:, mine].reshape(hidden, -1), requires_grad=False)
        self.head_dim, self.chunk, self.solve, self.tp = head_dim, chunk, SOLVES[solve], tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, chunk = x.shape[0], self.chunk
        padded = F.pad(F.linear(x, self.qkv.to(x.dtype)).float(), (0, 0, 0, -tokens % chunk))
        # [T', 3*h*d] -> three [h, chunks, chunk, d]
        q, k, v = padded.view(-1, chunk, 3, padded.shape[-1] // (3 * self.head_dim), self.head_dim).permute(
            2, 3, 0, 1, 4
        )
        k = F.normalize(k, dim=-1)
        a = self.solve(-(k @ k.transpose(-1, -2)).tril(-1)) + torch.eye(chunk)
        o = ((q @ k.transpose(-1, -2)).tril() @ (a @ v)).permute(1, 2, 0, 3).reshape(-1, self.out.shape[1])
        y = F.linear(o[:tokens].to(x.dtype), self.out.to(x.dtype))
        return funcol.all_reduce(y, "sum", dist.group.WORLD) if self.tp > 1 else y


class DeltaRuleHC(UserHC):
    """``UserHC`` whose first sub-layer in every layer is a ``ChunkedDeltaMixer`` (layer i uses the i-th solve
    spelling, cyclically); every HC block and the final mixer stay gated means."""

    CHUNK = 4

    def __init__(self, layers: int = 2, dtype: torch.dtype = torch.float32, tp: int = 1, rank: int = 0) -> None:
        super().__init__("rsqrt", layers, None, dtype, tp, rank)
        g = torch.Generator().manual_seed(2)
        hidden = self.embed.shape[1]
        for layer in range(layers):
            solve = list(SOLVES)[layer % len(SOLVES)]
            self.sublayers[2 * layer] = ChunkedDeltaMixer(hidden, 4, 8, self.CHUNK, solve, tp, rank, g)

    def lookalikes(self) -> int:
        """Collapse-shaped sums in the graph: one per solve step (chunk - 1 per mixer)."""
        return (self.CHUNK - 1) * len(self.blocks) // 2

"""mHC models (DeepSeek-V4's manifold-constrained hyper-connections) written the way other code bases write
them, independently of ``models/mhc.py``: streams kept stacked ``[..., n, S]`` in the activation dtype, the
pre / post / comb weights from one fp32 projection of the flattened, RMS-scaled streams, comb through a few
Sinkhorn steps, the final collapse RMS-normed into the head, and the collapse ``x = sum_s pre_s h_s`` spelled
per block (``COLLAPSES``):

- ``transformers``: ``(pre.unsqueeze(-1) * h).sum(-2).to(h.dtype)`` (``DeepseekV4HyperConnection``);
- ``deepseek_reference``: DeepSeek's inference code: the streams upcast flat, viewed back, ``torch.sum(...,
  dim=2)`` with a positive dim, rounded once;
- ``mlx_port``: ``(pre[..., None] * h.float()).sum(-2)``: the upcast on the stacked streams;
- ``batched_matmul``: ``torch.matmul(pre.to(h.dtype).view(T, 1, n), h.view(T, n, S)).view(..., S)`` (an
  Ascend port: the gates rounded to the activation dtype, one GEMM per token);
- ``einsum``: ``torch.einsum("...n,...nd->...d", pre.to(h.dtype), h)`` (community HC / mHC libraries).

Each block's sub-layer input is optionally FP8-quantised (a ``corpus.quants`` spelling, then dequantised, as a
PTPC-FP8 linear reads it). Sub-layers are TP SwiGLUs (``corpus.gated_residual.SwiGLU``) that all-reduce; tokens
are ``[T]`` or ``[batch, seq]``. Weights are drawn full-size from a seed and each
rank takes its TP slice, so any tp computes the tp = 1 model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gated_residual import SwiGLU, _frozen
from .quants import QUANTS


def collapse_transformers(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * h).sum(-2).to(h.dtype)


def collapse_deepseek_reference(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    shape, dtype = h.size(), h.dtype
    flat = h.flatten(-2).float()
    return torch.sum(pre.unsqueeze(-1) * flat.view(shape), dim=len(shape) - 2).to(dtype)


def collapse_mlx_port(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * h.float()).sum(-2).to(h.dtype)


def collapse_batched_matmul(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    *lead, n, hidden = h.shape
    tokens = pre.shape[:-1].numel()
    return torch.matmul(pre.to(h.dtype).view(tokens, 1, n), h.view(tokens, n, hidden)).view(*lead, hidden)


def collapse_einsum(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...n,...nd->...d", pre.to(h.dtype), h)


COLLAPSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "transformers": collapse_transformers,
    "deepseek_reference": collapse_deepseek_reference,
    "mlx_port": collapse_mlx_port,
    "batched_matmul": collapse_batched_matmul,
    "einsum": collapse_einsum,
}


@dataclasses.dataclass(frozen=True)
class MHCSpelling:
    collapse: str
    quant: str | None = None  # None: the sub-layer reads x unquantised

    @property
    def fuses(self) -> bool:
        """Every collapse spelling here is the fused op's sum within one rounding (fp32 products and sum)."""
        return self.quant is not None


def sinkhorn(logits: torch.Tensor, steps: int = 3, eps: float = 1e-6) -> torch.Tensor:
    comb = logits.softmax(-1) + eps
    for _ in range(steps):
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
    return comb


class MHCBlock(nn.Module):
    def __init__(self, n: int, hidden: int, g: torch.Generator, collapse: str) -> None:
        super().__init__()
        self.n, self.collapse = n, COLLAPSES[collapse]
        width, outputs = n * hidden, (2 + n) * n
        self.fn = _frozen(torch.randn(outputs, width, generator=g) * width**-0.5, torch.float32)
        self.base = _frozen(torch.randn(outputs, generator=g) * 0.5, torch.float32)
        self.scale = _frozen(1 + 0.1 * torch.randn(3, generator=g), torch.float32)

    def pre(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, post, comb)`` from the streams ``h [..., n, S]``."""
        n = self.n
        flat = h.flatten(-2).float()
        mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
        pre = torch.sigmoid(mixes[..., :n] * self.scale[0] + self.base[:n]) + 1e-6
        post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        comb = sinkhorn((mixes[..., 2 * n :] * self.scale[2] + self.base[2 * n :]).unflatten(-1, (n, n)))
        return self.collapse(pre, h), post, comb

    @staticmethod
    def post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``h'_j = post_j * y + sum_i comb_ij h_i``."""
        mixed = torch.sum(comb.unsqueeze(-1) * h.unsqueeze(-2), dim=-3)
        return (post.unsqueeze(-1) * y.unsqueeze(-2) + mixed).to(h.dtype)


class SpelledMHC(nn.Module):
    """Embedding expanded to n streams, one ``MHCBlock`` + SwiGLU per entry of ``blocks``, a final collapse."""

    def __init__(
        self,
        blocks: Sequence[MHCSpelling],
        final: str,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        rank: int = 0,
        n: int = 4,
        hidden: int = 32,
        vocab: int = 64,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.n = n
        self.embed = _frozen(torch.randn(vocab, hidden, generator=g), dtype)
        self.spellings = list(blocks)
        self.blocks = nn.ModuleList(MHCBlock(n, hidden, g, spelling.collapse) for spelling in blocks)
        self.sublayers = nn.ModuleList(SwiGLU(hidden, 64, tp, rank, g, dtype) for _ in blocks)
        self.final = MHCBlock(n, hidden, g, final)
        self.head = _frozen(torch.randn(vocab, hidden, generator=g) * hidden**-0.5, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        h = x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])
        for spelling, block, sublayer in zip(self.spellings, self.blocks, self.sublayers, strict=True):
            x, post, comb = block.pre(h)
            if spelling.quant is not None:
                q, scale = QUANTS[spelling.quant](x)
                x = (q.float() * scale).to(x.dtype)
            h = block.post(sublayer(x), h, post, comb)
        return F.linear(F.rms_norm(self.final.pre(h)[0], (self.head.shape[1],), eps=1e-6), self.head)

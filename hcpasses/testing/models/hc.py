"""Hyper-connection (HC) blocks: Qwen3.8-Flash-Next gated residual (DESIGN §2).

Streams ``h`` are ``[T, n*S]``, stream-major (stream s is columns ``s*S:(s+1)*S``). Every op here is
row-local and every weight is replicated under TP. The ops are written the way ``transformers`` writes
them (plain torch ops, each intermediate in the activation dtype) so that pattern matchers find them in
the post-grad graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .tp import replicated_parameter

NORM_WEIGHT_STD = 0.1


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm over each group of ``group_size`` features: ``x/rms(x) * (1 + w)``, in fp32.

    ``x [T, G*group_size]``, ``weight [G*group_size]``; the result has x's dtype.
    """
    xf = x.float().unflatten(-1, (-1, group_size))
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gated_mean(xn: torch.Tensor, d: torch.Tensor, w_up: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``x = mean_s(sigmoid(u_s) * xn_s)`` with ``u = silu(d / n) @ w_up^T``.

    ``xn [T, n*S]`` (normed streams), ``d [T, r]`` -> ``x [T, S]``.
    """
    u = F.linear(F.silu(d / n), w_up)
    return (torch.sigmoid(u).unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).mean(-2)


class HyperConnection(nn.Module):
    """One gated residual around a sub-layer: ``mix`` makes its input, ``combine`` writes its output back.

    Parameters (replicated): ``norm_weight [n*S]``, ``w_down_inject [r+n, n*S]`` (rows ``:r`` are W_down,
    rows ``r:`` are W_inj, one GEMM), ``w_up [n*S, r]``.
    """

    def __init__(self, cfg: HCConfig, *, name: str) -> None:
        super().__init__()
        self.n, self.hidden, self.rank, self.eps = cfg.n_streams, cfg.hidden, cfg.hc_rank, cfg.eps
        width = cfg.streams_width
        seed, dtype = cfg.seed, cfg.dtype
        self.norm_weight = replicated_parameter(seed, f"{name}.norm_weight", (width,), NORM_WEIGHT_STD, dtype)
        self.w_down_inject = replicated_parameter(
            seed, f"{name}.w_down_inject", (self.rank + self.n, width), width**-0.5, dtype
        )
        self.w_up = replicated_parameter(seed, f"{name}.w_up", (width, self.rank), self.rank**-0.5, dtype)

    def mix(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sub-layer input and inject logits: ``h [T, n*S] -> (x [T, S], l [T, n])``."""
        xn = grouped_rms_norm(h, self.norm_weight, self.hidden, self.eps)
        d, logits = F.linear(xn, self.w_down_inject).split([self.rank, self.n], dim=-1)
        return gated_mean(xn, d, self.w_up, self.n, self.hidden), logits

    def combine(self, h: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``h'_s = h_s + 2*sigmoid(l_s / n) * y``: raw pre-mix streams h, sub-layer output ``y [T, S]``."""
        gate = 2 * torch.sigmoid(logits / self.n)
        return h + (y.unsqueeze(-2) * gate.unsqueeze(-1)).flatten(-2)


class FinalMixer(nn.Module):
    """The mix without inject that ends the model: ``h [T, n*S] -> x [T, S]``.

    Parameters (replicated): ``norm_weight [n*S]``, ``w_down [r, n*S]``, ``w_up [n*S, r]``.
    """

    def __init__(self, cfg: HCConfig, *, name: str) -> None:
        super().__init__()
        self.n, self.hidden, self.eps = cfg.n_streams, cfg.hidden, cfg.eps
        width = cfg.streams_width
        seed, dtype, rank = cfg.seed, cfg.dtype, cfg.hc_rank
        self.norm_weight = replicated_parameter(seed, f"{name}.norm_weight", (width,), NORM_WEIGHT_STD, dtype)
        self.w_down = replicated_parameter(seed, f"{name}.w_down", (rank, width), width**-0.5, dtype)
        self.w_up = replicated_parameter(seed, f"{name}.w_up", (width, rank), rank**-0.5, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The gated mean of the normed streams, ``[T, S]``."""
        xn = grouped_rms_norm(h, self.norm_weight, self.hidden, self.eps)
        return gated_mean(xn, F.linear(xn, self.w_down), self.w_up, self.n, self.hidden)

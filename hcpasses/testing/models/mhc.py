"""DeepSeek-V4 manifold-constrained hyper-connections (mHC), in the style of the reference HC decoder.

Ground truth: ``transformers`` ``models/deepseek_v4`` (``DeepseekV4HyperConnection``,
``DeepseekV4HyperHead``); DESIGN §2, second family. Streams ``h`` are ``[T, n*S]``, stream-major (stream s
is columns ``s*S:(s+1)*S``). Each mHC block:

1. one unweighted RMSNorm over all n*S features, in fp32;
2. one projection ``fn [(2+n)*n, n*S]`` (fp32 math) to the pre, post and comb logits, each scaled by its
   own ``scale`` entry and shifted by ``base``;
3. ``pre = sigmoid(.) + eps``, ``post = 2*sigmoid(.)``, ``comb`` = softmax + Sinkhorn iterations (an n x n
   matrix whose rows and columns sum to about 1);
4. collapse ``x = sum_s pre_s h_s`` (fp32 sum, one rounding): the sub-layer input;
5. expand ``h'_j = post_j * y + sum_i comb_ij h_i`` with the sub-layer output ``y``.

Every op is row-local and every mHC weight is replicated under TP. The sub-layers (attention, MLP, PLE,
FP8 projections) are the reference decoder's. Unlike DeepSeek-V4, the sub-layers have no RMSNorm of their
own: the collapse feeds the sub-layer's (FP8) input projection directly, as DESIGN §2 draws it, so the
``mhc_collapse`` pattern of the gated-mean + FP8 fusion meets the quant it fuses with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .decoder import HCDecoder, HCDecoderLayer
from .tp import replicated_parameter, seeded_normal

SINKHORN_ITERS = 3
HC_EPS = 1e-6
BASE_STD = 0.5
SCALE_STD = 0.1


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, in fp32 (the result is fp32)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS, eps: float = HC_EPS) -> torch.Tensor:
    """Softmax over the last dim, then alternate column / row normalisation (``[..., n, n]``, fp32)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_collapse(pre: torch.Tensor, h: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``x = sum_s pre_s h_s``: fp32 gates ``pre [T, n]``, streams ``h [T, n*S]`` -> ``[T, S]`` in h's dtype."""
    return (pre.unsqueeze(-1) * h.unflatten(-1, (n, hidden))).sum(-2).to(h.dtype)


def _scale_parameter(seed: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A replicated parameter near 1: ``1 + N(0, SCALE_STD^2)``."""
    return nn.Parameter((1.0 + seeded_normal(seed, name, shape, SCALE_STD)).to(dtype), requires_grad=False)


class ManifoldHyperConnection(nn.Module):
    """One mHC block around a sub-layer: ``mix`` makes its input, ``combine`` expands its output.

    Parameters (replicated): ``fn [(2+n)*n, n*S]`` (rows: pre ``:n``, post ``n:2n``, comb ``2n:``),
    ``base [(2+n)*n]``, ``scale [3]`` (pre, post, comb).
    """

    def __init__(self, cfg: HCConfig, *, name: str) -> None:
        super().__init__()
        self.n, self.hidden, self.eps = cfg.n_streams, cfg.hidden, cfg.eps
        width, outputs = cfg.streams_width, (2 + cfg.n_streams) * cfg.n_streams
        self.fn = replicated_parameter(cfg.seed, f"{name}.fn", (outputs, width), width**-0.5, cfg.dtype)
        self.base = replicated_parameter(cfg.seed, f"{name}.base", (outputs,), BASE_STD, cfg.dtype)
        self.scale = _scale_parameter(cfg.seed, f"{name}.scale", (3,), cfg.dtype)

    def weights(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [T, n], post [T, n], comb [T, n, n])`` in fp32 from the streams ``h [T, n*S]``."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(h, self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + HC_EPS
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n))
        return pre, post, comb

    def mix(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sub-layer input and expand weights: ``h [T, n*S] -> (x [T, S], post [T, n], comb [T, n, n])``."""
        pre, post, comb = self.weights(h)
        return mhc_collapse(pre, h, self.n, self.hidden), post, comb

    def combine(self, h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``h'_j = post_j * y + sum_i comb_ij h_i`` in h's dtype: raw pre-mix streams h, ``y [T, S]``."""
        streams = h.unflatten(-1, (self.n, self.hidden))
        mixed = torch.matmul(comb.to(h.dtype).transpose(-1, -2), streams)
        return (post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(-2) + mixed).flatten(-2)


class ManifoldHyperHead(nn.Module):
    """The final pre-only collapse (DeepSeek-V4's HyperHead): ``h [T, n*S] -> x [T, S]``.

    Parameters (replicated): ``fn [n, n*S]``, ``base [n]``, ``scale [1]``.
    """

    def __init__(self, cfg: HCConfig, *, name: str) -> None:
        super().__init__()
        self.n, self.hidden, self.eps = cfg.n_streams, cfg.hidden, cfg.eps
        width = cfg.streams_width
        self.fn = replicated_parameter(cfg.seed, f"{name}.fn", (self.n, width), width**-0.5, cfg.dtype)
        self.base = replicated_parameter(cfg.seed, f"{name}.base", (self.n,), BASE_STD, cfg.dtype)
        self.scale = _scale_parameter(cfg.seed, f"{name}.scale", (1,), cfg.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The pre-weighted sum of the streams, ``[T, S]``."""
        mixes = F.linear(unweighted_rms_norm(h, self.eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + HC_EPS
        return mhc_collapse(pre, h, self.n, self.hidden)


class MHCDecoderLayer(HCDecoderLayer):
    """[PLE] -> attention mHC (mix, attention, combine) -> MLP mHC (mix, MLP, combine)."""

    hc_class = ManifoldHyperConnection


class MHCDecoder(HCDecoder):
    """The mHC model: ``input_ids [T] -> logits [T, vocab]`` (and optionally the HC state).

    Same sub-layers, embedding, final norm and lm_head as :class:`~.decoder.HCDecoder`; the HC blocks
    are mHC and the end is a :class:`ManifoldHyperHead`. Weights depend only on ``cfg`` (and the rank's
    slice), so every TP size computes the same function.
    """

    layer_class = MHCDecoderLayer

    def make_final_mixer(self, cfg: HCConfig) -> nn.Module:
        return ManifoldHyperHead(cfg, name="hc_head")

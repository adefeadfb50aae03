"""HC models written the way other code bases write them, independently of ``models/``.

``UserHC``: a Qwen3.8-Flash-Next-style stack (the gated residual of transformers' ``Qwen4ExpTextGatedResidual``
in its math: grouped norm, down/up GEMMs, gated mean, ``2*sigmoid(l/n)`` inject), SwiGLU sub-layers that
all-reduce through functional collectives, a final gated-mean mixer, and only the logits returned. The grouped
norm is one of ``NORMS``: the spellings seen in public code (rsqrt in fp32 and back, ``x / sqrt(mean(x^2) + eps)``
in the activation dtype, ``F.rms_norm``, Gemma's ``(1 + w)``). An optional causal depthwise conv over tokens
on the streams (a token window: each row reads the 2 before it) starts one layer. With ``keep``, only the last
``keep`` rows reach the LM head (transformers' ``logits_to_keep``), after a final step on all rows (``TAILS``).

Weights are drawn full-size from a seed and each rank takes its TP slice, so any tp computes the tp = 1 model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from .quants import quant_reference


def norm_rsqrt(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def norm_sqrt_div(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def norm_functional(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def norm_gemma(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


NORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "rsqrt": norm_rsqrt,
    "sqrt_div": norm_sqrt_div,
    "F.rms_norm": norm_functional,
    "gemma": norm_gemma,
}


# The gated mean ``mean_s(sigmoid(u_s) * xn_s)`` of gate logits u and normed streams xn, both [..., n*S].
def collapse_unflatten_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """transformers: unflatten, product in the activation dtype, mean over the negative stream dim."""
    return (torch.sigmoid(u).unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).mean(dim=-2)


def collapse_view_positive_dim(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``view`` to explicit sizes and the stream dim as a positive index."""
    lead = xn.shape[:-1]
    return torch.mean(torch.sigmoid(u).view(*lead, n, hidden) * xn.view(*lead, n, hidden), dim=len(lead))


def collapse_fp32_sum_div(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """ATOM-style: everything in fp32, ``sum / n``, one rounding back to the activation dtype."""
    gated = torch.sigmoid(u.float()).reshape(*u.shape[:-1], n, hidden) * xn.float().reshape(*xn.shape[:-1], n, hidden)
    return (gated.sum(dim=-2) / n).to(xn.dtype)


def collapse_fp32_sum_times_reciprocal(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """fp32 sum scaled by ``1 / n`` (exactly ``/ n`` when n is a power of two)."""
    gate, streams = (t.to(torch.float32).unflatten(-1, (n, hidden)) for t in (u, xn))
    gated = torch.sigmoid(gate) * streams
    return (gated.sum(-2) * (1.0 / n)).to(xn.dtype)


def collapse_activation_sum_div(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``sum / n`` in the activation dtype: in bf16 the sum is rounded before the division."""
    return (u.sigmoid().unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).sum(-2) / n


COLLAPSES: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]] = {
    "unflatten_mean": collapse_unflatten_mean,
    "view_positive_dim": collapse_view_positive_dim,
    "fp32_sum_div": collapse_fp32_sum_div,
    "fp32_sum_times_reciprocal": collapse_fp32_sum_times_reciprocal,
    "activation_sum_div": collapse_activation_sum_div,
}


def _frozen(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype), requires_grad=False)


class GatedResidual(nn.Module):
    def __init__(
        self,
        n: int,
        hidden: int,
        rank: int,
        norm: str,
        g: torch.Generator,
        dtype: torch.dtype,
        collapse: str = "unflatten_mean",
    ) -> None:
        super().__init__()
        self.n, self.hidden, self.norm, self.collapse = n, hidden, NORMS[norm], COLLAPSES[collapse]
        width = n * hidden
        self.norm_weight = _frozen(1 + 0.1 * torch.randn(hidden, generator=g), dtype)
        self.down = _frozen(torch.randn(rank, width, generator=g) * width**-0.5, dtype)
        self.up = _frozen(torch.randn(width, rank, generator=g) * rank**-0.5, dtype)
        self.inject = _frozen(torch.randn(n, width, generator=g) * width**-0.5, dtype)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(h.unflatten(-1, (self.n, self.hidden)), self.norm_weight, 1e-6).flatten(-2)
        gate_logits = F.linear(F.silu(F.linear(normed, self.down) / self.n), self.up)
        inject = 2 * torch.sigmoid(F.linear(normed, self.inject) / self.n)
        return self.collapse(gate_logits, normed, self.n, self.hidden), inject

    def combine(self, h: torch.Tensor, y: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        return (h.unflatten(-1, (self.n, self.hidden)) + inject.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)


class SwiGLU(nn.Module):
    """Column-parallel gate/up, row-parallel down, then a functional all-reduce (tp > 1)."""

    def __init__(self, hidden: int, inner: int, tp: int, rank: int, g: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        gate, up = (torch.randn(inner, hidden, generator=g) * hidden**-0.5 for _ in range(2))
        down = torch.randn(hidden, inner, generator=g) * inner**-0.5
        rows = slice(rank * inner // tp, (rank + 1) * inner // tp)
        self.gate_up = _frozen(torch.cat([gate[rows], up[rows]]), dtype)
        self.down = _frozen(down[:, rows], dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, self.down)
        return funcol.all_reduce(y, "sum", dist.group.WORLD) if self.tp > 1 else y


WINDOWS = ("front_pad", "own_padding", "centred")
# before the kept rows: a final RMS norm (row-local), centring over the tokens (not), both side by side, or the norm
# quantised per token to FP8 (the kept rows of its codes and scales dequantised), the norm's last row or the one
# before it selected, its ``keep`` rows before the last one, its last ``keep`` rows picked by a tensor index, or the
# last ``keep`` rows of each sequence after a view of the tokens as sequences: two (``[2, T/2, S]``) or one
# (``[1, T, S]``, transformers' layout)
TAILS = (
    "norm", "centred", "both", "fp8", "select", "select_before_last", "before_last", "index",
    "two_sequences", "one_sequence",
)  # fmt: skip
# what a sub-layer does to its HC block's x before its GEMMs: nothing; an RMS norm cast to the bf16 of the sub-layer's
# weights (narrower than the fp32 x); the norm in fp32 (no narrower); the bf16 norm beside a gate that reads x itself
# through a scan (x is gathered for it anyway); centring over the tokens, then the bf16 cast (not row-local)
PROLOGUES = ("none", "norm_bf16", "norm", "branch", "centred_bf16")


class UserHC(nn.Module):
    def __init__(
        self,
        norm: str = "rsqrt",
        layers: int = 2,
        conv_layer: int | None = None,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        rank: int = 0,
        n: int = 4,
        hidden: int = 32,
        vocab: int = 64,
        window: str = "front_pad",
        keep: int = 0,
        tail: str = "norm",
        prologue: str = "none",
    ) -> None:
        super().__init__()
        if prologue not in PROLOGUES:
            raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
        g = torch.Generator().manual_seed(0)
        self.n, self.conv_layer, self.window, self.keep, self.tail = n, conv_layer, window, keep, tail
        self.prologue = prologue
        inner_dtype = torch.bfloat16 if prologue.endswith(("bf16", "branch")) else dtype
        self.embed = _frozen(torch.randn(vocab, hidden, generator=g), dtype)
        self.blocks = nn.ModuleList(GatedResidual(n, hidden, 8, norm, g, dtype) for _ in range(2 * layers))
        self.sublayers = nn.ModuleList(SwiGLU(hidden, 64, tp, rank, g, inner_dtype) for _ in range(2 * layers))
        self.final = GatedResidual(n, hidden, 8, norm, g, dtype)
        self.conv = _frozen(torch.randn(n * hidden, 1, 3, generator=g) * 0.3, dtype)
        self.head = _frozen(torch.randn(vocab, hidden, generator=g) * hidden**-0.5, dtype)
        self.final_norm = _frozen(1.0 + 0.1 * torch.randn(hidden, generator=g), dtype)
        # drawn last: the models without a prologue keep the weights they had
        self.sublayer_norm = _frozen(1.0 + 0.1 * torch.randn(hidden, generator=g), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids].repeat(1, self.n)
        for index, (block, sublayer) in enumerate(zip(self.blocks, self.sublayers, strict=True)):
            if index == 2 * (self.conv_layer if self.conv_layer is not None else -1):
                h = h + self.token_window(h.t().unsqueeze(0))[0].t()
            x, inject = block(h)
            y = sublayer(self.sublayer_input(index, self.before_gemms(x)))
            if self.prologue == "branch":  # a gate read off x itself (by a scan: no prologue step), beside its norm
                y = y * torch.sigmoid(x.cumsum(-1))
            h = block.combine(h, y, inject)
        out = self.final(h)[0]
        if self.keep:
            out = self.kept_rows(out)
        return F.linear(out, self.head)

    def kept_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The last ``keep`` rows of the final mixer's output ``[T, S]``: RMS-normed, centred over the tokens, both
        (``[2*keep, S]``), RMS-normed through FP8 codes and scales, the RMS-normed last row selected or the ``keep``
        rows before it, or the last ``keep`` rows of each sequence (``[B, keep, S]``)."""
        if self.tail == "norm":
            return norm_rsqrt(out, self.final_norm, 1e-6)[-self.keep :]
        if self.tail == "centred":
            return (out - out.mean(0, keepdim=True))[-self.keep :]
        if self.tail == "both":
            return torch.cat([norm_rsqrt(out, self.final_norm, 1e-6)[-self.keep :], (out - out.mean(0))[-self.keep :]])
        if self.tail == "select":  # hidden[-1]: the last row alone, [S] (``keep`` is 1)
            return norm_rsqrt(out, self.final_norm, 1e-6)[-1]
        if self.tail == "select_before_last":  # hidden[-2]: the row before the last alone, [S] (``keep`` is 1)
            return norm_rsqrt(out, self.final_norm, 1e-6)[-2]
        if self.tail == "before_last":  # hidden[-1 - keep : -1]
            return norm_rsqrt(out, self.final_norm, 1e-6)[-1 - self.keep : -1]
        if self.tail == "index":  # hidden[indices]: the last ``keep`` rows by a tensor index (a ragged batch's way)
            return norm_rsqrt(out, self.final_norm, 1e-6)[torch.arange(out.shape[0] - self.keep, out.shape[0])]
        if self.tail in ("two_sequences", "one_sequence"):  # [B, keep, S]: two token dims, the slice along the second
            sequences = out.view(2 if self.tail == "two_sequences" else 1, -1, out.shape[-1])
            return norm_rsqrt(sequences, self.final_norm, 1e-6)[:, -self.keep :]
        if self.tail == "fp8":
            codes, scales = quant_reference(norm_rsqrt(out, self.final_norm, 1e-6))
            return (codes[-self.keep :].float() * scales[-self.keep :]).to(out.dtype)
        raise ValueError(f"tail must be one of {TAILS}, got {self.tail!r}")

    def token_window(self, x: torch.Tensor) -> torch.Tensor:
        """A depthwise conv over the tokens of every stream, ``x [1, n*S, T] -> [1, n*S, T]``, spelled as
        ``WINDOWS`` lists: causal (row t reads rows t - 2 .. t) with a front zero pad or with the conv's own padding
        and the first T outputs kept, or centred (row t reads rows t - 1 .. t + 1)."""
        channels = x.shape[1]
        if self.window == "front_pad":
            return F.conv1d(F.pad(x, (2, 0)), self.conv, groups=channels)
        if self.window == "own_padding":
            return F.conv1d(x, self.conv, padding=2, groups=channels)[..., : x.shape[-1]]
        if self.window == "centred":
            return F.conv1d(F.pad(x, (1, 1)), self.conv, groups=channels)
        raise ValueError(f"window must be one of {WINDOWS}, got {self.window!r}")

    def before_gemms(self, x: torch.Tensor) -> torch.Tensor:
        """The sub-layer's steps on x before its GEMMs, as ``PROLOGUES`` lists them."""
        if self.prologue == "none":
            return x
        if self.prologue == "centred_bf16":
            return (x - x.mean(0, keepdim=True)).to(torch.bfloat16)
        normed = norm_rsqrt(x, self.sublayer_norm, 1e-6)
        return normed if self.prologue == "norm" else normed.to(torch.bfloat16)

    def sublayer_input(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """What sub-layer ``index`` reads of its HC block's x (subclasses quantise it)."""
        return x

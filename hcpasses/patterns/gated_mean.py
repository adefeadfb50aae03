"""The HC stream collapses and the per-token FP8 quant, written as plain torch functions.

These are the *search* sides of the fusion: each is traced once per activation dtype into an Inductor
pattern (``hcpasses.patterns.tracing``). They must be written exactly as model code writes them:

- ``transformers_gated_mean``: Qwen3.8-Flash-Next in transformers (``Qwen4ExpTextGatedResidual``):
  sigmoid and product in the activation dtype, ``mean`` over the stream dim.
- ``atom_gated_mean``: ATOM's port: fp32 inside, sum over streams, divide by n, one rounding.
- ``activation_sum_gated_mean``: ``sum / n`` in the activation dtype (in bf16 / fp16 the sum is rounded
  before the division: the mean's one rounding only when n is a power of two).
- ``mhc_collapse``: DeepSeek-V4 mHC on flat streams (our ``hcpasses.testing.models.mhc``): scalar gate per
  stream, fp32 sum, one rounding.
- ``stacked_mhc_collapse``: the same collapse as transformers' ``DeepseekV4HyperConnection`` writes it, on
  streams kept stacked as ``[..., n, S]``.
- ``unrounded_mhc_collapse`` / ``unrounded_stacked_mhc_collapse``: the same sums left in fp32 over bf16 / fp16
  streams, with no rounding to the streams' dtype: written so, or what torch 2.11's ``pointless_convert``
  leaves of ``.to(h.dtype)`` followed by an upcast (a norm's or a quant's ``.float()``).
- ``per_token_quant``: PTPC-FP8 activation quant (vLLM's convention, DESIGN §5); defined once in
  :mod:`hcpasses.kernels.contract` and re-exported here, so the pattern is the quant the models run.

Streams are ``[..., n*S]`` stream-major (stream s is columns ``s*S:(s+1)*S``) or stacked ``[..., n, S]``;
the leading dims are the tokens (``[T]`` in vLLM-style models, ``[batch, seq]`` in transformers).
"""

from __future__ import annotations

import torch

# The per-token quant's one definition (the quant of the models, of Fp8Linear and of the fused ops' reference).
from hcpasses.kernels.contract import per_token_quant

__all__ = [
    "activation_sum_gated_mean",
    "atom_gated_mean",
    "mhc_collapse",
    "per_token_quant",
    "stacked_mhc_collapse",
    "transformers_gated_mean",
    "unrounded_mhc_collapse",
    "unrounded_stacked_mhc_collapse",
]


def transformers_gated_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``mean_s(sigmoid(u_s) * xn_s)``: ``u`` the gate pre-activations, ``xn`` the normed streams."""
    return (torch.sigmoid(u).unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).mean(-2)


def atom_gated_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """The same mean in fp32 with one rounding: ``(sum_s sigmoid(u_s) * xn_s) / n``."""
    gated = torch.sigmoid(u.float()).unflatten(-1, (n, hidden)) * xn.float().unflatten(-1, (n, hidden))
    return (gated.sum(-2) / n).to(xn.dtype)


def activation_sum_gated_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``(sum_s sigmoid(u_s) * xn_s) / n`` in the activation dtype: the sum is rounded, then divided."""
    return (torch.sigmoid(u).unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))).sum(-2) / n


def mhc_collapse(w: torch.Tensor, h: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``sum_s w_s * h_s`` with a scalar fp32 gate ``w [T, n]`` per stream, one rounding."""
    return (w.unsqueeze(-1) * h.unflatten(-1, (n, hidden))).sum(-2).to(h.dtype)


def stacked_mhc_collapse(w: torch.Tensor, h: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``sum_s w_s * h_s`` over stacked streams ``h [..., n, S]`` with fp32 gates ``w [..., n]``, one rounding."""
    return (w.unsqueeze(-1) * h).sum(-2).to(h.dtype)


def unrounded_mhc_collapse(w: torch.Tensor, h: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``sum_s w_s * h_s`` over flat streams ``h [T, n*S]``, left in fp32."""
    return (w.unsqueeze(-1) * h.unflatten(-1, (n, hidden))).sum(-2)


def unrounded_stacked_mhc_collapse(w: torch.Tensor, h: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """``sum_s w_s * h_s`` over stacked streams ``h [..., n, S]``, left in fp32."""
    return (w.unsqueeze(-1) * h).sum(-2)

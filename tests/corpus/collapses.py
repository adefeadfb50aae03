"""Stream collapses as further code bases spell them (issue #26 item 4), written here, not copied, beside the
spellings of ``gated_residual.COLLAPSES`` and ``mhc_spelled.COLLAPSES`` (which the property tests draw from and
today's passes all take). Each gives ``[tokens, S]`` from the streams and per-token gates:

- ``GATED_MEANS``: the gated mean ``mean_s(sigmoid(u_s) * xn_s)`` of gate logits ``u`` and normed streams ``xn``,
  both ``[..., n*S]``, as ``(u, xn, n, hidden)``;
- ``WEIGHTED_SUMS``: the mHC collapse ``sum_s pre_s h_s`` of fp32 gates ``pre [..., n]`` and stacked streams
  ``h [..., n, S]``, as ``(pre, h)``.

``GatedMeanHC`` / ``WeightedSumMHC`` are the corpus models (``UserHC`` / ``SpelledMHC``) with every block's
collapse, the final mixer's included, spelled one of these ways, and each sub-layer input optionally quantised
by a ``quants.CORPUS`` spelling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .gated_residual import UserHC
from .mhc_spelled import MHCSpelling, SpelledMHC
from .quants import CORPUS


def gated_mean_einsum(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """The issue's third miss: ``torch.einsum("...nd,...nd->...d", gates, streams) / n``, the stream axis of
    (gates, normed streams) contracted by einsum in the activation dtype, as einsum-first HC ports write it."""
    gates, streams = torch.sigmoid(u).unflatten(-1, (n, hidden)), xn.unflatten(-1, (n, hidden))
    return torch.einsum("...nd,...nd->...d", gates, streams) / n


def gated_mean_stack_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """Per-stream chunks (``chunk(n, -1)``), one product each, ``torch.mean(torch.stack(...), dim=0)``: the
    list-of-streams form of Python-loop HC ports (hyper-connection reference code keeps streams as a list)."""
    products = [g * x for g, x in zip(torch.sigmoid(u).chunk(n, -1), xn.chunk(n, -1), strict=True)]
    return torch.mean(torch.stack(products), dim=0)


def gated_mean_fp32_stream_loop(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """fp32 accumulation stream by stream in a Python loop, ``/ n``, one rounding: how a kernel port (ATOM's
    Triton gated mean, the fused op's own torch reference) orders the sum, written as model code."""
    gates = torch.sigmoid(u.float()).unflatten(-1, (n, hidden))
    streams = xn.float().unflatten(-1, (n, hidden))
    total = gates[..., 0, :] * streams[..., 0, :]
    for s in range(1, n):
        total = total + gates[..., s, :] * streams[..., s, :]
    return (total / n).to(xn.dtype)


def gated_mean_gate_then_split(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """The gate applied to the flat streams, the product split after: ``(sigmoid(u) * xn).view(..., n, S)
    .sum(-2).div(n)``, as MLX ports (``mx.sigmoid(u) * x`` then a reshape) write it, in the activation dtype."""
    return (torch.sigmoid(u) * xn).view(*xn.shape[:-1], n, hidden).sum(-2).div(n)


def weighted_sum_matmul_operator(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``(pre.to(h.dtype).unsqueeze(-2) @ h).squeeze(-2)``: a broadcasting ``@`` over the token dims, no reshape
    to ``[T, ...]`` (community mHC ports)."""
    return (pre.to(h.dtype).unsqueeze(-2) @ h).squeeze(-2)


def weighted_sum_bmm_squeeze(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's ``hc_pre`` form (gates ``type_as`` the streams, ``[s*b, 1, e] x [s*b, e, h]``) as
    ``torch.bmm`` with ``squeeze(1)`` and a reshape back to the token dims."""
    *lead, n, hidden = h.shape
    gates = pre.type_as(h).reshape(-1, 1, n)
    return torch.bmm(gates, h.reshape(-1, n, hidden)).squeeze(1).reshape(*lead, hidden)


def weighted_sum_fp32_einsum(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``torch.einsum("...n,...nd->...d", pre, h.float()).to(h.dtype)``: the einsum in fp32 with the gates left
    fp32 (lucidrains-style hyper-connections use einsum for the width connection), rounded once."""
    return torch.einsum("...n,...nd->...d", pre, h.float()).to(h.dtype)


GATED_MEANS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]] = {
    "einsum": gated_mean_einsum,
    "stack_mean": gated_mean_stack_mean,
    "fp32_stream_loop": gated_mean_fp32_stream_loop,
    "gate_then_split": gated_mean_gate_then_split,
}
WEIGHTED_SUMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "matmul_operator": weighted_sum_matmul_operator,
    "bmm_squeeze": weighted_sum_bmm_squeeze,
    "fp32_einsum": weighted_sum_fp32_einsum,
}


class GatedMeanHC(UserHC):
    """``UserHC`` (rsqrt norm) whose every gated mean is ``GATED_MEANS[collapse]``, each sub-layer reading its
    input through ``CORPUS[quant]`` and back (a PTPC-FP8 linear's input), or unquantised for None."""

    def __init__(
        self,
        collapse: str,
        quant: str | None,
        layers: int = 1,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__("rsqrt", layers, None, dtype, tp, rank)
        self.quant = quant
        for block in (*self.blocks, self.final):
            block.collapse = GATED_MEANS[collapse]

    def sublayer_input(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return x
        q, scale = CORPUS[self.quant](x)
        return (q.float() * scale).to(x.dtype)


class WeightedSumMHC(SpelledMHC):
    """``SpelledMHC`` with ``layers`` blocks (and the final collapse) spelled ``WEIGHTED_SUMS[collapse]``, each
    sub-layer input quantised by ``quants.QUANTS[quant]`` or unquantised for None."""

    def __init__(
        self,
        collapse: str,
        quant: str | None,
        layers: int = 1,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__([MHCSpelling("transformers", quant)] * layers, "transformers", dtype, tp, rank)
        for block in (*self.blocks, self.final):
            block.collapse = WEIGHTED_SUMS[collapse]

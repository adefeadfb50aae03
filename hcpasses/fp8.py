"""Per-token FP8 (e4m3) quantisation and a PTPC-FP8 linear layer (DESIGN §5), for models the library
rewrites (``hcpasses.hf.swap_fp8_linears``) and for the reference models (``hcpasses.testing.models.fp8``).

Convention (vLLM's per-token kernel): ``scale = max(amax / 448, 1 / (448 * 512))`` with amax taken from x
upcast to fp32, ``q = clamp(x / scale, -448, 448)`` cast with round-to-nearest-even. The clamp comes before the
cast because torch 2.11 turns an overflowing cast into NaN. Defined once, as
:func:`hcpasses.kernels.contract.per_token_quant`.
"""

from __future__ import annotations

import torch
from torch import nn

# One set of constants and one quant for the reference models, the fused kernels and their contract.
from hcpasses.kernels.contract import FP8_DTYPE, FP8_MAX, MIN_SCALE, per_token_quant

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "Fp8Linear", "quantize_per_token"]

# Quantise each row of ``x [T, K]``: ``(q float8_e4m3fn [T, K], scale fp32 [T, 1])``. The contract's function
# itself, so that the quant Dynamo traces from model code is the one the fusion's patterns were traced from (its
# constants are literals inside it: under dynamic=True Dynamo turns a global float into a graph input).
quantize_per_token = per_token_quant


class Fp8Linear(nn.Module):
    """PTPC-FP8 linear: weight quantised once per output channel, x quantised per token at each call.

    ``weight`` is the (already sharded) ``[out, in]`` weight in any float dtype. The output has x's dtype.
    On CUDA with a bf16 x and 16-aligned sizes the product runs as a row-wise scaled ``torch._scaled_mm``;
    elsewhere the float reference ``(q * scale) @ (wq * wscale)^T`` runs.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        weight_q, weight_scale = quantize_per_token(weight)
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out]`` in x's dtype (any leading token dims)."""
        q, scale = quantize_per_token(x)
        if self._use_scaled_mm(x):
            # _scaled_mm takes 2-D operands only: flatten the token dims, restore them after.
            out = torch._scaled_mm(
                q.reshape(-1, q.shape[-1]),
                self.weight_q.t(),
                scale_a=scale.reshape(-1, 1),
                scale_b=self.weight_scale.t(),
                out_dtype=x.dtype,
            )
            return out.reshape(*x.shape[:-1], out.shape[-1])
        w = self.weight_q.float() * self.weight_scale
        return ((q.float() * scale) @ w.t()).to(x.dtype)

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        """Whether the CUDA row-wise scaled GEMM supports this call (decided from static properties only)."""
        out_features, in_features = self.weight_q.shape
        return x.is_cuda and x.dtype == torch.bfloat16 and in_features % 16 == 0 and out_features % 16 == 0

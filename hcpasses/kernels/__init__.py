"""Fused kernels that hcpasses' rewrites call; importing this package registers the custom ops."""

from hcpasses.kernels.gated_mean_quant import (
    gated_mean_quant_reference,
    quant_epilogue_reference,
    weighted_sum_quant_reference,
)

__all__ = ["gated_mean_quant_reference", "quant_epilogue_reference", "weighted_sum_quant_reference"]

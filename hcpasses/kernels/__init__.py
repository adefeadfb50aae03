"""Fused kernels that hcpasses' rewrites call; importing this package registers the custom ops."""

import hcpasses.kernels.gated_mean_quant  # noqa: F401  (registers the ops)
from hcpasses.kernels.contract import (
    gated_mean_quant_reference,
    quant_epilogue_reference,
    weighted_sum_quant_reference,
)

__all__ = ["gated_mean_quant_reference", "quant_epilogue_reference", "weighted_sum_quant_reference"]

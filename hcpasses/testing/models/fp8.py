"""The reference models' FP8 layers: the library's per-token quant and PTPC-FP8 linear (``hcpasses.fp8``,
re-exported here) and a column-parallel PTPC-FP8 linear with the weights of the models' TP layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hcpasses.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Linear, quantize_per_token

from .tp import ColumnParallelLinear

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "Fp8ColumnParallelLinear", "Fp8Linear", "quantize_per_token"]


class Fp8ColumnParallelLinear(Fp8Linear):
    """Column-parallel :class:`Fp8Linear` with the same weights as :class:`~.tp.ColumnParallelLinear`.

    The weight is quantised per output channel after sharding, which equals sharding the quantised full
    weight (each channel's scale depends only on that channel).
    """

    def __init__(self, in_features: int, out_features: int | Sequence[int], **weights: Any) -> None:
        """``weights``: :class:`~.tp.ColumnParallelLinear`'s keywords (``seed``, ``name``, ``dtype``, ``tp_rank``,
        ``tp_size``), whose weight this layer quantises."""
        super().__init__(ColumnParallelLinear(in_features, out_features, **weights).weight.detach())

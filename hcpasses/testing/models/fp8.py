"""The reference models' FP8 layers: the library's per-token quant and PTPC-FP8 linear (``hcpasses.fp8``,
re-exported here) and a column-parallel PTPC-FP8 linear with the weights of the models' TP layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hcpasses.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Linear, quantize_per_token

from .tp import column_parallel_weight, resolve_tp

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "Fp8ColumnParallelLinear", "Fp8Linear", "quantize_per_token"]


class Fp8ColumnParallelLinear(Fp8Linear):
    """Column-parallel :class:`Fp8Linear` with the same weights as :class:`~.tp.ColumnParallelLinear`.

    The weight is quantised per output channel after sharding, which equals sharding the quantised full
    weight (each channel's scale depends only on that channel).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        seed: int,
        name: str,
        dtype: torch.dtype = torch.float32,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        parts = [out_features] if isinstance(out_features, int) else list(out_features)
        rank, size = resolve_tp(tp_rank, tp_size)
        weight = column_parallel_weight(
            in_features, parts, seed=seed, name=name, dtype=dtype, tp_rank=rank, tp_size=size
        )
        super().__init__(weight)
        self.tp_rank, self.tp_size = rank, size

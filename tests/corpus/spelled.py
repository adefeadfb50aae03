"""An HC model whose every block is spelled its own way: grouped norm, stream collapse and sub-layer input
quant drawn per block from the corpus (``NORMS``, ``COLLAPSES``, ``QUANTS``), so one graph mixes forms from
several code bases the way a model file and its quant library do.

``FUSES`` says which collapse spellings the fusion must fuse with the quant behind them (n = 4 streams) and
why the others are left alone; every collapse spelling here must be found by SP (exact counts follow from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .gated_residual import COLLAPSES, GatedResidual, UserHC
from .quants import QUANTS

# Whether the fused op (fp32 products, one rounding of the mean) gives what the spelling gives, at n = 4.
FUSES: dict[str, bool] = {
    "unflatten_mean": True,  # within one rounding: the spelling rounds each bf16 product first
    "view_positive_dim": True,  # the same graph as unflatten_mean but for the view sizes and the dim index
    "fp32_sum_div": True,  # bit-identical but for the summation order of n = 4 terms
    "fp32_sum_times_reciprocal": True,  # * (1/4) is exactly / 4: canonical_forms rewrites it
    "activation_sum_div": True,  # bf16: the rounded sum / 4 is exact, so it is the mean's one rounding
}


@dataclasses.dataclass(frozen=True)
class BlockSpelling:
    norm: str
    collapse: str
    quant: str | None  # None: the sub-layer reads x unquantised

    @property
    def fuses(self) -> bool:
        return self.quant is not None and FUSES[self.collapse]


class SpelledHC(UserHC):
    """``UserHC`` with one ``BlockSpelling`` per HC block (2 per layer) and one for the final mixer."""

    def __init__(
        self,
        blocks: Sequence[BlockSpelling],
        final: BlockSpelling,
        conv_layer: int | None = None,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        rank: int = 0,
        n: int = 4,
    ) -> None:
        if len(blocks) % 2:
            raise ValueError(f"two HC blocks per layer (attention-free: two SwiGLU sub-layers); got {len(blocks)}")
        super().__init__("rsqrt", len(blocks) // 2, conv_layer, dtype, tp, rank, n)
        g = torch.Generator().manual_seed(1)
        self.spellings = list(blocks)
        for index, spelling in enumerate(blocks):
            self.blocks[index] = self._block(spelling, g, dtype)
        self.final = self._block(final, g, dtype)

    def _block(self, spelling: BlockSpelling, g: torch.Generator, dtype: torch.dtype) -> GatedResidual:
        return GatedResidual(self.n, self.embed.shape[1], 8, spelling.norm, g, dtype, spelling.collapse)

    def sublayer_input(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """x through this block's quant spelling and back (a PTPC-FP8 linear's input), or x itself."""
        quant = self.spellings[index].quant
        if quant is None:
            return x
        q, scale = QUANTS[quant](x)
        return (q.float() * scale).to(x.dtype)


__all__ = ["COLLAPSES", "FUSES", "BlockSpelling", "SpelledHC"]

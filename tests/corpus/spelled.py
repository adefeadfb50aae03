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
import torch.nn.functional as F

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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids].repeat(1, self.n)
        for index, (block, sublayer) in enumerate(zip(self.blocks, self.sublayers, strict=True)):
            if index == 2 * (self.conv_layer if self.conv_layer is not None else -1):
                conv = F.conv1d(F.pad(h.t().unsqueeze(0), (2, 0)), self.conv, groups=h.shape[-1])
                h = h + conv[0].t()
            x, inject = block(h)
            quant = self.spellings[index].quant
            if quant is not None:
                q, scale = QUANTS[quant](x)
                x = (q.float() * scale).to(x.dtype)
            h = block.combine(h, sublayer(x), inject)
        return F.linear(self.final(h)[0], self.head)


__all__ = ["COLLAPSES", "FUSES", "BlockSpelling", "SpelledHC"]

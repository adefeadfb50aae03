"""Plain eager reference models: an HC (hyper-connection) decoder with tensor parallelism and PTPC-FP8."""

from .config import HCConfig
from .decoder import HCDecoder
from .fp8 import Fp8ColumnParallelLinear, Fp8Linear, quantize_per_token
from .hc import FinalMixer, HyperConnection
from .tp import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "FinalMixer",
    "Fp8ColumnParallelLinear",
    "Fp8Linear",
    "HCConfig",
    "HCDecoder",
    "HyperConnection",
    "RowParallelLinear",
    "quantize_per_token",
]

"""Plain eager reference models: an HC (hyper-connection) decoder with tensor parallelism and PTPC-FP8."""

from .bench_model import BenchDecoder, MixerSizes
from .config import HCConfig
from .decoder import HCDecoder
from .fp8 import Fp8ColumnParallelLinear, Fp8Linear, quantize_per_token
from .hc import FinalMixer, HyperConnection
from .mhc import ManifoldHyperConnection, ManifoldHyperHead, MHCDecoder
from .mtp import MTPDrafter, prefill_target_and_drafter
from .sp_handwritten import HandwrittenSPDecoder
from .speculative import SpecResult, SpecStats, StepFunctions, greedy_decode, speculative_decode
from .tp import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "BenchDecoder",
    "ColumnParallelLinear",
    "FinalMixer",
    "Fp8ColumnParallelLinear",
    "Fp8Linear",
    "HCConfig",
    "HCDecoder",
    "HandwrittenSPDecoder",
    "HyperConnection",
    "MHCDecoder",
    "MTPDrafter",
    "ManifoldHyperConnection",
    "ManifoldHyperHead",
    "MixerSizes",
    "RowParallelLinear",
    "SpecResult",
    "SpecStats",
    "StepFunctions",
    "greedy_decode",
    "prefill_target_and_drafter",
    "quantize_per_token",
    "speculative_decode",
]

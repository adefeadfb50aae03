"""Configuration of the reference HC decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hcpasses.tp import resolve_tp

_DTYPES = (torch.float32, torch.bfloat16)
_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden",
    "n_streams",
    "hc_rank",
    "n_layers",
    "n_heads",
    "head_dim",
    "n_kv_heads",
    "intermediate",
)

# The presets HCConfig.tiny and HCConfig.real: a value for each of _POSITIVE_FIELDS (vocab, S, n, r, layers, heads,
# head_dim, kv heads, intermediate), then the dtype.
_TINY = dict(zip(_POSITIVE_FIELDS, (64, 32, 4, 8, 2, 4, 8, 2, 64), strict=True), dtype=torch.float32)
_REAL = dict(zip(_POSITIVE_FIELDS, (32000, 2560, 4, 320, 4, 16, 256, 2, 5632), strict=True), dtype=torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class HCConfig:
    """Sizes and options of an HC decoder (Qwen3.8-Flash-Next gated residual, DESIGN §2).

    ``hidden`` is S, the width of one stream; the residual streams are ``[T, n_streams * hidden]``.
    ``ple_layer`` is the index of the layer that starts with the PLE layer (None: no PLE).
    ``fp8`` makes the sub-layer input projections (qkv, gate_up) quantise x per token (DESIGN §5).
    ``seed`` fixes every weight: a model built with any tensor-parallel size gets the same weights.
    ``dtype`` is the activation and parameter dtype (float32 or bfloat16).
    """

    vocab_size: int
    hidden: int
    n_streams: int = 4
    hc_rank: int
    n_layers: int
    n_heads: int
    head_dim: int
    n_kv_heads: int
    intermediate: int
    eps: float = 1e-6
    ple_layer: int | None = None
    fp8: bool = False
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HCConfig.{name} must be an int >= 1, got {value!r}")
        if not self.eps > 0:
            raise ValueError(f"HCConfig.eps must be > 0, got {self.eps!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"HCConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"HCConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.ple_layer is not None and not 0 <= self.ple_layer < self.n_layers:
            raise ValueError(f"HCConfig.ple_layer must be None or in [0, {self.n_layers - 1}], got {self.ple_layer!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"HCConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def streams_width(self) -> int:
        """Width n*S of the residual streams."""
        return self.n_streams * self.hidden

    def tp_of(self, tp_rank: int | None, tp_size: int | None, group: dist.ProcessGroup | None) -> tuple[int, int]:
        """This process's ``(rank, size)`` in ``group`` where not given (``hcpasses.tp.resolve_tp``), checked
        against the sharded sizes."""
        rank, size = resolve_tp(tp_rank, tp_size, group)
        self.check_tp(size)
        return rank, size

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError if the sharded sizes are not divisible by ``tp_size``."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        for name in ("n_heads", "n_kv_heads", "intermediate"):
            value = getattr(self, name)
            if value % tp_size != 0:
                raise ValueError(f"HCConfig.{name} ({value}) must be divisible by the TP size ({tp_size})")

    @classmethod
    def tiny(cls, **overrides: Any) -> HCConfig:
        """A few-kilobyte model for tests: S=32, n=4, r=8, 2 layers, 4 heads x 8, 2 kv heads, fp32."""
        return cls(**{**_TINY, **overrides})

    @classmethod
    def real(cls, **overrides: Any) -> HCConfig:
        """Real per-layer sizes (S 2560, n 4, r 320, 16 heads x 256, 2 kv heads), 4 layers, bf16."""
        return cls(**{**_REAL, **overrides})

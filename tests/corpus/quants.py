"""Per-token FP8 quants of an activation ``x [T, K]`` as public code bases spell them (written here, not
copied). Each returns ``(q float8_e4m3fn, scale fp32 [T, 1])`` with ``scale = max(amax / 448, 1/(448*512))``
(DESIGN §5); they differ only in spelling, so each gives the same q and scale for the same x."""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-reference style: upcast, amax of abs, clamp(min), divide, clamp, cast."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX, min=MIN_SCALE)
    return torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def quant_amax_then_upcast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax taken in the activation dtype, then upcast (exact: the max of bf16 values is a bf16 value)."""
    amax = x.abs().amax(-1, keepdim=True).float()
    scale = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def quant_max_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(..., dim=-1, keepdim=True).values`` for the amax."""
    xf = x.float()
    amax = torch.max(xf.abs(), dim=-1, keepdim=True).values
    scale = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)
    return torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def quant_method_chain(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Method chains: ``amax.div(448).clamp_min(...)``, ``.clamp(min=, max=)``, finfo for the max."""
    fmax = torch.finfo(FP8).max
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True).div(fmax).clamp_min(1.0 / (fmax * 512.0))
    return (xf / scale).clamp(min=-fmax, max=fmax).to(FP8), scale


QUANTS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "reference": quant_reference,
    "amax_then_upcast": quant_amax_then_upcast,
    "max_values": quant_max_values,
    "method_chain": quant_method_chain,
}

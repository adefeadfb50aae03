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


# The spellings read in other code bases since (issue #26 item 4), each written here from what its source does,
# not copied. ``QUANTS`` above stays the set the pattern-era property tests draw from (each fuses, with known
# canonical-forms counts); ``CORPUS`` is every spelling, classified against the contract in ``IDENTICAL`` /
# ``NEAR_MISSES`` (tests/test_corpus_classification.py checks both labels by evaluation).
FP8_MIN = torch.finfo(FP8).min


def quant_vllm_upcast_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's torch reference of its per-token CUDA kernel as a bf16 model runs it (the issue's first miss):
    one ``x.to(torch.float32)`` feeds both ``torch.amax(torch.abs(...))`` and the division; the bounds are
    ``torch.finfo`` min and max, the floor ``1 / (max * 512)`` (vllm/model_executor/layers/quantization)."""
    xf = x.to(torch.float32)
    amax = torch.amax(torch.abs(xf), dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    return (xf / scale).clamp(FP8_MIN, FP8_MAX).to(FP8), scale


def quant_maximum_floor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale floor as ``torch.maximum`` with a 0-dim tensor constant (the issue's second miss: the same
    numbers as ``clamp(min=)``), as TE-style references floor an amax with ``torch.max(amax, torch.tensor(eps))``."""
    xf = x.float()
    scale = torch.maximum(xf.abs().amax(-1, keepdim=True) / FP8_MAX, torch.tensor(MIN_SCALE))
    return torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def quant_amax_floor_before_division(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The floor on the amax before the division, as SGLang's and DeepSeek-V3.2's kernels place their eps, but
    with vLLM's value ``448 * MIN_SCALE = 1/512``: ``clamp(amax, 1/512) / 448`` rounds to the same fp32 scale."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=FP8_MAX * MIN_SCALE) / FP8_MAX
    return torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def quant_vllm_native_reciprocal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``QuantFP8.forward_native`` (vllm/model_executor/layers/quantization/input_quant_fp8.py), per token:
    ``x.abs().max(dim=-1)`` values without keepdim, ``unsqueeze(-1)``, upcast after the max, the floor by
    ``clamp(min=)``, then ``x.to(float32) * scale.reciprocal()`` (a reciprocal multiply, chosen there for speed)."""
    token_max, _ = x.abs().max(dim=-1)
    scale = (token_max.unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.to(torch.float32) * scale.reciprocal()).clamp(FP8_MIN, FP8_MAX).to(FP8), scale


def quant_vllm_kernel_test_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's kernel-test reference ``ref_dynamic_per_token_quant`` (tests/kernels/quant_utils.py): every constant
    an fp32 tensor (``1``, the FP8 max, ``512``), the floor ``1 / (max * 512)`` computed in fp32, the codes from
    ``x * (1 / scale)`` with the inverse scale materialised first."""
    fp8_max, one = torch.tensor(FP8_MAX), torch.tensor(1.0)
    token_max, _ = x.abs().max(dim=-1)
    scale = (token_max.to(torch.float32) / fp8_max)[:, None].clamp(min=one / (fp8_max * torch.tensor(512.0)))
    inverse = one / scale
    return (x.to(torch.float32) * inverse).clamp(-fp8_max, fp8_max).to(FP8), scale


def quant_sglang_amax_eps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's per-token Triton kernel ``_per_token_quant_fp8`` (python/sglang/srt/layers/quantization/
    fp8_kernel.py), in torch: the amax of the fp32 row floored at ``1e-10`` before ``/ fp8_max`` (no scale
    floor of 1/(448*512)), then ``clamp(x / scale)``."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True), min=1e-10) / FP8_MAX
    return torch.clamp(xf / scale, FP8_MIN, FP8_MAX).to(FP8), scale


def quant_deepseek_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's ``act_quant`` (inference/kernel.py) with one block per row: ``s = max(|x|) / 448.``,
    ``y = x / s`` cast straight to FP8: no scale floor and no clamp (a zero row divides 0 by 0)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 448.0
    return (xf / scale).to(FP8), scale


def quant_torchao_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao float8 rowwise (torchao/float8/float8_utils.py ``tensor_to_amax`` / ``amax_to_scale`` /
    ``to_fp8_saturated``): bf16 upcast as ``abs(x).to(float32)`` then abs again, amax in float64, the multiplier
    ``finfo.max / clamp(amax, 1e-12)`` rounded to fp32, codes from ``x * multiplier`` saturated by clamp; the
    dequant scale is the multiplier's reciprocal."""
    fmax = torch.finfo(FP8).max
    magnitude = torch.abs(x).to(torch.float32) if x.dtype == torch.bfloat16 else x
    amax = torch.amax(torch.abs(magnitude), dim=-1, keepdim=True).to(torch.float64)
    multiplier = (fmax / torch.clamp(amax, min=1e-12)).to(torch.float32)
    codes = (x.to(torch.float32) * multiplier).clamp(min=-fmax, max=fmax).to(FP8)
    return codes, multiplier.reciprocal()


def quant_te_current_scaling(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer Engine's current-scaling reference (tests/pytorch/references, ``_ref_compute_amax_scale``),
    taken per row as a per-token recipe would: amax of the fp32 row floored by ``torch.max(amax,
    torch.tensor(eps))`` with eps 0, ``scale = torch.div(fp8_max, amax)`` (1 where amax is 0), codes from
    ``x * scale``, dequant by ``scale_inv = 1 / scale``."""
    xf = x.to(torch.float32)
    amax = torch.max(torch.amax(torch.abs(xf), dim=-1, keepdim=True), torch.tensor(0.0))
    scale = torch.div(FP8_MAX, amax)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return (xf * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), 1.0 / scale


def quant_trtllm_activation_dtype_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's test of ``quantize_e4m3_activation`` (tests/unittest/.../test_fp8_quantization.py): the
    reference scale ``(torch.max(x, -1)[0].float() / 448).to(x.dtype)`` is rounded to the activation dtype (taken
    here with abs, as the kernel does), no floor; codes from ``x.float() / scale``."""
    amax = torch.max(x.abs(), -1)[0].float()
    scale = (amax / 448.0).to(x.dtype).float().unsqueeze(-1)
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(FP8), scale


CORPUS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    **QUANTS,
    "vllm_upcast_first": quant_vllm_upcast_first,
    "maximum_floor": quant_maximum_floor,
    "amax_floor_before_division": quant_amax_floor_before_division,
    "vllm_native_reciprocal": quant_vllm_native_reciprocal,
    "vllm_kernel_test_reference": quant_vllm_kernel_test_reference,
    "sglang_amax_eps": quant_sglang_amax_eps,
    "deepseek_act_quant": quant_deepseek_act_quant,
    "torchao_rowwise": quant_torchao_rowwise,
    "te_current_scaling": quant_te_current_scaling,
    "trtllm_activation_dtype_scale": quant_trtllm_activation_dtype_scale,
}

# Against the contract (hcpasses.kernels.contract.per_token_quant), by eager evaluation on the probes of
# tests/test_corpus_classification.py in fp32, bf16 and fp16: bit-identical codes and scales, or the first probe
# that separates the spelling (the fusion must leave a near miss alone: it would change the graph's values).
IDENTICAL: frozenset[str] = frozenset(
    {
        "reference",
        "amax_then_upcast",
        "max_values",
        "method_chain",
        "vllm_upcast_first",
        "maximum_floor",
        "amax_floor_before_division",
    }
)
NEAR_MISSES: dict[str, str] = {
    "vllm_native_reciprocal": "ties between FP8 codes",  # x * (1/scale) is not x / scale
    "vllm_kernel_test_reference": "ties between FP8 codes",
    "sglang_amax_eps": "all-zero rows",  # scale 1e-10/448, not the floor (and below it, another scale)
    "deepseek_act_quant": "all-zero rows",  # 0/0: NaN codes
    "torchao_rowwise": "all-zero rows",  # 1/(448/1e-12); elsewhere 1/(448/amax) is not amax/448 bit for bit
    "te_current_scaling": "all-zero rows",  # scale 1 where amax is 0
    "trtllm_activation_dtype_scale": "all-zero rows",  # no floor; in bf16 / fp16 the scale is rounded too
}

"""The fused HC collapse + per-token FP8 quant as torch custom ops (DESIGN §2, §5).

``torch.ops.hcpasses.gated_mean_quant(xn, u, n_streams)``: the Qwen3.8-Flash-Next gated mean
``x = mean_s(sigmoid(u_s) * xn_s)``; ``torch.ops.hcpasses.weighted_sum_quant(h, w, n_streams)``: the
DeepSeek-V4 mHC collapse ``x = sum_s w[:, s] * h_s``. Both take stream-major ``[T, n*S]`` inputs (stream s
is columns ``s*S:(s+1)*S``) and return ``(x [T, S] in the input dtype, q float8_e4m3fn [T, S], scale
float32 [T, 1])``.

Rounding convention (ATOM's): fp32 inside, the streams summed in fixed order s = 0..n-1, x rounded once
to the activation dtype; then the quant of :func:`hcpasses.fp8.quantize_per_token` on that rounded x:
``scale = max(amax / 448, 1 / (448 * 512))``, ``q = clamp(x / scale, ±448)`` cast with round-to-nearest-
even. Every division is IEEE-rounded on every device, so q and scale are a function of x alone.

Both ops are ``torch.library.triton_op``s when Triton is installed: the op's body runs the torch
reference below on CPU (and any device without a kernel) and, on CUDA, launches the Triton kernel of
:mod:`hcpasses.kernels.triton_gated_mean_quant` through ``torch.library.wrap_triton``. Eager calls launch
it directly; a graph that torch.compile traces through the op (a user function calling it) decomposes it
into the kernel launch, which Inductor then makes itself. A call that hcpasses' fusion pass inserts into
the post-grad graph is not decomposed any more; :mod:`hcpasses.kernels.inductor_lowering` gives Inductor
a lowering that launches the kernel there too. The explicit fake implementations below replace the body
as the ops' fake kernels. Without Triton the ops are plain custom ops running the reference.
"""

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from hcpasses.kernels.contract import (
    Outputs,
    empty_outputs,
    gated_mean_quant_reference,
    validate_gated_mean_inputs,
    validate_weighted_sum_inputs,
    weighted_sum_quant_reference,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:  # the kernels and their Inductor lowering import the contract only, never this module
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from hcpasses.kernels.inductor_lowering import register_lowerings
    from hcpasses.kernels.triton_gated_mean_quant import (
        gated_mean_quant_cuda,
        interpreting,
        weighted_sum_quant_cuda,
    )


def _gated_mean_quant(xn: torch.Tensor, u: torch.Tensor, n_streams: int) -> Outputs:
    """Fused HC gated mean + per-token FP8 quant: ``(x [T, S], q fp8 [T, S], scale fp32 [T, 1])``."""
    if xn.device.type == "cuda" and HAS_TRITON:
        validate_gated_mean_inputs(xn, u, n_streams)
        return gated_mean_quant_cuda(xn, u, n_streams)
    return gated_mean_quant_reference(xn, u, n_streams)


def _weighted_sum_quant(h: torch.Tensor, w: torch.Tensor, n_streams: int) -> Outputs:
    """Fused mHC collapse ``sum_s w[:, s] * h_s`` + per-token FP8 quant; outputs as ``gated_mean_quant``."""
    if h.device.type == "cuda" and HAS_TRITON:
        validate_weighted_sum_inputs(h, w, n_streams)
        return weighted_sum_quant_cuda(h, w, n_streams)
    return weighted_sum_quant_reference(h, w, n_streams)


_define_op = torch.library.triton_op if HAS_TRITON else torch.library.custom_op
gated_mean_quant = _define_op("hcpasses::gated_mean_quant", _gated_mean_quant, mutates_args=())
weighted_sum_quant = _define_op("hcpasses::weighted_sum_quant", _weighted_sum_quant, mutates_args=())


@gated_mean_quant.register_fake
def _gated_mean_quant_fake(xn: torch.Tensor, u: torch.Tensor, n_streams: int) -> Outputs:
    """Output shapes and dtypes of ``gated_mean_quant``."""
    validate_gated_mean_inputs(xn, u, n_streams)
    return empty_outputs(xn, xn.shape[1] // n_streams)


@weighted_sum_quant.register_fake
def _weighted_sum_quant_fake(h: torch.Tensor, w: torch.Tensor, n_streams: int) -> Outputs:
    """Output shapes and dtypes of ``weighted_sum_quant``."""
    validate_weighted_sum_inputs(h, w, n_streams)
    return empty_outputs(h, h.shape[1] // n_streams)


def _decompose_on_cuda_only(body: Callable[..., Outputs]) -> Callable[..., object]:
    """FunctionalTensorMode rule: trace through the op (into its kernel launch) only for CUDA inputs.

    Replaces triton_op's own rule, which traces through on every device. On CPU that would hand the torch
    reference to the compiler as plain ATen ops, and Inductor's code for them is not the reference (its
    quant divides by 448 as a multiply, so scales and codes differ). Kept as an op node instead, the CPU
    op stays the reference in compiled graphs too (Inductor calls it). Like triton_op's rule, it keeps the
    node while torch.export has decomposition off, and under the Triton interpreter.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.export._trace import custom_triton_ops_decomposition_disabled

    def rule(mode: Any, op: Any, types: Any, args: tuple, kwargs: dict) -> object:
        streams = args[0] if args else next(iter(kwargs.values()))
        if custom_triton_ops_decomposition_disabled() or streams.device.type != "cuda" or interpreting():
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(not issubclass(t, FakeTensor) and t not in (torch.Tensor, FunctionalTensor) for t in types):
            return NotImplemented
        with mode:
            return body(*args, **kwargs)

    return rule


if HAS_TRITON:
    gated_mean_quant.register_torch_dispatch(FunctionalTensorMode, _decompose_on_cuda_only(_gated_mean_quant))
    weighted_sum_quant.register_torch_dispatch(FunctionalTensorMode, _decompose_on_cuda_only(_weighted_sum_quant))
    register_lowerings(gated_mean_quant._opoverload, weighted_sum_quant._opoverload)

"""Inductor lowerings that launch the fused collapse + quant kernel for ops in a post-grad graph.

``torch.library.triton_op`` makes a compiled graph call the Triton kernel only when AOTAutograd traces
*through* the op (a user function calling ``torch.ops.hcpasses.gated_mean_quant``): the op is decomposed
into ``triton_kernel_wrapper_functional`` under FunctionalTensorMode. hcpasses' fusion pass inserts the
op later, into the post-grad graph, where nothing decomposes it; without a lowering Inductor would emit
a fallback call (the dispatcher, the op's Python body and Triton's Python launcher on every call).

The lowering registered here gives Inductor what the decomposition would have given it: empty outputs
and one user-defined Triton kernel launch (the ``triton_kernel_wrapper_mutation`` lowering, the same path
as any ``wrap_triton`` call), with the launch of :func:`triton_gated_mean_quant.kernel_plan`. Inputs are
made contiguous first (a layout constraint on the op). Anything it does not handle goes to Inductor's
plain fallback: a device other than CUDA (the torch reference), a symbolic width, or the interpreter.

These are Inductor internals (``torch._inductor.lowering``, ``triton_kernel_wrapper_mutation``); the
registration checks that every piece exists and otherwise leaves the ops as fallbacks, and
tests/test_kernels.py runs compiled graphs both ways on the GPU.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import sympy
import torch
import triton

from hcpasses.kernels import triton_gated_mean_quant as tk

log = logging.getLogger(__name__)
REGISTERED: list[torch._ops.OpOverload] = []


def register_lowerings(gated_mean_op: torch._ops.OpOverload, weighted_sum_op: torch._ops.OpOverload) -> bool:
    """Register the lowerings for the two ops (once); False when Inductor lacks the pieces."""
    try:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_mutation
        from torch._inductor import lowering
    except ImportError as exc:  # pragma: no cover - an Inductor without user-defined Triton kernels
        log.info("hcpasses: no Inductor lowering for the fused ops (%s)", exc)
        return False
    needed = ("add_layout_constraint", "empty_strided", "fallback_handler", "register_lowering", "require_contiguous")
    if triton_kernel_wrapper_mutation not in lowering.lowerings or not all(hasattr(lowering, n) for n in needed):
        log.info("hcpasses: this Inductor lacks what the fused ops' lowering uses; they stay fallbacks")
        return False
    del kernel_side_table  # imported above only to check that it exists
    for op, gated in ((gated_mean_op, True), (weighted_sum_op, False)):
        if op in REGISTERED:
            continue
        lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(_lower, op, gated))
        lowering.add_layout_constraint(op, lowering.require_contiguous)
        REGISTERED.append(op)
    return True


@functools.cache
def _kernel_with_warps(num_warps: int) -> Any:
    """The kernel wrapped as a one-config autotuner carrying ``num_warps`` (as Dynamo wraps such launches)."""
    return triton.autotune(configs=[triton.Config({}, num_warps=num_warps)], key=[])(tk._collapse_quant_kernel)


def _static_int(expr: Any) -> int | None:
    """``expr`` as an int when it is a constant, else None."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Expr) and expr.is_Integer:
        return int(expr)
    return None


def _lower(op: torch._ops.OpOverload, gated: bool, streams: Any, gates: Any, n_streams: int) -> Any:
    """Lower one fused op: the Triton kernel on CUDA, Inductor's fallback (the op's body) elsewhere."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_mutation
    from torch._inductor import lowering

    device = streams.get_device()
    tokens, width = streams.get_size()
    width = _static_int(width)
    if device is None or device.type != "cuda" or width is None or tk.interpreting() or width % n_streams:
        return lowering.fallback_handler(op, add_to_fallback_set=False)(streams, gates, n_streams)
    hidden = width // n_streams
    dtype = streams.get_dtype()
    x = lowering.empty_strided([tokens, hidden], [hidden, 1], dtype=dtype, device=device)
    q = lowering.empty_strided([tokens, hidden], [hidden, 1], dtype=torch.float8_e4m3fn, device=device)
    scale = lowering.empty_strided([tokens, 1], [1, 1], dtype=torch.float32, device=device)
    static_tokens = _static_int(tokens)
    if static_tokens == 0:
        return x, q, scale
    plan = tk.kernel_plan(hidden, n_streams, gated=gated)
    if static_tokens is not None:
        programs: Any = triton.cdiv(static_tokens, plan.rows)
    else:
        from torch.utils._sympy.functions import FloorDiv

        programs = FloorDiv(tokens + plan.rows - 1, plan.rows)
    lowering.lowerings[triton_kernel_wrapper_mutation](
        kernel_idx=kernel_side_table.add_kernel(_kernel_with_warps(plan.num_warps)),
        constant_args_idx=kernel_side_table.add_constant_args(dict(plan.constexprs)),
        grid=[(programs, 1, 1)],
        tma_descriptor_metadata={},
        kwargs={
            "streams_ptr": streams,
            "gates_ptr": gates,
            "x_ptr": x,
            "q_ptr": q,
            "scale_ptr": scale,
            "n_tokens": tokens if static_tokens is None else static_tokens,
        },
    )
    return x, q, scale

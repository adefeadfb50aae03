"""Triton kernels for the fused HC collapse + per-token FP8 quant (DESIGN §5).

Each program handles ``ROWS`` token rows in one pass over its inputs: it sums the n streams in fp32 in
fixed order (s = 0..n-1), rounds the sum once to the activation dtype and stores it as ``x``, then
quantises that rounded x per token (``scale = max(amax / 448, 1 / (448 * 512))``, ``q = clamp(x / scale,
±448)`` cast to e4m3 with round-to-nearest-even) and stores ``q`` and ``scale``.

Bit-exactness with the torch reference (:mod:`hcpasses.kernels.gated_mean_quant`): every fp32 division
whose result is stored or compared uses ``tl.math.div_rn`` (Triton's ``/`` on fp32 is approximate), and
values are rounded onto the e4m3 grid with integer/bit arithmetic before the FP8 cast, because the
Triton interpreter's FP8 cast is wrong for some values (triton#8322). The ``*_triton`` wrappers launch on
whatever device the tensors live on, so CPU tensors work under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
import triton.language as tl

from hcpasses.kernels import gated_mean_quant as ops

FP8_MAX = tl.constexpr(ops.FP8_MAX)
MIN_SCALE = tl.constexpr(ops.MIN_SCALE)
# Below 2**-6 (the smallest e4m3 normal) the e4m3 grid step is 2**-9; adding 2**14 (whose fp32 ulp is
# 2**-9) rounds to that grid with round-to-nearest-even, and subtracting it again is exact.
E4M3_SUBNORMAL_MAGIC = tl.constexpr(16384.0)
E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # fp32 bit pattern of 2**-6
MAX_ROWS_PER_PROGRAM = 16
ELEMENTS_PER_PROGRAM = 4096


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched: token rows per program and warps per program."""

    rows: int
    num_warps: int


def default_launch_config(hidden: int) -> LaunchConfig:
    """Rows per program so a program covers about 4096 elements of x; 8 warps for wide rows."""
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(MAX_ROWS_PER_PROGRAM, ELEMENTS_PER_PROGRAM // block))
    return LaunchConfig(rows=rows, num_warps=8 if block >= 2048 else 4)


@triton.jit
def round_to_e4m3_grid(v):
    """Round fp32 ``v`` (``|v| <= 448``) to the nearest e4m3 value (ties to even), returned as fp32.

    Normal range: round the fp32 mantissa to 3 bits (a carry into the exponent is the right answer).
    Below 2**-6: snap to multiples of 2**-9 with the magic-constant add. The sign bit is copied, so a
    negative value that rounds to zero gives -0.0 like torch's cast.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    tiny = mag.to(tl.float32, bitcast=True) + E4M3_SUBNORMAL_MAGIC
    subnormal = (tiny - E4M3_SUBNORMAL_MAGIC).to(tl.uint32, bitcast=True)
    rounded = tl.where(mag >= E4M3_MIN_NORMAL_BITS, normal, subnormal) | sign
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def round_to_dtype(v, dtype: tl.constexpr):
    """Round fp32 ``v`` to ``dtype`` with round-to-nearest-even.

    bf16 is rounded with integer ops and its top 16 bits taken as they are (the Triton interpreter's bf16
    cast truncates and flushes subnormals), so the compiled kernel and the interpreter agree bit for bit;
    ``v`` must not be NaN.
    """
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _row_block(n_tokens, hidden, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's token rows (int64), the columns of one stream and the in-bounds mask."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_tokens) & (cols[None, :] < hidden)
    return rows, cols, mask


@triton.jit
def _store_x_and_quant(acc, rows, cols, mask, n_tokens, hidden, x_ptr, q_ptr, scale_ptr):
    """The shared epilogue: round fp32 ``acc [ROWS, BLOCK]`` once to x's dtype, store x, quantise it."""
    offsets = rows[:, None] * hidden + cols[None, :]
    x = round_to_dtype(acc, x_ptr.dtype.element_ty)
    tl.store(x_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(xf), 0.0), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(xf, scale[:, None]), -FP8_MAX), FP8_MAX)
    q = round_to_e4m3_grid(scaled).to(tl.float8e4nv)
    tl.store(q_ptr + offsets, q.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < n_tokens)


@triton.jit
def _gated_term(xn_ptr, u_ptr, offsets, mask):
    """``sigmoid(u) * xn`` in fp32 for one stream's block."""
    xn = tl.load(xn_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return tl.sigmoid(u) * xn


@triton.jit
def _gated_mean_quant_kernel(
    xn_ptr, u_ptr, x_ptr, q_ptr, scale_ptr, n_tokens, hidden,
    N_STREAMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``x = (sum_s sigmoid(u_s) * xn_s) / n`` for ``ROWS`` rows, then the quant epilogue."""
    rows, cols, mask = _row_block(n_tokens, hidden, ROWS, BLOCK)
    offsets = rows[:, None] * (N_STREAMS * hidden) + cols[None, :]
    acc = _gated_term(xn_ptr, u_ptr, offsets, mask)
    for s in tl.static_range(1, N_STREAMS):
        acc += _gated_term(xn_ptr, u_ptr, offsets + s * hidden, mask)
    acc = tl.math.div_rn(acc, N_STREAMS * 1.0)
    _store_x_and_quant(acc, rows, cols, mask, n_tokens, hidden, x_ptr, q_ptr, scale_ptr)


@triton.jit
def _weighted_term(h_ptr, w_ptr, rows, offsets, mask, n_tokens, s: tl.constexpr, N_STREAMS: tl.constexpr):
    """``w[:, s] * h_s`` in fp32 for one stream's block (``offsets`` already point into stream s)."""
    w = tl.load(w_ptr + rows * N_STREAMS + s, mask=rows < n_tokens, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return w[:, None] * h


@triton.jit
def _weighted_sum_quant_kernel(
    h_ptr, w_ptr, x_ptr, q_ptr, scale_ptr, n_tokens, hidden,
    N_STREAMS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``x = sum_s w[:, s] * h_s`` for ``ROWS`` rows, then the quant epilogue."""
    rows, cols, mask = _row_block(n_tokens, hidden, ROWS, BLOCK)
    offsets = rows[:, None] * (N_STREAMS * hidden) + cols[None, :]
    acc = _weighted_term(h_ptr, w_ptr, rows, offsets, mask, n_tokens, 0, N_STREAMS)
    for s in tl.static_range(1, N_STREAMS):
        acc += _weighted_term(h_ptr, w_ptr, rows, offsets + s * hidden, mask, n_tokens, s, N_STREAMS)
    _store_x_and_quant(acc, rows, cols, mask, n_tokens, hidden, x_ptr, q_ptr, scale_ptr)


def gated_mean_quant_triton(
    xn: torch.Tensor, u: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> ops.Outputs:
    """The fused gated mean + quant on ``xn``'s device: ``(x [T, S], q fp8 [T, S], scale fp32 [T, 1])``.

    ``xn``, ``u``: contiguous ``[T, n*S]``. ``config`` overrides :func:`default_launch_config`.
    """
    ops.validate_gated_mean_inputs(xn, u, n_streams)
    return _launch(_gated_mean_quant_kernel, xn, u, n_streams, config)


def weighted_sum_quant_triton(
    h: torch.Tensor, w: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> ops.Outputs:
    """The fused mHC collapse ``sum_s w[:, s] * h_s`` + quant on ``h``'s device; outputs as above.

    ``h``: contiguous ``[T, n*S]``; ``w``: contiguous ``[T, n]``.
    """
    ops.validate_weighted_sum_inputs(h, w, n_streams)
    return _launch(_weighted_sum_quant_kernel, h, w, n_streams, config)


def _launch(
    kernel: triton.JITFunction, streams: torch.Tensor, gates: torch.Tensor, n_streams: int, config: LaunchConfig | None
) -> ops.Outputs:
    """Allocate the outputs and launch ``kernel`` over the token rows (no launch when T is 0)."""
    tokens, width = streams.shape
    hidden = width // n_streams
    x, q, scale = ops.empty_outputs(streams, hidden)
    if tokens == 0:
        return x, q, scale
    cfg = config or default_launch_config(hidden)
    grid = (triton.cdiv(tokens, cfg.rows),)
    with _device_guard(streams.device):
        kernel[grid](
            streams, gates, x, q.view(torch.uint8), scale, tokens, hidden,
            N_STREAMS=n_streams, ROWS=cfg.rows, BLOCK=triton.next_power_of_2(hidden), num_warps=cfg.num_warps,
        )  # fmt: skip
    return x, q, scale


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current while launching (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

"""Triton kernels for the fused HC collapse + per-token FP8 quant (DESIGN §5).

One kernel serves both collapses (the gated mean and the mHC weighted sum). Each program handles
``ROWS`` token rows and reads its inputs once: per chunk of ``CHUNK`` columns it sums the n streams in
fp32 in fixed order (s = 0..n-1), rounds the sum once to the activation dtype, stores it as ``x`` and
keeps the row's running max |x|; then it quantises that rounded x per token (``scale = max(amax / 448,
1 / (448 * 512))``, ``q = clamp(x / scale, ±448)`` cast to e4m3 with round-to-nearest-even), re-reading x
from cache when the row took several chunks, and stores ``q`` and ``scale``. Chunks are powers of two
chosen to pad the row least (:func:`default_chunk`): the arithmetic per element is close to the memory
time on an H200, so masked lanes cost (S = 2560 in five chunks of 512 ran 1.5x faster than in one of 4096).

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
CHUNKS = (256, 512, 1024, 2048, 4096)  # column chunks tried for rows wider than the smallest
ELEMENTS_PER_PROGRAM = 1024
MAX_ROWS = 64
ELEMENTS_PER_THREAD = 8  # 16-byte loads of 16-bit activations


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched: token rows per program and columns per chunk (powers of two), warps."""

    rows: int
    chunk: int
    num_warps: int


def default_chunk(hidden: int) -> int:
    """The power-of-two chunk that pads a row least (ties: the larger chunk, fewer trips).

    A row of S columns is covered by ``ceil(S / chunk)`` chunks; lanes past S are masked but still issue
    instructions, and the kernel's arithmetic is close to the memory time, so padding costs. S = 2560:
    512 (five chunks, no padding) rather than one chunk of 4096 (60 % padding).
    """
    block = triton.next_power_of_2(hidden)
    if block <= CHUNKS[0]:
        return block
    return min((c for c in CHUNKS if c <= block), key=lambda c: (triton.cdiv(hidden, c) * c, -c))


def default_launch_config(hidden: int) -> LaunchConfig:
    """:func:`default_chunk` columns, rows so a program covers ~1024 elements, 8 elements per thread."""
    chunk = default_chunk(hidden)
    rows = max(1, min(MAX_ROWS, ELEMENTS_PER_PROGRAM // chunk))
    warps = max(1, min(8, rows * chunk // (32 * ELEMENTS_PER_THREAD)))
    return LaunchConfig(rows=rows, chunk=chunk, num_warps=warps)


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
def _stream_term(
    streams_ptr, gates_ptr, rows, offsets, mask, n_tokens, s, GATED: tl.constexpr, N_STREAMS: tl.constexpr
):
    """Stream s's gated term in fp32: ``sigmoid(u_s) * xn_s`` (GATED) or ``w[:, s] * h_s``.

    ``offsets`` point into stream s of ``[ROWS, CHUNK]`` elements.
    """
    h = tl.load(streams_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.sigmoid(tl.load(gates_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
    else:
        gate = tl.load(gates_ptr + rows * N_STREAMS + s, mask=rows < n_tokens, other=0.0).to(tl.float32)[:, None]
    return gate * h


@triton.jit
def _collapse_chunk(
    streams_ptr, gates_ptr, rows, cols, mask, n_tokens, hidden, GATED: tl.constexpr, N_STREAMS: tl.constexpr
):
    """The streams' sum for a ``[ROWS, CHUNK]`` block, in fp32, s = 0..n-1 in order (divided by n if GATED)."""
    offsets = rows[:, None] * (N_STREAMS * hidden) + cols[None, :]
    acc = _stream_term(streams_ptr, gates_ptr, rows, offsets, mask, n_tokens, 0, GATED, N_STREAMS)
    for s in tl.static_range(1, N_STREAMS):
        acc += _stream_term(streams_ptr, gates_ptr, rows, offsets + s * hidden, mask, n_tokens, s, GATED, N_STREAMS)
    if GATED:
        if (N_STREAMS & (N_STREAMS - 1)) == 0:
            acc = acc * (1.0 / N_STREAMS)  # exact: the same correctly rounded result as the division
        else:
            acc = tl.math.div_rn(acc, N_STREAMS * 1.0)
    return acc


@triton.jit
def _store_x(acc, x_ptr, offsets, mask):
    """Round fp32 ``acc`` once to x's dtype and store it; returns the rounded x in fp32 and its row |max|."""
    x = round_to_dtype(acc, x_ptr.dtype.element_ty)
    tl.store(x_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    return xf, tl.max(tl.where(mask, tl.abs(xf), 0.0), axis=1)


@triton.jit
def _row_scale(amax):
    """The quant epilogue's per-row scale: ``max(amax / 448, 1 / (448 * 512))`` with IEEE division."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def _store_q(xf, scale, q_ptr, offsets, mask):
    """The quant epilogue's codes: ``clamp(x / scale, ±448)`` rounded to e4m3, stored as bytes."""
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(xf, scale[:, None]), -FP8_MAX), FP8_MAX)
    q = round_to_e4m3_grid(scaled).to(tl.float8e4nv)
    tl.store(q_ptr + offsets, q.to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _collapse_quant_kernel(
    streams_ptr, gates_ptr, x_ptr, q_ptr, scale_ptr, n_tokens, hidden,
    GATED: tl.constexpr, N_STREAMS: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
):  # fmt: skip
    """Collapse + quant for ``ROWS`` token rows, ``CHUNK`` columns at a time.

    One chunk (``SINGLE_CHUNK``): x stays in registers for the quant. Several: each chunk of x is stored
    with the running row max, then x is read back (from cache: this program just wrote it) to quantise.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_tokens
    if SINGLE_CHUNK:
        cols = tl.arange(0, CHUNK)
        mask = row_ok[:, None] & (cols[None, :] < hidden)
        offsets = rows[:, None] * hidden + cols[None, :]
        acc = _collapse_chunk(streams_ptr, gates_ptr, rows, cols, mask, n_tokens, hidden, GATED, N_STREAMS)
        xf, amax = _store_x(acc, x_ptr, offsets, mask)
        scale = _row_scale(amax)
        _store_q(xf, scale, q_ptr, offsets, mask)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, hidden, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols[None, :] < hidden)
            acc = _collapse_chunk(streams_ptr, gates_ptr, rows, cols, mask, n_tokens, hidden, GATED, N_STREAMS)
            _, chunk_max = _store_x(acc, x_ptr, rows[:, None] * hidden + cols[None, :], mask)
            amax = tl.maximum(amax, chunk_max)
        scale = _row_scale(amax)
        tl.debug_barrier()  # x written by other threads of this program is read below
        for start in range(0, hidden, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols[None, :] < hidden)
            offsets = rows[:, None] * hidden + cols[None, :]
            xf = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            _store_q(xf, scale, q_ptr, offsets, mask)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def gated_mean_quant_triton(
    xn: torch.Tensor, u: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> ops.Outputs:
    """The fused gated mean + quant on ``xn``'s device: ``(x [T, S], q fp8 [T, S], scale fp32 [T, 1])``.

    ``xn``, ``u``: contiguous ``[T, n*S]``. ``config`` overrides :func:`default_launch_config`.
    """
    ops.validate_gated_mean_inputs(xn, u, n_streams)
    return _launch(xn, u, n_streams, config, gated=True)


def weighted_sum_quant_triton(
    h: torch.Tensor, w: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> ops.Outputs:
    """The fused mHC collapse ``sum_s w[:, s] * h_s`` + quant on ``h``'s device; outputs as above.

    ``h``: contiguous ``[T, n*S]``; ``w``: contiguous ``[T, n]``.
    """
    ops.validate_weighted_sum_inputs(h, w, n_streams)
    return _launch(h, w, n_streams, config, gated=False)


def _launch(
    streams: torch.Tensor, gates: torch.Tensor, n_streams: int, config: LaunchConfig | None, *, gated: bool
) -> ops.Outputs:
    """Allocate the outputs and launch the kernel over the token rows (no launch when T is 0)."""
    tokens, width = streams.shape
    hidden = width // n_streams
    x, q, scale = ops.empty_outputs(streams, hidden)
    if tokens == 0:
        return x, q, scale
    cfg = config or default_launch_config(hidden)
    grid = (triton.cdiv(tokens, cfg.rows),)
    with _device_guard(streams.device):
        _collapse_quant_kernel[grid](
            streams, gates, x, q.view(torch.uint8), scale, tokens, hidden,
            GATED=gated, N_STREAMS=n_streams, ROWS=cfg.rows, CHUNK=cfg.chunk, SINGLE_CHUNK=cfg.chunk >= hidden,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return x, q, scale


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current while launching (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

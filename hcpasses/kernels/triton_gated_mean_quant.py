"""Triton kernels for the fused HC collapse + per-token FP8 quant (DESIGN §5).

One kernel serves both collapses (the gated mean and the mHC weighted sum). Each program handles
``ROWS`` token rows and reads its inputs once: it sums the n streams in fp32 in fixed order (s = 0..n-1),
rounds the sum once to the activation dtype, stores it as ``x`` and takes the row's max |x|; then it
quantises that rounded x per token (``scale = max(amax / 448, 1 / (448 * 512))``, ``q = clamp(x / scale,
±448)`` cast to e4m3 with round-to-nearest-even) and stores ``q`` and ``scale``.

Two shapes of program (:class:`LaunchConfig`):

- Single pass (``chunk >= S``): the whole row is held in registers as up to three power-of-two pieces
  (S = 2560 is 2048 + 512, S = 7168 is 4096 + 2048 + 1024; :func:`row_pieces`), so no lane is padded
  and x is never re-read; no store comes between the row's loads, so the compiler may issue them as early
  as registers allow. Used up to ``SINGLE_PASS_MAX`` columns per program (rows x row cover).
- Chunked (``chunk < S``): ``CHUNK`` columns at a time; each chunk of x is stored with the running row
  max, then x is read back (from cache: this program just wrote it) to quantise.

Bit-exactness with the torch reference (:mod:`hcpasses.kernels.contract`) on both paths below:

- Compiled (``HW_CASTS``): the hardware casts, ``.to(tl.bfloat16)`` / ``.to(tl.float16)`` and
  ``.to(tl.float8e4nv)`` after the clamp, all round-to-nearest-even like torch's casts. The per-element
  ``x / scale`` is computed from the row's IEEE reciprocal ``r = RN(1 / scale)`` with two FMA
  corrections (``FMA_DIV``): ``y = x * r``, ``y += r * (x - scale * y)`` (now faithful), and once more,
  which by Markstein's theorem gives the correctly rounded quotient ``RN(x / scale)`` (no underflow can
  matter: a quotient below 2**-10 rounds to ±0 in e4m3 whatever its fp32 error, and the sign is kept;
  x = ±0 is passed through). That is a multiply and four FMAs instead of an IEEE division per element.
  The gate's sigmoid uses libdevice's flush-to-zero ``ex2`` and division (``FAST_SIGMOID``, see
  :func:`_sigmoid`); x is not bit-exact anyway (within one ulp), q and scale are exact given x.
- Triton interpreter (``TRITON_INTERPRET=1``, read at launch time): its FP8 cast is wrong for some values
  (triton#8322), its bf16 cast truncates, and its ``fma`` rounds twice in triton 3.6 (once in 3.9). There
  values are rounded onto the bf16 and e4m3 grids with integer/bit arithmetic before the casts, the
  division is ``tl.math.div_rn`` (Triton's ``/`` on fp32 is approximate) and the sigmoid ``tl.sigmoid``.
  The compiled GPU tests check both arithmetic paths bit for bit (q, scale) against the reference, the
  interpreter tests its own path and, where its ``fma`` is exact, the FMA division.

The ``*_triton`` wrappers launch the plain ``@triton.jit`` kernel on whatever device the tensors live on
(CPU tensors under the interpreter). :func:`gated_mean_quant_cuda` / :func:`weighted_sum_quant_cuda` are
the CUDA bodies of the ``torch.library.triton_op`` custom ops: they launch through
``torch.library.wrap_triton`` so that a compiled graph calls the kernel directly. :func:`kernel_plan`
describes the launch for the Inductor lowering in :mod:`hcpasses.kernels.inductor_lowering`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.language.extra import libdevice

from hcpasses.kernels import contract

FP8_MAX = tl.constexpr(contract.FP8_MAX)
MIN_SCALE = tl.constexpr(contract.MIN_SCALE)
# Below 2**-6 (the smallest e4m3 normal) the e4m3 grid step is 2**-9; adding 2**14 (whose fp32 ulp is
# 2**-9) rounds to that grid with round-to-nearest-even, and subtracting it again is exact.
E4M3_SUBNORMAL_MAGIC = tl.constexpr(16384.0)
E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # fp32 bit pattern of 2**-6
NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # -log2(e); as fp32 the constant tl.exp multiplies by, negated
CHUNKS = (256, 512, 1024, 2048, 4096)  # column chunks tried for rows wider than the smallest
MAX_PIECES = 3  # power-of-two pieces a single-pass row is split into
SINGLE_PASS_MAX = 8192  # most columns (rows x row cover) one single-pass program holds
SINGLE_PASS_ELEMENTS = 2048  # single pass: rows per program so that a program covers about this many columns
ELEMENTS_PER_PROGRAM = 1024  # chunked: rows x chunk
MAX_ROWS = 64
ELEMENTS_PER_THREAD = 8  # chunked: 16-byte loads of 16-bit activations
SINGLE_PASS_ELEMENTS_PER_THREAD = 16  # single pass: columns of each stream per thread
MAX_WARPS = 16


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched: token rows per program, columns per chunk (powers of two), warps.

    ``chunk >= S`` runs the single-pass program (the whole row in registers, see the module docstring).
    ``hw_casts`` / ``fma_division`` / ``fast_sigmoid``: ``None`` picks by interpreter mode (all three when
    compiled); set them to measure or test one path. The hardware casts are only exact compiled, the FMA
    division only where ``tl.fma`` rounds once, the flush-to-zero sigmoid only compiled (libdevice).
    """

    rows: int
    chunk: int
    num_warps: int
    hw_casts: bool | None = None
    fma_division: bool | None = None
    fast_sigmoid: bool | None = None


# Launch configs measured best on an H200 (benchmarks/gated_mean_quant.py, 2026-11-29, torch 2.11, triton 3.6),
# by hidden size S: geometric mean over T = 1024..65536, n = 4, bf16 (benchmarks/results/gated_mean_quant_h200.*).
TUNED: dict[int, LaunchConfig] = {2560: LaunchConfig(rows=1, chunk=4096, num_warps=2)}


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (read now, at launch time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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


def row_pieces(hidden: int) -> tuple[int, ...]:
    """The fewest columns ``>= hidden`` that ``MAX_PIECES`` powers of two add up to, as those powers.

    S = 2560: (2048, 512); 7168: (4096, 2048, 1024); 300: (256, 32, 16); 1000: (1024,).
    """
    bits = [1 << b for b in reversed(range(hidden.bit_length())) if hidden >> b & 1]
    cover = sum(bits[:MAX_PIECES]) + (bits[MAX_PIECES - 1] if len(bits) > MAX_PIECES else 0)
    return tuple(1 << b for b in reversed(range(cover.bit_length())) if cover >> b & 1)


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def default_launch_config(hidden: int) -> LaunchConfig:
    """:data:`TUNED` for a measured S, else a heuristic.

    Single pass while the row fits (``sum(row_pieces(S)) <= SINGLE_PASS_MAX``): rows so a program covers
    about ``SINGLE_PASS_ELEMENTS`` columns, warps for about 16 columns per thread. Wider rows: chunks of
    :func:`default_chunk`, rows so a program covers ~1024 elements, 8 elements per thread.
    """
    if hidden in TUNED:
        return TUNED[hidden]
    cover = sum(row_pieces(hidden))
    if cover <= SINGLE_PASS_MAX:
        rows = max(1, min(MAX_ROWS, _prev_power_of_2(SINGLE_PASS_ELEMENTS // cover)))
        per_thread = 32 * SINGLE_PASS_ELEMENTS_PER_THREAD
        warps = max(1, min(MAX_WARPS, _prev_power_of_2(rows * cover // per_thread)))
        return LaunchConfig(rows=rows, chunk=triton.next_power_of_2(cover), num_warps=warps)
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
    """Round fp32 ``v`` to ``dtype`` with round-to-nearest-even, without the bf16 hardware cast.

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
def to_e4m3(v, HW_CASTS: tl.constexpr):
    """fp32 ``v`` (``|v| <= 448``) cast to e4m3 with round-to-nearest-even (hardware cast or grid rounding)."""
    if HW_CASTS:
        return v.to(tl.float8e4nv)
    return round_to_e4m3_grid(v).to(tl.float8e4nv)


@triton.jit
def _sigmoid(u, FAST: tl.constexpr):
    """``1 / (1 + exp(-u))`` in fp32: ``tl.sigmoid`` or, ``FAST``, its flush-to-zero twin.

    Both take ``exp(-u)`` as ``ex2.approx(RN(-u * log2 e))`` and divide approximately; ``tl.sigmoid`` adds
    the denormal handling of the non-ftz instructions (about 7 more instructions per call). They differ
    only where sigmoid(u) < 2**-126 (u < -87.3): FAST gives 0 there, tl.sigmoid a denormal (0 below -88.7).
    """
    if FAST:
        e = libdevice.exp2(u * NEG_LOG2E)  # libdevice's ftz ex2.approx; the multiply absorbs the negation
        return libdevice.fast_dividef(tl.full(u.shape, 1.0, tl.float32), 1.0 + e)
    return tl.sigmoid(u)


@triton.jit
def _stream_term(
    streams_ptr, gates_ptr, rows, offsets, mask, n_tokens, s, GATED: tl.constexpr, N_STREAMS: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
):  # fmt: skip
    """Stream s's gated term in fp32: ``sigmoid(u_s) * xn_s`` (GATED) or ``w[:, s] * h_s``.

    ``offsets`` point into stream s of ``[ROWS, CHUNK]`` elements.
    """
    h = tl.load(streams_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        gate = _sigmoid(tl.load(gates_ptr + offsets, mask=mask, other=0.0).to(tl.float32), FAST_SIGMOID)
    else:
        gate = tl.load(gates_ptr + rows * N_STREAMS + s, mask=rows < n_tokens, other=0.0).to(tl.float32)[:, None]
    return gate * h


@triton.jit
def _collapse_block(
    streams_ptr, gates_ptr, rows, cols, mask, n_tokens, HIDDEN: tl.constexpr, GATED: tl.constexpr,
    N_STREAMS: tl.constexpr, FAST_SIGMOID: tl.constexpr,
):  # fmt: skip
    """The streams' sum for a ``[ROWS, len(cols)]`` block in fp32, s = 0..n-1 in order (divided by n if GATED).

    Masked lanes give exactly ±0.
    """
    offsets = rows[:, None] * (N_STREAMS * HIDDEN) + cols[None, :]
    acc = _stream_term(streams_ptr, gates_ptr, rows, offsets, mask, n_tokens, 0, GATED, N_STREAMS, FAST_SIGMOID)
    for s in tl.static_range(1, N_STREAMS):
        acc += _stream_term(
            streams_ptr, gates_ptr, rows, offsets + s * HIDDEN, mask, n_tokens, s, GATED, N_STREAMS, FAST_SIGMOID
        )
    if GATED:
        if (N_STREAMS & (N_STREAMS - 1)) == 0:
            acc = acc * (1.0 / N_STREAMS)  # exact: the same correctly rounded result as the division
        else:
            acc = tl.math.div_rn(acc, N_STREAMS * 1.0)
    return acc


@triton.jit
def _round_x(acc, dtype: tl.constexpr, HW_CASTS: tl.constexpr):
    """fp32 ``acc`` rounded once to x's dtype (round-to-nearest-even)."""
    if HW_CASTS:
        return acc.to(dtype)
    return round_to_dtype(acc, dtype)


@triton.jit
def _row_scale(amax):
    """The quant epilogue's per-row scale: ``max(amax / 448, 1 / (448 * 512))`` with IEEE division."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def _codes(xf, scale, recip, HW_CASTS: tl.constexpr, FMA_DIV: tl.constexpr):
    """The quant epilogue's codes for fp32 ``xf [ROWS, C]``: ``clamp(x / scale, ±448)`` cast to e4m3 (RNE).

    ``FMA_DIV``: the correctly rounded quotient from ``recip = RN(1 / scale)`` and two FMA corrections
    (module docstring); else ``div_rn``.
    """
    s = scale[:, None]
    if FMA_DIV:
        r = recip[:, None]
        y = xf * r
        y = tl.fma(tl.fma(-y, s, xf), r, y)  # faithful: within one ulp of x / scale
        y = tl.fma(tl.fma(-y, s, xf), r, y)  # Markstein: RN(x / scale)
        y = tl.where(xf == 0.0, xf, y)  # the corrections turn -0.0 into +0.0
    else:
        y = tl.math.div_rn(xf, s)
    return to_e4m3(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), HW_CASTS)


@triton.jit
def _store_codes(codes, q_ptr, offsets, mask):
    """Store e4m3 ``codes`` to q (an fp8 tensor, or its uint8 view under the interpreter)."""
    tl.store(q_ptr + offsets, codes.to(q_ptr.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def _piece_index(rows, row_ok, START: tl.constexpr, WIDTH: tl.constexpr, HIDDEN: tl.constexpr):
    """Single pass: columns ``START .. START + WIDTH`` of the rows, their mask and their offsets in x.

    Kept apart from the pointers: Inductor's mutation analysis of user kernels takes a value that a call
    derived from a pointer argument for that pointer, so offsets returned alongside loads from the
    inputs would make it think the inputs are written.
    """
    cols = START + tl.arange(0, WIDTH)
    return cols, row_ok[:, None] & (cols[None, :] < HIDDEN), rows[:, None] * HIDDEN + cols[None, :]


@triton.jit
def _piece_store_x(acc, x_ptr, offsets, mask, HW_CASTS: tl.constexpr):
    """Single pass: round and store one piece of x; returns it in fp32 and its row max |x|."""
    x = _round_x(acc, x_ptr.dtype.element_ty, HW_CASTS)
    tl.store(x_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    return xf, tl.max(tl.abs(xf), axis=1)  # masked lanes hold ±0


@triton.jit
def _collapse_quant_kernel(
    streams_ptr, gates_ptr, x_ptr, q_ptr, scale_ptr, n_tokens,
    GATED: tl.constexpr, N_STREAMS: tl.constexpr, HIDDEN: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    HW_CASTS: tl.constexpr, FMA_DIV: tl.constexpr, FAST_SIGMOID: tl.constexpr,
):  # fmt: skip
    """Collapse + quant for ``ROWS`` token rows of ``HIDDEN`` columns.

    ``P0 > 0``: single pass over the row as pieces of P0, P1, P2 columns (P1, P2 may be 0). Else chunked,
    ``CHUNK`` columns at a time, x re-read for the quant.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_tokens
    if P0 > 0:
        # Every load of the row first (no store in between, so nothing orders them after one).
        cols0, mask0, off0 = _piece_index(rows, row_ok, 0, P0, HIDDEN)
        acc0 = _collapse_block(
            streams_ptr, gates_ptr, rows, cols0, mask0, n_tokens, HIDDEN, GATED, N_STREAMS, FAST_SIGMOID
        )
        if P1 > 0:
            cols1, mask1, off1 = _piece_index(rows, row_ok, P0, P1, HIDDEN)
            acc1 = _collapse_block(
                streams_ptr, gates_ptr, rows, cols1, mask1, n_tokens, HIDDEN, GATED, N_STREAMS, FAST_SIGMOID
            )
        if P2 > 0:
            cols2, mask2, off2 = _piece_index(rows, row_ok, P0 + P1, P2, HIDDEN)
            acc2 = _collapse_block(
                streams_ptr, gates_ptr, rows, cols2, mask2, n_tokens, HIDDEN, GATED, N_STREAMS, FAST_SIGMOID
            )
        xf0, amax = _piece_store_x(acc0, x_ptr, off0, mask0, HW_CASTS)
        if P1 > 0:
            xf1, amax1 = _piece_store_x(acc1, x_ptr, off1, mask1, HW_CASTS)
            amax = tl.maximum(amax, amax1)
        if P2 > 0:
            xf2, amax2 = _piece_store_x(acc2, x_ptr, off2, mask2, HW_CASTS)
            amax = tl.maximum(amax, amax2)
        scale = _row_scale(amax)
        recip = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        _store_codes(_codes(xf0, scale, recip, HW_CASTS, FMA_DIV), q_ptr, off0, mask0)
        if P1 > 0:
            _store_codes(_codes(xf1, scale, recip, HW_CASTS, FMA_DIV), q_ptr, off1, mask1)
        if P2 > 0:
            _store_codes(_codes(xf2, scale, recip, HW_CASTS, FMA_DIV), q_ptr, off2, mask2)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, HIDDEN, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols[None, :] < HIDDEN)
            acc = _collapse_block(
                streams_ptr, gates_ptr, rows, cols, mask, n_tokens, HIDDEN, GATED, N_STREAMS, FAST_SIGMOID
            )
            _, chunk_max = _piece_store_x(acc, x_ptr, rows[:, None] * HIDDEN + cols[None, :], mask, HW_CASTS)
            amax = tl.maximum(amax, chunk_max)
        scale = _row_scale(amax)
        recip = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        tl.debug_barrier()  # x written by other threads of this program is read below
        for start in range(0, HIDDEN, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols[None, :] < HIDDEN)
            offsets = rows[:, None] * HIDDEN + cols[None, :]
            xf = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            _store_codes(_codes(xf, scale, recip, HW_CASTS, FMA_DIV), q_ptr, offsets, mask)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One launch of ``_collapse_quant_kernel``: its constexpr arguments, programs per row block, warps."""

    constexprs: dict
    rows: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def _plan(hidden: int, n_streams: int, gated: bool, cfg: LaunchConfig, interpret: bool) -> KernelPlan:
    single = cfg.chunk >= hidden
    pieces = (*row_pieces(hidden), 0, 0)[:MAX_PIECES] if single else (0, 0, 0)
    hw_casts = (not interpret) if cfg.hw_casts is None else cfg.hw_casts
    fma_div = (not interpret) if cfg.fma_division is None else cfg.fma_division
    fast_sigmoid = (not interpret) if cfg.fast_sigmoid is None else cfg.fast_sigmoid
    constexprs = {
        "GATED": gated, "N_STREAMS": n_streams, "HIDDEN": hidden, "ROWS": cfg.rows, "CHUNK": cfg.chunk,
        "P0": pieces[0], "P1": pieces[1], "P2": pieces[2], "HW_CASTS": hw_casts, "FMA_DIV": fma_div,
        "FAST_SIGMOID": fast_sigmoid,
    }  # fmt: skip
    return KernelPlan(constexprs=constexprs, rows=cfg.rows, num_warps=cfg.num_warps)


def kernel_plan(hidden: int, n_streams: int, *, gated: bool, config: LaunchConfig | None = None) -> KernelPlan:
    """The launch for S = ``hidden`` (``config`` or :func:`default_launch_config`), paths chosen by interpreter mode."""
    return _plan(hidden, n_streams, gated, config or default_launch_config(hidden), interpreting())


def gated_mean_quant_triton(
    xn: torch.Tensor, u: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> contract.Outputs:
    """The fused gated mean + quant on ``xn``'s device: ``(x [T, S], q fp8 [T, S], scale fp32 [T, 1])``.

    ``xn``, ``u``: contiguous ``[T, n*S]``. ``config`` overrides :func:`default_launch_config`.
    """
    contract.validate_gated_mean_inputs(xn, u, n_streams)
    return _launch(xn, u, n_streams, config, gated=True, traceable=False)


def weighted_sum_quant_triton(
    h: torch.Tensor, w: torch.Tensor, n_streams: int, config: LaunchConfig | None = None
) -> contract.Outputs:
    """The fused mHC collapse ``sum_s w[:, s] * h_s`` + quant on ``h``'s device; outputs as above.

    ``h``: contiguous ``[T, n*S]``; ``w``: contiguous ``[T, n]``.
    """
    contract.validate_weighted_sum_inputs(h, w, n_streams)
    return _launch(h, w, n_streams, config, gated=False, traceable=False)


def gated_mean_quant_cuda(xn: torch.Tensor, u: torch.Tensor, n_streams: int) -> contract.Outputs:
    """CUDA body of the ``hcpasses::gated_mean_quant`` triton_op (inputs validated by the caller)."""
    return _launch(xn, u, n_streams, None, gated=True, traceable=True)


def weighted_sum_quant_cuda(h: torch.Tensor, w: torch.Tensor, n_streams: int) -> contract.Outputs:
    """CUDA body of the ``hcpasses::weighted_sum_quant`` triton_op (inputs validated by the caller)."""
    return _launch(h, w, n_streams, None, gated=False, traceable=True)


def _launch(
    streams: torch.Tensor,
    gates: torch.Tensor,
    n_streams: int,
    config: LaunchConfig | None,
    *,
    gated: bool,
    traceable: bool,
) -> contract.Outputs:
    """Allocate the outputs and launch the kernel over the token rows (no launch when T is 0).

    ``traceable``: launch through ``wrap_triton`` (the triton_op bodies: traced into a graph under
    torch.compile, a direct launch in eager mode); else the plain kernel. Under the interpreter the kernel
    is an interpreted function that ``wrap_triton`` may refuse (torch 2.11), and q goes as uint8 (the
    interpreter has no fp8 tensors).
    """
    tokens, width = streams.shape
    hidden = int(width // n_streams)  # a constexpr of the kernel: a symbolic width is specialised here
    x, q, scale = contract.empty_outputs(streams, hidden)
    if tokens == 0:
        return x, q, scale
    interpret = interpreting()
    plan = _plan(hidden, n_streams, gated, config or default_launch_config(hidden), interpret)
    kernel = wrap_triton(_collapse_quant_kernel) if traceable and not interpret else _collapse_quant_kernel
    q_arg = q.view(torch.uint8) if interpret else q
    with _device_guard(streams.device):
        kernel[(triton.cdiv(tokens, plan.rows),)](
            streams, gates, x, q_arg, scale, tokens, **plan.constexprs, num_warps=plan.num_warps
        )
    return x, q, scale


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current while launching (Triton launches on the current CUDA device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()

"""The fused collapse + quant ops' contract: constants, input validation, output allocation, torch references.

A leaf module (torch only): the op definitions (:mod:`hcpasses.kernels.gated_mean_quant`), the Triton kernels
(:mod:`hcpasses.kernels.triton_gated_mean_quant`) and Inductor's lowering all import it, and it imports none
of them. Rounding convention: see :mod:`hcpasses.kernels.gated_mean_quant`.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check_2d(op: str, name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless ``t`` is a contiguous 2-D tensor of an activation dtype."""
    if t.dim() != 2 or t.dtype not in ACTIVATION_DTYPES or not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be a contiguous 2-D tensor of dtype float32, bfloat16 or float16; got shape "
            f"{tuple(t.shape)}, dtype {t.dtype}, contiguous={t.is_contiguous()}"
        )


def _check_streams(op: str, name: str, streams: torch.Tensor, n_streams: int) -> None:
    """Raise ValueError unless ``streams`` is a valid ``[T, n*S]`` bundle with S >= 1."""
    _check_2d(op, name, streams)
    width = streams.shape[1]
    if n_streams < 1 or width == 0 or width % n_streams != 0:
        raise ValueError(
            f"{op}: {name} of shape {tuple(streams.shape)} must have a non-zero width divisible by "
            f"n_streams={n_streams} (>= 1)"
        )


def _check_gates(op: str, name: str, gates: torch.Tensor, streams: torch.Tensor, shape: tuple[int, int]) -> None:
    """Raise ValueError unless ``gates`` has ``shape`` and lives on the streams' device."""
    _check_2d(op, name, gates)
    if tuple(gates.shape) != shape or gates.device != streams.device:
        raise ValueError(
            f"{op}: {name} must have shape {shape} on {streams.device}; got {tuple(gates.shape)} on {gates.device}"
        )


def validate_gated_mean_inputs(xn: torch.Tensor, u: torch.Tensor, n_streams: int) -> None:
    """Raise ValueError naming the bad shape/dtype unless ``xn`` and ``u`` are contiguous ``[T, n*S]``."""
    _check_streams("gated_mean_quant", "xn", xn, n_streams)
    _check_gates("gated_mean_quant", "u", u, xn, tuple(xn.shape))


def validate_weighted_sum_inputs(h: torch.Tensor, w: torch.Tensor, n_streams: int) -> None:
    """Raise ValueError naming the bad shape/dtype unless ``h`` is ``[T, n*S]`` and ``w`` is ``[T, n]``."""
    _check_streams("weighted_sum_quant", "h", h, n_streams)
    _check_gates("weighted_sum_quant", "w", w, h, (h.shape[0], n_streams))


def empty_outputs(streams: torch.Tensor, hidden: int) -> Outputs:
    """Uninitialised ``(x [T, S] in streams' dtype, q fp8 [T, S], scale fp32 [T, 1])`` on streams' device."""
    tokens = streams.shape[0]
    x = streams.new_empty((tokens, hidden))
    q = torch.empty((tokens, hidden), dtype=FP8_DTYPE, device=streams.device)
    scale = torch.empty((tokens, 1), dtype=torch.float32, device=streams.device)
    return x, q, scale


def _ieee_div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """``a / divisor`` rounded as IEEE division on every device.

    A Python-scalar divisor lets CUDA multiply by its rounded reciprocal instead, which can be one ulp off;
    a 0-dim tensor on ``a``'s device keeps the true division.
    """
    return a / a.new_tensor(divisor)


def per_token_quant(x: torch.Tensor, *, ieee_division: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token FP8 quant (DESIGN §5, vLLM's convention) of ``x [..., K]``: ``(q float8_e4m3fn [..., K],
    scale fp32 [..., 1])``, ``q.float() * scale`` approximating x.

    ``scale = max(amax / 448, 1 / (448 * 512))`` with amax taken from x upcast to fp32, ``q = clamp(x / scale,
    -448, 448)`` cast with round-to-nearest-even (the clamp comes before the cast: torch turns an overflowing
    cast into NaN). A zero row gets the floor scale and zero codes.

    The one definition: :func:`hcpasses.fp8.quantize_per_token` (the reference models' and ``Fp8Linear``'s
    quant) is this function, the fusion pass traces it as the quant of its search patterns
    (:mod:`hcpasses.patterns.gated_mean`), and the fused ops' torch reference is it with ``ieee_division``.
    Written as model code writes it, since the traced pattern must match model code.

    ``ieee_division``: divide amax by 448 held in a 0-dim tensor, so the division is IEEE-rounded on every device
    (a Python-scalar divisor lets CUDA multiply by its rounded reciprocal instead); on CPU both are the same.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # Literals, not the module constants: under dynamic=True Dynamo turns a global float used as a
    # divisor into a graph input, and the fusion pass can no longer see that the quant divides by 448.
    scale = torch.clamp(_ieee_div(amax, 448.0) if ieee_division else amax / 448.0, min=1.0 / (448.0 * 512.0))
    q = torch.clamp(xf / scale, -448.0, 448.0).to(FP8_DTYPE)
    return q, scale


def quant_epilogue_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused ops' quant of ``x [T, K]``: :func:`per_token_quant` with IEEE division on every device."""
    return per_token_quant(x, ieee_division=True)


def _fixed_order_sum(terms: torch.Tensor) -> torch.Tensor:
    """``terms[:, 0] + terms[:, 1] + ...`` over dim 1 of ``[T, n, S]``, left to right."""
    acc = terms[:, 0]
    for s in range(1, terms.shape[1]):
        acc = acc + terms[:, s]
    return acc


def _with_quant(x: torch.Tensor) -> Outputs:
    """``(x, *quant_epilogue_reference(x))``."""
    return (x, *quant_epilogue_reference(x))


def gated_mean_quant_reference(xn: torch.Tensor, u: torch.Tensor, n_streams: int) -> Outputs:
    """Torch reference of ``gated_mean_quant``: ``x = (sum_s sigmoid(u_s) * xn_s) / n`` in fp32, then quant."""
    validate_gated_mean_inputs(xn, u, n_streams)
    shape = (xn.shape[0], n_streams, xn.shape[1] // n_streams)
    terms = torch.sigmoid(u.float().view(shape)) * xn.float().view(shape)
    return _with_quant(_ieee_div(_fixed_order_sum(terms), n_streams).to(xn.dtype))


def weighted_sum_quant_reference(h: torch.Tensor, w: torch.Tensor, n_streams: int) -> Outputs:
    """Torch reference of ``weighted_sum_quant``: ``x = sum_s w[:, s] * h_s`` in fp32, then quant."""
    validate_weighted_sum_inputs(h, w, n_streams)
    terms = w.float().unsqueeze(-1) * h.float().view(h.shape[0], n_streams, h.shape[1] // n_streams)
    return _with_quant(_fixed_order_sum(terms).to(h.dtype))

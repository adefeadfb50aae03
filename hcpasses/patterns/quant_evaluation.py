"""The per-token FP8 quant found by evaluation: whatever ops a graph spells it with, a sub-DAG that gives the
contract's codes and scales bit for bit on every probe is the quant.

For an FP8 cast ``codes`` and a candidate source ``x``, the quant's sub-DAG is every node between them: the
cast's ancestors back to ``x``, which must be functions of ``x`` and constants only (a placeholder or any other
non-constant value on the way means ``codes`` is not a quant of ``x`` alone). Its scale is the fp32 ``[..., 1]``
node of that sub-DAG that the rest of the graph reads (the dequant's or the scaled GEMM's operand).

The sub-DAG is copied into a standalone FX graph and run on CPU on the probes (:func:`probe_rows`), in ``x``'s
dtype and at the graph's own sizes (the probe rows spread over ``x``'s token rows); codes (as bytes) and scales (as
bits) must equal :func:`hcpasses.kernels.contract.per_token_quant`'s on every probe, compared row by row (a quant
behind a regrouping of token rows, transformers' MoE ``view(-1, hidden)``, gives the same rows in another shape).
Above ``MAX_PROBE_ELEMENTS`` the probe has ``PROBE_ROWS`` rows: then the sub-DAG may spell no sizes but those of
such regroupings (spelled anew) and every value in it must hold one row per token. Anything else is a near miss,
named by the first probe that separated it, and is never fused: the fused op would change the graph's values.

Hand-written rather than a traced pattern: the point is to accept any spelling of the same function (vLLM's
upcast-first quant, a scale floor written with ``torch.maximum``, ``finfo`` constants...), which no list of
patterns covers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hcpasses.kernels.contract import FP8_DTYPE, FP8_MAX, MIN_SCALE, per_token_quant
from hcpasses.patterns.tracing import sub_dag, value_of

# Sub-DAGs larger than this are no per-token quant (the vLLM reference is 8 nodes; the longest spellings seen ~20).
MAX_QUANT_NODES = 48
# Above this many elements a probe at the graph's own sizes costs more than the check is worth at compile time;
# the probe then runs on fewer token rows, which only a sub-DAG that spells no sizes allows.
MAX_PROBE_ELEMENTS = 1 << 20
PROBE_ROWS = 16  # token rows of a shrunk probe
SIZED_OPS = {"reshape", "view", "expand", "_unsafe_view", "full", "empty", "new_empty", "new_full", "slice"}
RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


@dataclasses.dataclass(frozen=True)
class QuantMatch:
    """``codes, scale = per_token_quant(source)`` computed by ``nodes`` (graph order), checked on ``probes``."""

    source: fx.Node
    codes: fx.Node
    scale: fx.Node | None  # None when nothing outside the quant reads its scale
    nodes: tuple[fx.Node, ...]
    probes: int


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A quant-shaped sub-DAG whose values differ from the contract's: ``probe`` separated it (``detail``: how)."""

    codes: fx.Node
    probe: str
    detail: str

    def __str__(self) -> str:
        return f"{self.codes.name} differs from the per-token quant on the probe '{self.probe}': {self.detail}"


@dataclasses.dataclass(frozen=True)
class NotAQuant:
    """Why an FP8 cast is no quant of the source at all (another input, too large, not evaluable)."""

    codes: fx.Node
    why: str

    def __str__(self) -> str:
        return f"{self.codes.name}: {self.why}"


Judgement = QuantMatch | NearMiss | NotAQuant


def probe_rows(width: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The probes, each a few rows of ``width`` values representable in ``dtype``: what tells spellings of the quant
    apart (the order of the clamp and the floor, a reciprocal multiply, an amax before the upcast, signed zeros)."""
    gen = torch.Generator().manual_seed(0)
    floor_amax = FP8_MAX * MIN_SCALE  # amax / 448 lands exactly on the scale floor
    magnitudes = 10.0 ** torch.randint(-5, 5, (4, 1), generator=gen).float()
    # Halfway between two FP8 codes at scale 1 (the row's amax is 448); at scale 1.75, whose reciprocal is inexact,
    # x * (1 / scale) lands off 1.5625 and 1.8125 (searched: the smallest such scale exact in bf16 with its ties).
    ties = torch.tensor([FP8_MAX, 1.0625, -1.5625, 1.8125, 2.125, -3.25, 0.5 + 1 / 32, 13.0])
    probes = {
        "mixed magnitudes": torch.randn(4, width, generator=gen) * magnitudes,
        "all-zero rows": torch.zeros(2, width),
        "amax on the scale floor": _with_amax(torch.rand(2, width, generator=gen) - 0.5, floor_amax),
        "amax just around the floor": torch.cat(
            [_with_amax(torch.randn(1, width, generator=gen), floor_amax * f) for f in (0.5, 0.999, 1.001, 3.0)]
        ),
        "ties between FP8 codes": torch.cat([_tiled(ties, width), _tiled(ties * 1.75, width)]),
        "negative zeros": _tiled(torch.tensor([-0.0, 0.0, -0.0, 1.0, -0.0, -2.0]), width),
        "large values": torch.randn(2, width, generator=gen) * 1e4,
    }
    return {name: rows.to(dtype) for name, rows in probes.items()}


def _with_amax(rows: torch.Tensor, amax: float) -> torch.Tensor:
    """``rows`` scaled so each row's largest magnitude is ``amax``, held by its first element."""
    rows = rows / rows.abs().amax(-1, keepdim=True) * amax
    rows[:, 0] = amax
    return rows


def _tiled(values: torch.Tensor, width: int) -> torch.Tensor:
    return values.repeat(math.ceil(width / values.numel()))[:width].unsqueeze(0)


def judge_quant(source: fx.Node, codes: fx.Node) -> Judgement:
    """Whether the FP8 cast ``codes`` is the per-token quant of ``source``, by evaluation."""
    nodes = _sub_dag(source, codes)
    if isinstance(nodes, str):
        return NotAQuant(codes, nodes)
    scale = _read_scale(nodes, codes)
    if isinstance(scale, str):
        return NotAQuant(codes, scale)
    probe_shape = _probe_shape(source, nodes)
    if isinstance(probe_shape, str):
        return NotAQuant(codes, probe_shape)
    shape = tuple(value_of(source).shape)
    # compared only when static: a symbolic size compared with an int would install a guard on it
    shrunk = not all(isinstance(d, int) for d in shape) or probe_shape != shape
    module = _standalone(source, codes, scale, nodes, shrunk)
    dtype = value_of(source).dtype
    probes = probe_rows(probe_shape[-1], dtype)
    device = value_of(source).device  # the graph's device: its division rounds as the compiled code's will
    for name, rows in probes.items():
        x = _fill(rows, probe_shape).to(device)
        difference = _difference(module, x, scale is not None)
        if difference is not None:
            return NearMiss(codes, name, difference)
    return QuantMatch(source, codes, scale, nodes, len(probes))


def _sub_dag(source: fx.Node, codes: fx.Node) -> tuple[fx.Node, ...] | str:
    """The nodes between ``source`` and ``codes`` (graph order), or why ``codes`` is not a function of it alone."""
    nodes = sub_dag(codes, (source,), _value_inputs, MAX_QUANT_NODES)
    if isinstance(nodes, str):
        return nodes
    order = {node: i for i, node in enumerate(codes.graph.nodes)}
    return tuple(sorted(nodes, key=order.__getitem__))


def _value_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node``'s values come from: a regrouping of token rows reads its sizes (a graph input's
    ``sym_size`` under dynamic shapes) only to keep the rows, and the standalone copy spells them anew."""
    return [node.args[0]] if regroups_rows(node) else node.all_input_nodes


def _read_scale(nodes: tuple[fx.Node, ...], codes: fx.Node) -> fx.Node | str | None:
    """The sub-DAG's node whose value the rest of the graph reads as the scale; None if it reads none, or why
    the rest of the graph reads more than codes and one scale of the quant's inner values."""
    inside = set(nodes)
    read = [n for n in nodes if n is not codes and any(user not in inside for user in n.users)]
    rows = value_of(codes).shape[:-1]
    scales = [n for n in read if _is_row_scale(value_of(n), rows)]
    if len(scales) > 1:
        return f"{len(scales)} per-row fp32 values of it are read elsewhere ({', '.join(n.name for n in scales)})"
    return scales[0] if scales else None


def _is_row_scale(value: object, rows: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32 and tuple(value.shape) == (*rows, 1)


def _probe_shape(source: fx.Node, nodes: tuple[fx.Node, ...]) -> tuple[int, ...] | str:
    """The graph's sizes of ``source`` when static and small; else ``PROBE_ROWS`` token rows, which needs a
    sub-DAG that spells no sizes (regroupings of token rows aside: they are spelled anew) and keeps one row of
    every value per token (a reduction over token rows would look per-token on probe rows whose leading dims are 1)."""
    shape = value_of(source).shape
    width = shape[-1] if shape else None
    if not isinstance(width, int):
        return f"{source.name} has no static row width"
    if all(isinstance(d, int) for d in shape) and math.prod(shape) <= MAX_PROBE_ELEMENTS:
        return tuple(shape)
    sized = [
        n.name
        for n in nodes
        if (_op_name(n) in SIZED_OPS and not regroups_rows(n)) or n.target is torch.ops.aten.sym_size.int
    ]
    if sized:
        return f"its sizes are spelled in the graph ({', '.join(sized[:3])}) and {source.name} is too large to probe"
    rows = math.prod(shape[:-1])
    across = [n.name for n in nodes if not _per_row_or_scalar(value_of(n), rows)]
    if across:
        return f"{', '.join(across[:3])} mixes token rows and {source.name} is too large to probe"
    return (*([1] * (len(shape) - 2)), PROBE_ROWS, width)


def regroups_rows(node: fx.Node) -> bool:
    """A reshape that only regroups token rows (``view(-1, S)`` of ``[batch, seq, S]``): the row width stays
    (static), so row i of the result is row i of the input in row-major order."""
    if node.target not in RESHAPES:
        return False
    src, out = value_of(node.args[0]), value_of(node)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dim() >= 1 and out.dim() >= 2):
        return False
    return isinstance(out.shape[-1], int) and statically_known_true(src.shape[-1] == out.shape[-1])


def _per_row_or_scalar(value: object, rows: object) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return True
    if all(isinstance(d, int) for d in value.shape) and math.prod(value.shape) == 1:
        return True  # a broadcast constant
    # one row per token, with or without the row's trailing dim (an amax without keepdim)
    return statically_known_true(math.prod(value.shape[:-1]) == rows) or statically_known_true(
        math.prod(value.shape) == rows
    )


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _standalone(
    source: fx.Node, codes: fx.Node, scale: fx.Node | None, nodes: tuple[fx.Node, ...], shrunk: bool
) -> fx.GraphModule:
    """The sub-DAG as a graph of its own: ``(x) -> (codes, scale)``. On a ``shrunk`` probe (fewer token rows than
    the graph's) a regrouping of token rows becomes ``reshape(-1, width)``, leading 1s keeping its rank."""
    graph = fx.Graph()
    env = {source: graph.placeholder("x")}
    for node in nodes:
        if shrunk and regroups_rows(node):
            rank, width = value_of(node).dim(), value_of(node).shape[-1]
            sizes = [*([1] * (rank - 2)), -1, int(width)]
            env[node] = graph.call_function(torch.ops.aten.reshape.default, (env[node.args[0]], sizes))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output((env[codes], env[scale] if scale is not None else None))
    owner = source.graph.owning_module
    return fx.GraphModule(owner if owner is not None else torch.nn.Module(), graph)


def _fill(rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``rows`` over the token rows of ``shape``: each once, then drawn at random (fixed seed). Not tiled in
    order: a tiling repeats itself across the batch, where a reduction over token rows would look per-token."""
    tokens = math.prod(shape[:-1])
    first = torch.arange(min(tokens, rows.shape[0]))
    rest = torch.randint(0, rows.shape[0], (tokens - len(first),), generator=torch.Generator().manual_seed(1))
    return rows[torch.cat([first, rest])].reshape(shape)


def _difference(module: fx.GraphModule, x: torch.Tensor, with_scale: bool) -> str | None:
    """How the sub-DAG's (codes, scale) of ``x`` differ from the contract's, or None when bit-identical."""
    try:
        codes, scale = module(x)
    except Exception as err:  # any op may refuse a probe input; that is a difference too, reported as such
        return f"it raised {type(err).__name__}: {err}"
    want_codes, want_scale = per_token_quant(x)
    # Compared row by row: a quant behind a regrouping of token rows gives the same rows in another grouping.
    if codes.dtype != FP8_DTYPE or codes.shape[-1:] != want_codes.shape[-1:] or codes.numel() != want_codes.numel():
        return f"codes {codes.dtype} {tuple(codes.shape)}, the contract's {FP8_DTYPE} {tuple(want_codes.shape)}"
    codes, want_codes = codes.reshape(-1, codes.shape[-1]), want_codes.reshape(-1, want_codes.shape[-1])
    if with_scale:
        if scale.numel() != want_scale.numel():
            return f"scale shape {tuple(scale.shape)}, the contract's {tuple(want_scale.shape)}"
        scale, want_scale = scale.reshape(-1), want_scale.reshape(-1)
        if not _same_bits(scale, want_scale):
            return _first_difference("scale", scale, want_scale)
    if not _same_bits(codes, want_codes):
        return _first_difference("code", codes, want_codes)
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _first_difference(what: str, got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"{what} shape {tuple(got.shape)}, the contract's {tuple(want.shape)}"
    index = next(_differing(got, want))
    return f"{what} {got.flatten()[index].item()!r} where the contract gives {want.flatten()[index].item()!r}"


def _differing(got: torch.Tensor, want: torch.Tensor) -> Iterator[int]:
    diff = (_bits(got) != _bits(want)).flatten().nonzero()
    yield from (int(i) for i in diff[:, 0])

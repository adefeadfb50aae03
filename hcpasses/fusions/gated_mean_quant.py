"""Fusion pass: HC stream collapse + per-token FP8 quant -> one ``hcpasses`` op.

Before (Qwen3.8-Flash-Next as transformers writes it; bf16 shown)::

    s  = sigmoid(u)                              u, xn: [T, n*S]
    g  = reshape(s, [T, n, S]) * reshape(xn, [T, n, S])
    x  = mean(g, [-2])                           [T, S]   (the sub-layer input)
    xf = convert(x, f32); a = amax(abs(xf), [-1], keepdim)
    scale = clamp_min(a / 448, 1/(448*512))      [T, 1]
    q  = convert(clamp(xf / scale, -448, 448), f8e4m3)

After::

    x, q, scale = hcpasses.gated_mean_quant(xn, u, n)     # one pass over xn and u
    (x kept only when something other than the quant uses it)

The same for ATOM's fp32 mean (``(sum_s sigmoid(u_s) * xn_s) / n``, one rounding) and for the
DeepSeek-V4 mHC collapse (``sum_s w_s * h_s``, scalar fp32 gates) -> ``hcpasses.weighted_sum_quant``.

Applies when: the collapse is exactly one of the patterns in ``hcpasses.patterns.gated_mean`` in
fp32, bf16 or fp16 (both inputs of that dtype; mHC gates fp32), on 2-D ``[T, n*S]`` streams with static
n and S, and the quant that follows is the DESIGN §5 convention to the constant. Bails out (leaves the
collapse alone and says so in the report) when no quant follows, when the quant differs in any
constant or dtype, or when the collapse reduces over another dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

import hcpasses.kernels  # noqa: F401  (registers torch.ops.hcpasses.*)
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.gated_mean import atom_gated_mean, mhc_collapse, per_token_quant, transformers_gated_mean
from hcpasses.patterns.tracing import matched, reduces_dim, split_streams, trace_pattern

aten = torch.ops.aten
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Sizes the patterns are traced at. N_TRACE is an odd value no other literal in the patterns takes,
# so ATOM's literal "/ n" can become a wildcard bound to the name "n".
T_TRACE, N_TRACE, S_TRACE = 2, 3, 5


@dataclasses.dataclass(frozen=True)
class Collapse:
    """One way models write the stream collapse, and the fused op that replaces it (+ the quant)."""

    name: str
    search: Callable[..., torch.Tensor]  # (gate, streams, n, hidden) -> x
    reduction: Any  # the ATen op that sums over the stream dim
    gated_mean: bool  # True: gate is u [T, n*S] (sigmoid inside); False: gate is w [T, n] fp32
    literal_n: bool  # the pattern divides by a literal n

    def gate_example(self, dtype: torch.dtype) -> torch.Tensor:
        if self.gated_mean:
            return torch.randn(T_TRACE, N_TRACE * S_TRACE, dtype=dtype)
        return torch.randn(T_TRACE, N_TRACE, dtype=torch.float32)

    @property
    def fused_op(self) -> Any:
        """``op(streams, gate, n) -> (x, q, scale)``."""
        return torch.ops.hcpasses.gated_mean_quant if self.gated_mean else torch.ops.hcpasses.weighted_sum_quant


COLLAPSES = (
    Collapse("transformers", transformers_gated_mean, aten.mean.dim, gated_mean=True, literal_n=False),
    Collapse("atom", atom_gated_mean, aten.sum.dim_IntList, gated_mean=True, literal_n=True),
    Collapse("mhc", mhc_collapse, aten.sum.dim_IntList, gated_mean=False, literal_n=False),
)


def _stream_split(match: Match, collapse: Collapse, dtype: torch.dtype) -> tuple[int, int] | None:
    """``(n, S)`` if the match is really this collapse over ``dtype`` activations, else ``None``."""
    gate, streams = match.kwargs["gate"], match.kwargs["streams"]
    gate_val, streams_val = gate.meta.get("val"), streams.meta.get("val")
    if not isinstance(gate_val, torch.Tensor) or not isinstance(streams_val, torch.Tensor):
        return None
    splits = {split_streams(node) for node in matched(match, aten.reshape.default)}
    if len(splits) != 1 or None in splits:
        return None
    ((n, hidden),) = splits
    gate_width = n * hidden if collapse.gated_mean else n
    gate_dtype = dtype if collapse.gated_mean else torch.float32
    if streams_val.dtype != dtype or gate_val.dtype != gate_dtype or gate_val.dim() != 2:
        return None
    if gate_val.shape[1] != gate_width or not statically_known_true(gate_val.shape[0] == streams_val.shape[0]):
        return None
    if not all(reduces_dim(node, 3, -2) for node in matched(match, collapse.reduction)):
        return None
    if not all(reduces_dim(node, 2, -1) for node in matched(match, aten.amax.default)):
        return None
    if collapse.literal_n and match.kwargs.get("n") != n:
        return None
    return n, hidden


def _search_fns(collapse: Collapse) -> dict[str, Callable[..., Any]]:
    def collapse_only(gate: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return collapse.search(gate, streams, N_TRACE, S_TRACE)

    def with_quant(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token_quant(collapse_only(gate, streams))

    def with_quant_keep_x(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = collapse_only(gate, streams)
        return (x, *per_token_quant(x))

    return {"collapse": collapse_only, "quant": with_quant, "quant_keep_x": with_quant_keep_x}


class GatedMeanQuantFusion(GraphPass):
    """Replaces each HC collapse followed by a per-token FP8 quant with one fused op."""

    name = "gated_mean_quant"

    def __init__(self) -> None:
        # Patterns are traced on first use, not at import: tracing ~20 small functions takes a second.
        self._patterns: tuple[PatternMatcherPass, PatternMatcherPass] | None = None

    def _build_patterns(self) -> tuple[PatternMatcherPass, PatternMatcherPass]:
        finder = PatternMatcherPass(pass_name="hcpasses_find_hc_collapse")
        fuser = PatternMatcherPass(pass_name="hcpasses_gated_mean_quant")
        for collapse in COLLAPSES:
            scalars = {"n": N_TRACE} if collapse.literal_n else None
            for dtype in ACTIVATION_DTYPES:
                examples = [collapse.gate_example(dtype), torch.randn(T_TRACE, N_TRACE * S_TRACE, dtype=dtype)]
                for kind, search in _search_fns(collapse).items():
                    pattern = trace_pattern(search, examples, ["gate", "streams"], scalars)
                    check = _match_check(collapse, dtype)
                    target = finder if kind == "collapse" else fuser
                    handler = _count_only if kind == "collapse" else _fuse_handler(collapse, dtype, kind)
                    register_graph_pattern(pattern, extra_check=check, pass_dict=target)(handler)
        return finder, fuser

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if self._patterns is None:
            self._patterns = self._build_patterns()
        finder, fuser = self._patterns
        found = finder.apply(graph)
        fused = fuser.apply(graph)
        notes = (f"HC stream collapses found: {found}", f"fused with a per-token FP8 quant: {fused}")
        if fused:
            reason = None if fused >= found else f"{found - fused} collapse(s) have no per-token FP8 quant after them"
            return PassResult(applied=fused, reason=reason, notes=notes)
        if found:
            return PassResult(0, f"{found} HC collapse(s) found, none followed by a per-token FP8 quant", notes)
        return PassResult(0, "no HC stream collapse (gated mean / mHC collapse) in this graph", notes)


def _match_check(collapse: Collapse, dtype: torch.dtype) -> Callable[[Match], bool]:
    return lambda match: _stream_split(match, collapse, dtype) is not None


def _count_only(match: Match, *args: Any, **kwargs: Any) -> None:
    """The finder only counts collapses; the graph is not touched."""


def _fuse_handler(collapse: Collapse, dtype: torch.dtype, kind: str) -> Callable[..., None]:
    def handler(match: Match, *args: Any, **kwargs: Any) -> None:
        split = _stream_split(match, collapse, dtype)
        assert split is not None  # extra_check passed on this very match
        n = split[0]

        def replacement(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
            x, q, scale = collapse.fused_op(streams, gate, n)
            return (x, q, scale) if kind == "quant_keep_x" else (q, scale)

        match.replace_by_example(replacement, [kwargs["gate"], kwargs["streams"]])

    return handler

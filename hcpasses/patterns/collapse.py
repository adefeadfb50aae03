"""Finding HC stream collapses in a post-grad graph (used by the fusion and the SP passes).

A collapse turns the n streams ``[..., n*S]`` (or stacked ``[..., n, S]``) into the sub-layer input
``x [..., S]``; the leading dims are the tokens (``[T]`` or ``[batch, seq]``). It is found either
unfused (one of the plain-torch patterns of ``hcpasses.patterns.gated_mean``, traced per activation
dtype), already fused (``torch.ops.hcpasses.gated_mean_quant`` / ``weighted_sum_quant``), or, spelled any other
way, by evaluation among the nodes no pattern took (``hcpasses.patterns.collapse_evaluation``). Every match
is checked beyond the pattern (``stream_split``): the reshapes split ``[..., n*S]`` into ``[..., n, S]``
with static n and S, the gate has the streams' leading dims, the reductions run over the stream dim,
dtypes are the registered ones.

A match must also have the shape of HC streams (``lookalike_reason``): the same algebra, a gated sum over a
dim of a ``[..., n, S]`` value, is common elsewhere (the forward-substitution loop of a chunked delta-rule
solve, ``(row.unsqueeze(-1) * sub).sum(-2)`` on ``[batch, heads, chunks, i, i]``, is the stacked mHC form
with n = S = i), and counting it as an HC block would make both passes' reports, and SP's region, wrong.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternExpr, PatternMatcherPass, register_graph_pattern

import hcpasses.kernels  # noqa: F401  (registers torch.ops.hcpasses.*)
from hcpasses.patterns.collapse_evaluation import CollapseNearMiss, find_by_evaluation
from hcpasses.patterns.gated_mean import (
    activation_sum_gated_mean,
    atom_gated_mean,
    mhc_collapse,
    per_token_quant,
    stacked_mhc_collapse,
    transformers_gated_mean,
    unrounded_mhc_collapse,
    unrounded_stacked_mhc_collapse,
)
from hcpasses.patterns.tracing import matched, reduces_dim, same_sizes, split_streams, trace_pattern, value_of

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
    gated_mean: bool  # True: gate is u [..., n*S] (sigmoid inside); False: gate is w [..., n] fp32
    literal_n: bool  # the pattern divides by a literal n
    stacked: bool = False  # streams are [..., n, S] (no reshape in the pattern) instead of [..., n*S]
    dtypes: tuple[torch.dtype, ...] = ACTIVATION_DTYPES  # activation dtypes the form is traced for
    rounded_sum: bool = False  # the sum is rounded to the activation dtype before the division by n
    unrounded: bool = False  # x stays fp32 over bf16 / fp16 streams (the fused op rounds x to the streams' dtype)

    def refusal(self, n: int, dtype: torch.dtype) -> str | None:
        """Why the fused op (fp32 terms, one rounding of the mean) would not give this form's values for
        ``n`` streams of ``dtype``; None when it does (bit-identical, or within the one rounding of the
        products that the activation-dtype forms make)."""
        if self.unrounded:
            return (
                f"x stays float32 over {dtype} streams (written so, or its rounding to {dtype} folded away by torch "
                "2.11's pointless_convert before an upcast); the fused op rounds x once, which would change the "
                "graph's values"
            )
        if self.rounded_sum and n & (n - 1):
            return (
                f"the sum is rounded to {dtype} before the division by n = {n} (not a power of two: a second "
                "rounding the fused op does not make)"
            )
        return None

    def gate_example(self, dtype: torch.dtype) -> torch.Tensor:
        if self.gated_mean:
            return torch.randn(T_TRACE, N_TRACE * S_TRACE, dtype=dtype)
        return torch.randn(T_TRACE, N_TRACE, dtype=torch.float32)

    def streams_example(self, dtype: torch.dtype) -> torch.Tensor:
        if self.stacked:
            return torch.randn(T_TRACE, N_TRACE, S_TRACE, dtype=dtype)
        return torch.randn(T_TRACE, N_TRACE * S_TRACE, dtype=dtype)

    @property
    def fused_op(self) -> Any:
        """``op(streams, gate, n) -> (x, q, scale)``."""
        return torch.ops.hcpasses.gated_mean_quant if self.gated_mean else torch.ops.hcpasses.weighted_sum_quant


LOW_PRECISION = (torch.bfloat16, torch.float16)
SUM = aten.sum.dim_IntList
COLLAPSES = (
    Collapse("transformers", transformers_gated_mean, aten.mean.dim, gated_mean=True, literal_n=False),
    Collapse("atom", atom_gated_mean, SUM, gated_mean=True, literal_n=True),
    # In fp32 this form is ATOM's graph; in bf16 / fp16, rounded sum / n (exactly the mean when n is 2^k).
    Collapse("activation_sum", activation_sum_gated_mean, SUM, True, True, dtypes=LOW_PRECISION, rounded_sum=True),
    Collapse("mhc", mhc_collapse, SUM, gated_mean=False, literal_n=False),
    Collapse("mhc_stacked", stacked_mhc_collapse, SUM, gated_mean=False, literal_n=False, stacked=True),
    # Found (an HC block to SP; inside a rounded form it is the same block, found once as the outer match) but
    # never fused: see Collapse.refusal.
    Collapse("mhc_unrounded", unrounded_mhc_collapse, SUM, False, False, dtypes=LOW_PRECISION, unrounded=True),
    Collapse(
        "mhc_stacked_unrounded", unrounded_stacked_mhc_collapse, SUM, False, False, True, LOW_PRECISION, unrounded=True
    ),
)


def stream_split(match: Match, collapse: Collapse, dtype: torch.dtype) -> tuple[int, int] | None:
    """``(n, S)`` if the match is really this collapse over ``dtype`` activations, else ``None``."""
    gate, streams = match.kwargs["gate"], match.kwargs["streams"]
    gate_val, streams_val = gate.meta.get("val"), streams.meta.get("val")
    if not isinstance(gate_val, torch.Tensor) or not isinstance(streams_val, torch.Tensor):
        return None
    split = _stacked_split(streams) if collapse.stacked else _reshape_split(match)
    if split is None:
        return None
    n, hidden = split
    lead = streams_val.shape[: -2 if collapse.stacked else -1]  # the token dims
    gate_width = n * hidden if collapse.gated_mean else n
    gate_dtype = dtype if collapse.gated_mean else torch.float32
    if streams_val.dtype != dtype or gate_val.dtype != gate_dtype or gate_val.dim() != len(lead) + 1:
        return None
    if gate_val.shape[-1] != gate_width or not same_sizes(gate_val.shape[:-1], lead):
        return None
    if not all(reduces_dim(node, len(lead) + 2, -2) for node in matched(match, collapse.reduction)):
        return None
    if not all(reduces_dim(node, len(lead) + 1, -1) for node in matched(match, aten.amax.default)):
        return None
    if collapse.literal_n and match.kwargs.get("n") != n:
        return None
    return n, hidden


# HC streams are token rows ([T, ...] or [batch, seq, ...]: DESIGN §2) of n residual copies, each as wide as
# the hidden size, so much wider than the handful of streams.
MAX_TOKEN_DIMS = 2


def lookalike_reason(match: Match, collapse: Collapse, dtype: torch.dtype) -> str | None:
    """Why a match of the collapse algebra is not an HC stream collapse (None when it is one)."""
    split = stream_split(match, collapse, dtype)
    assert split is not None
    n, hidden = split
    lead = match.kwargs["gate"].meta["val"].dim() - 1
    if lead > MAX_TOKEN_DIMS:
        return f"{lead} leading dims (HC streams lead with [T] or [batch, seq])"
    if hidden <= n:
        return f"width {hidden} is not wider than its {n} streams"
    return None


def _reshape_split(match: Match) -> tuple[int, int] | None:
    splits = {split_streams(node) for node in matched(match, aten.reshape.default)}
    return next(iter(splits)) if len(splits) == 1 and None not in splits else None


def _stacked_split(streams: fx.Node) -> tuple[int, int] | None:
    if streams.target is aten.reshape.default and split_streams(streams) is not None:
        return None  # flat streams split in the graph: the flat pattern matches, with the real stream value
    val = streams.meta["val"]
    if val.dim() < 3:
        return None
    n, hidden = val.shape[-2], val.shape[-1]
    return (n, hidden) if isinstance(n, int) and isinstance(hidden, int) else None


def search_fns(collapse: Collapse) -> dict[str, Callable[..., Any]]:
    def collapse_only(gate: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return collapse.search(gate, streams, N_TRACE, S_TRACE)

    def with_quant(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token_quant(collapse_only(gate, streams))

    def with_quant_keep_x(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = collapse_only(gate, streams)
        return (x, *per_token_quant(x))

    return {"collapse": collapse_only, "quant": with_quant, "quant_keep_x": with_quant_keep_x}


@dataclasses.dataclass(frozen=True)
class FoundCollapse:
    """One collapse in a graph.

    ``root``: the node computing x (the mean / sum, or the fused op); ``outputs``: the nodes that hold its
    results (x, or the fused op's getitems); ``streams``: the normed streams xn (gated mean) or the raw
    streams h (mHC), as the model holds them (before the fusion's flattening reshape); ``gate``: u or w;
    ``normed``: whether ``streams`` is a norm of the stream value.
    """

    root: fx.Node
    outputs: tuple[fx.Node, ...]
    gate: fx.Node
    streams: fx.Node
    n: int
    normed: bool
    refusal: str | None = None  # why the fusion leaves this form alone (``Collapse.refusal``)


FUSED_GATED_MEAN = torch.ops.hcpasses.gated_mean_quant.default
FUSED_WEIGHTED_SUM = torch.ops.hcpasses.weighted_sum_quant.default


class CollapseFinder:
    """Finds every collapse, fused or not. Patterns are traced on first use (about a second)."""

    def __init__(self) -> None:
        self._finder: PatternMatcherPass | None = None
        self._found: list[tuple[FoundCollapse, frozenset[fx.Node]]] = []  # each match and its nodes
        self.lookalikes: list[tuple[fx.Node, str]] = []  # (root, why) of each match that is no HC collapse
        self.evaluated = 0  # collapses of the last ``find`` that evaluation found (no pattern matched them)
        self.near_misses: list[CollapseNearMiss] = []  # collapse-shaped sub-DAGs that evaluate otherwise

    def _build(self) -> PatternMatcherPass:
        finder = PatternMatcherPass(pass_name="hcpasses_find_hc_collapse")
        for collapse, dtype, pattern in traced_patterns("collapse"):
            check = match_check(collapse, dtype)
            register_graph_pattern(pattern, extra_check=check, pass_dict=finder)(self._record(collapse, dtype))
        return finder

    def _record(self, collapse: Collapse, dtype: torch.dtype) -> Callable[..., None]:
        def handler(match: Match, *args: Any, **kwargs: Any) -> None:
            split = stream_split(match, collapse, dtype)
            assert split is not None  # extra_check passed on this very match
            root = match.output_node()
            n = split[0]
            lookalike = lookalike_reason(match, collapse, dtype)
            if lookalike is not None:
                self.lookalikes.append((root, lookalike))
                return
            refusal = collapse.refusal(n, dtype)
            found = FoundCollapse(root, (root,), kwargs["gate"], kwargs["streams"], n, collapse.gated_mean, refusal)
            self._found.append((found, frozenset(match.nodes)))

        return handler

    def find(self, graph: fx.Graph) -> list[FoundCollapse]:
        """Unfused and fused collapses in graph order: the traced patterns' matches, then the collapses that
        evaluation finds among the rest of the graph (``hcpasses.patterns.collapse_evaluation``)."""
        if self._finder is None:
            self._finder = self._build()
        self._found, self.lookalikes = [], []
        self._finder.apply(graph)
        # A collapse computed in fp32 inside a bf16 one (ATOM: upcast, collapse, round back) is also the fp32
        # pattern: it is the same block, found once, as the outer match.
        found = [
            c
            for c, _ in self._found
            if not any(c.root in nodes and c.root is not outer.root for outer, nodes in self._found)
        ]
        found += [_fused(node) for node in graph.nodes if node.target in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]
        taken = {node for _, nodes in self._found for node in nodes} | {n for c in found for n in (c.root, *c.outputs)}
        evaluated, self.near_misses = find_by_evaluation(graph, taken)
        self.evaluated = len(evaluated)
        found += [FoundCollapse(m.root, (m.root,), m.gate, m.streams, m.n, m.normed, m.refusal) for m in evaluated]
        # a look-alike of the patterns inside a collapse that evaluation found (a bmm rewritten to a gated sum with
        # a unit dim) is part of that collapse
        inside = {node for m in evaluated for node in m.nodes}
        order = {node: i for i, node in enumerate(graph.nodes)}
        self.lookalikes = sorted((p for p in self.lookalikes if p[0] not in inside), key=lambda pair: order[pair[0]])
        return sorted(found, key=lambda c: order[c.root])

    def evaluation_notes(self, found: int) -> tuple[str, ...]:
        """Lines on what the last ``find`` decided by evaluation: the collapses it found and, when no collapse at all
        was ``found`` (a model whose spelling nothing takes), the near misses (the first few). Beside found
        collapses a near miss is most often a value computed from the blocks' streams (a GEMM of the normed
        streams), not a collapse spelled otherwise, so it is left out of the report."""
        notes: tuple[str, ...] = ()
        if self.evaluated:
            notes += (f"of them found by evaluation (no pattern matched): {self.evaluated}",)
        if self.near_misses and not found:
            shown = "; ".join(map(str, self.near_misses[:3])) + ("; ..." if len(self.near_misses) > 3 else "")
            notes += (f"collapse-shaped values that evaluate otherwise, left out: {len(self.near_misses)} ({shown})",)
        return notes

    def lookalike_note(self) -> str | None:
        """One line on the collapse-shaped sums the last ``find`` left out (count, the first few and why)."""
        if not self.lookalikes:
            return None
        shown = "; ".join(f"{node.name}: {why}" for node, why in self.lookalikes[:3])
        shown += "; ..." if len(self.lookalikes) > 3 else ""
        return f"collapse-shaped sums that are no HC stream collapse, left out: {len(self.lookalikes)} ({shown})"


def _fused(node: fx.Node) -> FoundCollapse:
    streams, gate, n = _unflattened(node.args[0]), _unflattened(node.args[1]), node.args[2]
    assert isinstance(streams, fx.Node) and isinstance(gate, fx.Node) and isinstance(n, int)
    outputs = tuple(user for user in node.users)
    return FoundCollapse(node, outputs, gate, streams, n, normed=node.target is FUSED_GATED_MEAN)


def _unflattened(arg: Any) -> Any:
    """What the model held before the fusion flattened it to the fused op's 2-D ``[tokens, width]``."""
    if not isinstance(arg, fx.Node) or arg.target not in (aten.reshape.default, aten.view.default):
        return arg
    source, out = arg.args[0], arg.meta.get("val")
    source_val = value_of(source)
    if not isinstance(source_val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return arg
    # The fusion's flattening merges the token dims and keeps the width; a model's own reshape of [..., n, S]
    # into [..., n*S] (a flatten(-2) after a per-stream norm) is where the model's streams are, not before it.
    if source_val.dim() > 2 == out.dim() and source_val.shape[-1] == out.shape[-1]:
        return source
    return arg


@functools.cache
def traced_patterns(kind: str) -> tuple[tuple[Collapse, torch.dtype, PatternExpr], ...]:
    """Every collapse in every activation dtype, traced as the ``kind`` search function of ``search_fns``.

    Memoised: a pure function of the pattern sources (tracing them takes about a second, and every compile
    builds its passes anew); pattern-matcher passes only read the patterns they register.
    """
    traced = []
    for collapse in COLLAPSES:
        scalars = {"n": N_TRACE} if collapse.literal_n else None
        for dtype in collapse.dtypes:
            examples = [collapse.gate_example(dtype), collapse.streams_example(dtype)]
            pattern = trace_pattern(search_fns(collapse)[kind], examples, ["gate", "streams"], scalars)
            traced.append((collapse, dtype, pattern))
    return tuple(traced)


def match_check(collapse: Collapse, dtype: torch.dtype) -> Callable[[Match], bool]:
    return lambda match: stream_split(match, collapse, dtype) is not None


def fusion_check(collapse: Collapse, dtype: torch.dtype) -> Callable[[Match], bool]:
    """``match_check``, an HC collapse (not a lookalike), and the fused op gives what this form gives
    (``Collapse.refusal``)."""

    def check(match: Match) -> bool:
        split = stream_split(match, collapse, dtype)
        if split is None or lookalike_reason(match, collapse, dtype) is not None:
            return False
        return collapse.refusal(split[0], dtype) is None

    return check

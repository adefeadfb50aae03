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

With more than one token dim (``[batch, seq, n*S]``, transformers), the op reads the streams and the
gate reshaped to ``[batch*seq, width]`` and its outputs are reshaped back.

The same for ATOM's fp32 mean (``(sum_s sigmoid(u_s) * xn_s) / n``, one rounding) and for the
DeepSeek-V4 mHC collapse (``sum_s w_s * h_s``, scalar fp32 gates) -> ``hcpasses.weighted_sum_quant``.

Applies when: the collapse is exactly one of the patterns in ``hcpasses.patterns.gated_mean`` in
fp32, bf16 or fp16 (both inputs of that dtype; mHC gates fp32) whose values the fused op gives (a bf16
``sum / n`` is the mean only when n is a power of two), on ``[..., n*S]`` (or stacked
``[..., n, S]``) streams with static n and S, or any other spelling that the collapse finder takes by evaluation
(``hcpasses.patterns.collapse_evaluation``: values within the formula's rounding, x in the streams' dtype), and
the quant that follows computes the DESIGN §5 convention.
The quant is found two ways: the traced patterns (the quant as ``hcpasses.kernels.contract`` spells it), then,
for a collapse no pattern fused, by evaluation (``hcpasses.patterns.quant_evaluation``): the sub-DAG from the
collapse output to a downstream FP8 cast, whatever its ops, run on probe rows and accepted when its codes and
scales are bit-identical to the contract's (the report counts these, with the probes and the time it took).
Then x is quantised once: every other FP8 cast downstream of a fused x that evaluation finds to be its
per-token quant (bit-identical to the contract, as the fused op's codes and scales are) reads the fused codes
and scales instead, and its nodes go (an ``Fp8Linear`` quantises its input per projection; a GatedDeltaNet has
four that read x). A quant with no fused output of its shape, or whose readers come before the fused op, stays,
and the notes say which and why.
Bails out (leaves the collapse alone and says so in the report) when no quant follows, when the quant is a near
miss (the report names the probe that separated it), when it reads another value than the collapse output, or
when the collapse reduces over another dim.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.collapse import (
    FUSED_GATED_MEAN,
    FUSED_WEIGHTED_SUM,
    Collapse,
    CollapseFinder,
    FoundCollapse,
    fusion_check,
    stream_split,
    traced_patterns,
)
from hcpasses.patterns.quant_evaluation import Judgement, NearMiss, QuantMatch, judge_quant
from hcpasses.patterns.tracing import same_sizes, value_of

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig


class GatedMeanQuantFusion(GraphPass):
    """Replaces each HC collapse followed by a per-token FP8 quant with one fused op."""

    name = "gated_mean_quant"

    def __init__(self) -> None:
        self._finder = CollapseFinder()
        # Patterns are traced on first use, not at import: tracing ~30 small functions takes a second.
        self._fuser: PatternMatcherPass | None = None

    def _build_fuser(self) -> PatternMatcherPass:
        fuser = PatternMatcherPass(pass_name="hcpasses_gated_mean_quant")
        for kind in ("quant", "quant_keep_x"):
            for collapse, dtype, pattern in traced_patterns(kind):
                check = fusion_check(collapse, dtype)
                register_graph_pattern(pattern, extra_check=check, pass_dict=fuser)(
                    _fuse_handler(collapse, dtype, kind)
                )
        return fuser

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if self._fuser is None:
            self._fuser = self._build_fuser()
        collapses = self._finder.find(graph)
        found = sum(1 for c in collapses if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM))
        found_notes = self._finder.evaluation_notes(len(collapses))
        by_pattern = self._fuser.apply(graph)
        collapses = self._finder.find(graph)
        lookalikes = self._finder.lookalike_note()
        left = [c for c in collapses if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]
        started = time.perf_counter()
        judged = {c.root: _quant_by_evaluation(c) for c in left if c.refusal is None}
        evaluation_ms = (time.perf_counter() - started) * 1e3
        evaluated = [match for match in judged.values() if isinstance(match, QuantMatch)]
        for collapse in left:
            if isinstance(judged.get(collapse.root), QuantMatch):
                fuse_matched_quant(graph, collapse, judged[collapse.root])
        fused = by_pattern + len(evaluated)
        shared, unshared = share_fused_quants(graph) if fused else (0, [])
        notes: tuple[str, ...] = (f"HC stream collapses found: {found}", *found_notes)
        notes += (f"fused with a per-token FP8 quant: {fused}",)
        if evaluated:
            probes = evaluated[0].probes
            notes += (f"of them matched by evaluation ({probes} probes): {len(evaluated)}",)
        if shared or unshared:
            notes += (f"other FP8 quants of a fused x served by the fused codes and scales: {shared}",)
        if unshared:
            notes += (f"other FP8 quants of a fused x left as they are: {'; '.join(unshared)}",)
        if judged:  # the cost of evaluation (issue #26: passes stay within 10 % of Inductor's compile time)
            notes += (f"quants judged by evaluation after {len(judged)} collapses: {evaluation_ms:.1f} ms",)
        if lookalikes:
            notes += (lookalikes,)
        if not found:
            return PassResult(0, "no HC stream collapse (gated mean / mHC collapse) in this graph", notes)
        unfused = [c for c in left if not isinstance(judged.get(c.root), QuantMatch)]
        reasons = [why_not_fused(c, judged.get(c.root)) for c in unfused]
        reason = f"not fused: {'; '.join(reasons)}" if unfused else None
        return PassResult(applied=fused, reason=reason, notes=notes)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SEARCH_LIMIT = 200  # nodes visited downstream of a collapse when looking for an FP8 cast


def _is_fp8_cast(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in FP8_DTYPES


def _downstream_fp8_casts(root: fx.Node) -> list[fx.Node]:
    """The FP8 casts among the first ``_SEARCH_LIMIT`` nodes downstream of ``root``, nearest first."""
    seen, frontier, casts = {root}, [root], []
    while frontier and len(seen) < _SEARCH_LIMIT:
        frontier = [user for node in frontier for user in node.users if user not in seen and not seen.add(user)]
        casts += [node for node in frontier if _is_fp8_cast(node)]
    return casts


def _is_quant_cast(node: fx.Node) -> bool:
    """An FP8 value made from values that are not FP8 (a cast, not a view of codes)."""
    return _is_fp8_cast(node) and not any(_is_fp8_cast(i) for i in node.all_input_nodes)


def share_fused_quants(graph: fx.Graph) -> tuple[int, list[str]]:
    """Let every other per-token FP8 quant of a fused op's x read the fused op's codes and scales: x is quantised
    once however many FP8 projections read it (an ``Fp8Linear`` quantises its input per projection, and a
    GatedDeltaNet has several). A quant qualifies by evaluation: bit-identical to the contract on every probe, as
    the fused op is, so no value changes. Returns how many quants now read the fused outputs, and why the others
    found do not (no fused output of their shape, or one defined after their readers)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    shared, unshared, planned = 0, [], set()
    for fused in [node for node in graph.nodes if node.target in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]:
        outputs = {user.args[1]: user for user in fused.users if user.target is operator.getitem}
        if 0 not in outputs or 1 not in outputs:
            continue
        xs, codes, scales = (_with_views(outputs.get(i)) for i in range(3))
        for cast in _downstream_fp8_casts(outputs[0]):
            if cast in planned or cast in codes or not _is_quant_cast(cast):
                continue
            quant = next((j for x in reversed(xs) if isinstance(j := judge_quant(x, cast), QuantMatch)), None)
            if quant is None:
                continue
            planned.update(quant.nodes)
            why = _serve(graph, quant, codes, scales, order)
            shared += why is None
            unshared += [] if why is None else [f"{cast.name}: {why}"]
    return shared, unshared


def _with_views(node: fx.Node | None) -> list[fx.Node]:
    """``node`` and its reshapes (the fused outputs viewed back to the shapes the graph reads)."""
    if node is None:
        return []
    return [node, *(user for user in node.users if user.target in (aten.reshape.default, aten.view.default))]


def _serve(
    graph: fx.Graph, quant: QuantMatch, codes: list[fx.Node], scales: list[fx.Node], order: dict[fx.Node, int]
) -> str | None:
    """Rewire ``quant``'s readers to the fused outputs of the same shape and erase its nodes, and x's view and
    the fused op's x when nothing else reads them; or why not."""
    pairs = [(quant.codes, codes)] + ([(quant.scale, scales)] if quant.scale is not None else [])
    served = {old: _same_shape(old, candidates) for old, candidates in pairs}
    if any(new is None for new in served.values()):
        return "no fused output of its shape"
    if any(order[new] > min(order[user] for user in old.users) for old, new in served.items() if old.users):
        return "the fused outputs are defined after its readers"
    for old, new in served.items():
        old.replace_all_uses_with(new)
    _erase_unused(graph, (*quant.nodes, quant.source), stop=set())
    return None


def _same_shape(node: fx.Node, candidates: list[fx.Node]) -> fx.Node | None:
    """The first candidate whose value has ``node``'s dtype and (provably) its shape."""
    want = value_of(node)
    return next(
        (c for c in candidates if value_of(c).dtype == want.dtype and same_sizes(value_of(c).shape, want.shape)), None
    )


def _quant_by_evaluation(collapse: FoundCollapse) -> Judgement | None:
    """The first FP8 cast downstream of the collapse that evaluation finds to be the per-token quant of its
    output; else the judgement of the nearest one (a near miss, or why it is no quant of it); None if none."""
    judgements = [judge_quant(collapse.root, cast) for cast in _downstream_fp8_casts(collapse.root)]
    return next((j for j in judgements if isinstance(j, QuantMatch)), judgements[0] if judgements else None)


def why_not_fused(collapse: FoundCollapse, judgement: Judgement | None = None) -> str:
    """The truth about a collapse that was not fused: its form would change numerics, no FP8 cast is
    downstream of it, the FP8 cast after it computes other values than the per-token quant (the probe that
    showed it), or the ops that stand between it and the nearest one (a norm, another source: the fused op
    quantises the collapse output itself, with the DESIGN §5 convention, so anything else is left alone)."""
    root = collapse.root
    if collapse.refusal is not None:
        return f"{root.name}: {collapse.refusal}"
    if isinstance(judgement, NearMiss):
        return f"{root.name}: the FP8 cast after it is a near miss of the per-token quant ({judgement})"
    parents: dict[fx.Node, fx.Node | None] = {root: None}
    frontier = [root]
    while frontier and len(parents) < _SEARCH_LIMIT:
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in parents:
                    continue
                parents[user] = node
                if _is_fp8_cast(user):
                    return (
                        f"{root.name}: an FP8 cast follows ({user.name}, through {_path_ops(user, parents)}) "
                        "but not as the per-token quant of the collapse output itself (DESIGN §5 convention)"
                    )
                nxt.append(user)
        frontier = nxt
    return f"{root.name}: no FP8 quant after it"


def _path_ops(cast: fx.Node, parents: dict[fx.Node, fx.Node | None]) -> str:
    ops = []
    node = parents[cast]
    while node is not None and parents[node] is not None:
        ops.append(getattr(node.target, "__name__", str(node.target)).split(".")[0])
        node = parents[node]
    return " -> ".join(reversed(ops)) or "nothing"


def _fuse_handler(collapse: Collapse, dtype: torch.dtype, kind: str) -> Callable[..., None]:
    def handler(match: Match, *args: Any, **kwargs: Any) -> None:
        split = stream_split(match, collapse, dtype)
        assert split is not None  # extra_check passed on this very match
        n, hidden = split

        def replacement(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tokens = gate.shape[:-1]  # [T] or [batch, seq]: the fused op wants them flat, streams [tokens, n*S]
            flat = None
            if len(tokens) > 1 or streams.dim() > 2:  # several token dims, or stacked streams [..., n, S]
                flat = (streams.reshape(-1, n * hidden), gate.reshape(-1, gate.shape[-1]))
            x, q, scale = collapse.fused_op(*(flat or (streams, gate)), n)
            if flat:
                x, q, scale = (t.reshape(*tokens, t.shape[-1]) for t in (x, q, scale))
            return (x, q, scale) if kind == "quant_keep_x" else (q, scale)

        match.replace_by_example(replacement, [kwargs["gate"], kwargs["streams"]])

    return handler


aten = torch.ops.aten


def fuse_matched_quant(graph: fx.Graph, collapse: FoundCollapse, quant: QuantMatch) -> None:
    """Replace a collapse and the quant that evaluation matched on its output with the fused op.

    Written on plain FX, not with ``Match.replace_by_example``: the quant's sub-DAG is any set of nodes, not the
    match of a pattern. Outputs are viewed back to the shapes the graph reads (a quant behind ``view(-1, S)``)."""
    root, gate, streams = collapse.root, collapse.gate, collapse.streams
    emit = _Emitter(graph, detect_fake_mode([value_of(streams)]), gate)
    with graph.inserting_before(root.next):  # after the collapse: its gate and streams are defined by then
        flat_streams, flat_gate = streams, gate
        if value_of(gate).dim() > 2 or value_of(streams).dim() > 2:  # several token dims or stacked streams
            # n*S wide: stacked [..., n, S] streams (and a gated mean's gate of their shape) flatten stream-major
            width = collapse.n * int(value_of(root).shape[-1])
            flat_streams = emit(aten.reshape.default, streams, [-1, width])
            flat_gate = emit(aten.reshape.default, gate, [-1, width if collapse.normed else collapse.n])
        op = FUSED_GATED_MEAN if collapse.normed else FUSED_WEIGHTED_SUM
        fused = emit(op, flat_streams, flat_gate, collapse.n)
        x, codes, scale = (emit(operator.getitem, fused, i) for i in range(3))
        outputs = [(quant.codes, codes), (root, x)] + ([(quant.scale, scale)] if quant.scale is not None else [])
        replaced = {old: emit.viewed(new, old) for old, new in outputs}
    quant.codes.replace_all_uses_with(replaced[quant.codes])
    if quant.scale is not None:
        quant.scale.replace_all_uses_with(replaced[quant.scale])
    # The quant's own nodes read x too: those that something else also reads (the MoE router's
    # ``view(-1, S)``) then stay, on the fused x; the rest are erased.
    root.replace_all_uses_with(replaced[root])
    _erase_unused(graph, (*quant.nodes, root), stop={gate, streams})


class _Emitter:
    """Inserts nodes with their fake values (the manager verifies them against a re-run)."""

    def __init__(self, graph: fx.Graph, fake_mode: Any, gate: fx.Node) -> None:
        self.graph, self.fake_mode, self.gate = graph, fake_mode, gate

    def __call__(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = fx.map_arg(args, value_of)
        with self.fake_mode:
            node.meta["val"] = target(*vals)
        return node

    def viewed(self, new: fx.Node, old: fx.Node) -> fx.Node:
        """``new`` viewed to ``old``'s shape (its token dims spelled as the gate's sizes where symbolic)."""
        want, have = value_of(old).shape, value_of(new).shape
        if same_sizes(want, have):
            return new
        return self(aten.reshape.default, new, self._sizes(want))

    def _sizes(self, shape: torch.Size) -> list[Any]:
        gate_dims = value_of(self.gate).shape[:-1]
        sizes: list[Any] = []
        for size in shape:
            if isinstance(size, int):
                sizes.append(size)
                continue
            dim = next((d for d, g in enumerate(gate_dims) if statically_known_true(g == size)), None)
            sizes.append(-1 if dim is None else self(aten.sym_size.int, self.gate, dim))
        if sum(1 for size in sizes if isinstance(size, int) and size == -1) > 1:
            raise AssertionError(f"two token sizes with no gate dim to spell them: {list(shape)}")
        return sizes


def _erase_unused(graph: fx.Graph, nodes: tuple[fx.Node, ...], stop: set[fx.Node]) -> None:
    """Erase ``nodes`` and, in turn, their inputs that nothing reads any more, up to ``stop``."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in stop or node in erased or node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)

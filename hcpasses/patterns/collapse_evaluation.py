"""The HC stream collapse found by evaluation: whatever ops a graph spells it with (an einsum or a bmm over the
stream axis, a Python loop over streams, a stack of per-stream products), a sub-DAG whose values are the gated
mean or the mHC weighted sum on every probe is a collapse.

For a candidate output ``x [*tokens, S]`` (one or two token dims, a static width S), the candidate inputs are two
of its ancestors: the streams (``[*tokens, n*S]`` or stacked ``[*tokens, n, S]``, 2 <= n <= ``MAX_STREAMS``) and a
per-token gate, either of the streams' shape and dtype (gate logits u: the gated mean ``mean_s(sigmoid(u_s) *
xn_s)``) or ``[*tokens, n]`` fp32 (mHC gates w: ``sum_s w_s * h_s``). The sub-DAG between them and ``x`` must read
nothing else but constants and sizes. It is copied into a standalone FX graph and run on CPU on probe streams and
gates; it is the collapse when on every probe each value of ``x`` lies within the formula's rounding of the exact
(float64) value: ``eps(x.dtype) * (|x| + n * sum_s |term_s|)``, the rounding of the terms and of their sum in x's
dtype in any order (an fp32 bmm, a bf16 product rounded before an fp32 mean; DESIGN §2). The furthest-upstream
pair of inputs that gives a match is the collapse's; an outer candidate (the rounding of an fp32 collapse to the
streams' dtype) is tried before the nodes inside it.

Probe sizes: the graph's when static and at most ``MAX_PROBE_ELEMENTS`` streams elements; symbolic token sizes
(dynamic shapes) are given small values, and every size the sub-DAG computes from them is evaluated with them;
static sizes above the limit take ``PROBE_ROWS`` token rows, which needs a sub-DAG whose only sized ops are
reshapes that keep the token dims (or regroup token rows), respelled for the probe.

Anything else is no collapse. A candidate that reads a stream-shaped value and a gate but computes other values is
a near miss: kept (with the probe that separated it) for the report, never found, so neither SP nor the fusion
touches it. Candidates downstream of a collapse the traced patterns found are not tried.

Hand-written rather than traced patterns: the point is to take spellings no pattern list holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import sympy
import torch
import torch.fx as fx

from hcpasses.patterns.quant_evaluation import MAX_PROBE_ELEMENTS, PROBE_ROWS, SIZED_OPS, regroups_rows
from hcpasses.patterns.tracing import same_sizes, sub_dag, value_of

MAX_STREAMS = 16  # HC models carry a handful of residual streams (n = 4 in both target models)
MAX_COLLAPSE_NODES = 96  # a Python loop over 16 streams is ~70 nodes
MAX_TRIES = 4  # pairs of inputs evaluated per candidate output (a norm without weights closes a wider pair too)
SYMBOL_PROBE_SIZE = 8  # the value a symbolic token size takes on the probes
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class CollapseMatch:
    """``x = root`` is the gated mean (``normed``) or the weighted sum of ``streams`` and ``gate`` over ``n``
    streams, computed by ``nodes``."""

    root: fx.Node
    gate: fx.Node
    streams: fx.Node
    n: int
    normed: bool
    nodes: frozenset[fx.Node]

    @property
    def refusal(self) -> str | None:
        """Why the fused op (x rounded once to the streams' dtype) would change the values of this collapse."""
        x_dtype, dtype = value_of(self.root).dtype, value_of(self.streams).dtype
        if x_dtype == dtype:
            return None
        return f"x stays {x_dtype} over {dtype} streams; the fused op rounds x once, which would change its values"


@dataclasses.dataclass(frozen=True)
class CollapseNearMiss:
    """A collapse-shaped sub-DAG (streams and a gate in, ``[tokens, S]`` out) whose values are another function."""

    root: fx.Node
    probe: str
    detail: str
    nodes: frozenset[fx.Node]

    def __str__(self) -> str:
        return f"{self.root.name} differs from the collapse on the probe '{self.probe}': {self.detail}"


@dataclasses.dataclass(frozen=True)
class _Inputs:
    gate: fx.Node
    streams: fx.Node
    n: int
    normed: bool


def find_by_evaluation(graph: fx.Graph, taken: set[fx.Node]) -> tuple[list[CollapseMatch], list[CollapseNearMiss]]:
    """The collapses of ``graph`` that evaluation finds (graph order), and the near misses that no collapse found
    explains (a function of a found collapse's x is no near miss). ``taken``: the nodes of collapses found
    otherwise; a candidate whose sub-DAG reaches one is not tried."""
    found: list[CollapseMatch] = []
    misses: list[CollapseNearMiss] = []
    consumed = set(taken)
    index = _GraphIndex(graph)
    # Graph order: a collapse is found before the values computed from it (its quant, its sub-layer), whose
    # sub-DAGs then reach it and are not tried.
    for root in list(graph.nodes):
        if root in consumed or _root_shape(root) is None:
            continue
        judged = _judge_root(root, consumed, index)
        if isinstance(judged, CollapseMatch):
            judged = _outermost(judged, consumed, index)
            found.append(judged)
            consumed |= judged.nodes | {judged.root}
        elif judged is not None:
            misses.append(judged)
    found_roots = {match.root for match in found}
    misses = [miss for miss in misses if not (miss.nodes & found_roots) and miss.root not in consumed]
    return found, misses


def _outermost(match: CollapseMatch, taken: set[fx.Node], index: _GraphIndex) -> CollapseMatch:
    """The match grown through its root's only user while that still computes the collapse: an fp32 collapse over
    bf16 streams rounded back to bf16 (ATOM's form) is one collapse, whose x is the rounded value."""
    while len(match.root.users) == 1:
        user = next(iter(match.root.users))
        shape = _root_shape(user)
        if shape is None or user in taken:
            return match
        inputs = _Inputs(match.gate, match.streams, match.n, match.normed)
        nodes = _sub_dag(user, inputs, taken, index)
        grown = _evaluate(user, inputs, nodes, shape, index) if nodes is not None else None
        if not isinstance(grown, CollapseMatch):
            return match
        match = grown
    return match


def _root_shape(node: fx.Node) -> tuple[tuple[object, ...], int] | None:
    """``(tokens, S)`` of a value that may be a collapse output: one or two token dims, a static width."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dtype not in FLOAT_DTYPES:
        return None
    if not 2 <= val.dim() <= 3 or not isinstance(val.shape[-1], int) or val.shape[-1] < 2:
        return None
    return tuple(val.shape[:-1]), val.shape[-1]


def _judge_root(root: fx.Node, taken: set[fx.Node], index: _GraphIndex) -> CollapseMatch | CollapseNearMiss | None:
    """The collapse ``root`` computes from the furthest-upstream inputs that evaluate to one (at most
    ``MAX_TRIES`` pairs of inputs that close its sub-DAG are evaluated), else the near miss of the first pair tried,
    else None."""
    shape = _root_shape(root)
    assert shape is not None
    tokens, width = shape
    first_miss: CollapseNearMiss | None = None
    tries = 0
    for inputs in _candidate_inputs(_ancestors(root, taken, index), tokens, width, index):
        nodes = _sub_dag(root, inputs, taken, index)
        if nodes is None:
            continue
        judged = _evaluate(root, inputs, nodes, shape, index)
        if isinstance(judged, CollapseMatch):
            return judged
        first_miss = first_miss or judged
        tries += 1
        if tries == MAX_TRIES:
            break
    return first_miss


def _ancestors(root: fx.Node, taken: set[fx.Node], index: _GraphIndex) -> list[fx.Node]:
    """Up to ``MAX_COLLAPSE_NODES`` value ancestors of ``root``, nearest first, not reaching past a ``taken`` node
    (a collapse already found: its x is no input of another collapse's streams or gate)."""
    seen, frontier, out = {root}, [root], []
    while frontier and len(out) < MAX_COLLAPSE_NODES:
        frontier = [
            i for node in frontier for i in index.inputs[node] if i not in seen and not seen.add(i) and i not in taken
        ]
        out += frontier
    return out


class _GraphIndex:
    """Each node's position and value inputs (the inputs its values come from; sizes aside: a probe spells them
    anew), looked up many times per candidate."""

    def __init__(self, graph: fx.Graph) -> None:
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.inputs = {node: tuple(i for i in node.all_input_nodes if not _is_size(i)) for node in graph.nodes}
        self.signature = {node: _signature(node.meta.get("val")) for node in graph.nodes}


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt)


def _signature(value: object) -> tuple[object, ...] | None:
    """dtype and sizes (symbolic ones by their expression) of a tensor value: equal for values of one shape."""
    if not isinstance(value, torch.Tensor):
        return None
    return (value.dtype, *(str(d) for d in value.shape))


def _candidate_inputs(
    ancestors: list[fx.Node], tokens: tuple[object, ...], width: int, index: _GraphIndex
) -> Iterator[_Inputs]:
    """(gate, streams) pairs among ``ancestors`` with the shapes of a collapse of ``[*tokens, width]``, streams and
    gates furthest upstream first."""
    upstream = list(reversed(ancestors))
    by_signature: dict[tuple[object, ...], list[fx.Node]] = {}
    for node in upstream:
        signature = index.signature[node]
        if signature is not None:
            by_signature.setdefault(signature, []).append(node)
    token_sizes = tuple(str(d) for d in tokens)
    for streams in upstream:
        n = _stream_count(streams, tokens, width)
        if n is None:
            continue
        same_shape = by_signature[index.signature[streams]]
        yield from (_Inputs(gate, streams, n, True) for gate in same_shape if gate is not streams)
        yield from (_Inputs(w, streams, n, False) for w in by_signature.get((torch.float32, *token_sizes, str(n)), ()))


def _stream_count(node: fx.Node, tokens: tuple[object, ...], width: int) -> int | None:
    """n when ``node`` holds n streams of ``width`` over ``tokens`` (``[*tokens, n*S]`` or ``[*tokens, n, S]``)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in FLOAT_DTYPES:
        return None
    lead = len(tokens)
    if val.dim() == lead + 1 and isinstance(val.shape[-1], int) and val.shape[-1] % width == 0:
        n = val.shape[-1] // width
    elif (
        val.dim() == lead + 2
        and isinstance(val.shape[-1], int)
        and val.shape[-1] == width
        and isinstance(val.shape[-2], int)
    ):
        n = val.shape[-2]
    else:
        return None
    # HC streams are much wider than they are many (a chunked solve's [i, i] rows are not streams)
    if not 2 <= n <= MAX_STREAMS or width <= n or not same_sizes(val.shape[:lead], tokens):
        return None
    return n


def _sub_dag(root: fx.Node, inputs: _Inputs, taken: set[fx.Node], index: _GraphIndex) -> frozenset[fx.Node] | None:
    """The nodes between the inputs and ``root`` when they read nothing else but constants and sizes."""
    nodes = sub_dag(root, (inputs.gate, inputs.streams), index.inputs.__getitem__, MAX_COLLAPSE_NODES, taken)
    return None if isinstance(nodes, str) else nodes


def probe_inputs(rows: int, n: int, width: int, normed: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Probe ``(gate, streams)`` pairs in fp32, ``[rows, n, width]`` streams: what tells the collapse apart from
    its near misses (which stream a gate weighs, the mean against the sum, the sigmoid, the dim reduced)."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-3, 4, (rows, 1, 1), generator=gen).float()
    per_stream = 2.0 ** torch.arange(n).float().view(1, n, 1)
    streams = {
        "mixed magnitudes": torch.randn(rows, n, width, generator=gen) * magnitudes,
        "streams of distinct scales": torch.randn(rows, n, width, generator=gen) * per_stream,
    }
    probes = {}
    for name, h in streams.items():
        if normed:
            gate = torch.randn(rows, n, width, generator=gen) * 3.0
            gate[:, :, ::7] = 30.0  # saturated gates: sigmoid 1
        else:
            gate = torch.randn(rows, n, generator=gen)
        probes[name] = (gate, h)
    return probes


def _evaluate(
    root: fx.Node,
    inputs: _Inputs,
    nodes: frozenset[fx.Node],
    shape: tuple[tuple[object, ...], int],
    index: _GraphIndex,
) -> CollapseMatch | CollapseNearMiss | None:
    """Run the sub-DAG on the probes; None when it cannot be probed (sizes it spells that no probe can take).
    ``index``: the graph's node positions."""
    tokens, width = shape
    plan = _probe_plan(root, inputs, nodes, tokens)
    if plan is None:
        return None
    probe_tokens, sizes = plan
    steps = _program(root, sorted(nodes, key=index.order.__getitem__), sizes, probe_tokens)
    if steps is None:
        return None
    rows = math.prod(probe_tokens)
    probes = probe_inputs(rows, inputs.n, width, inputs.normed)
    for name, (gate, streams) in probes.items():
        detail = _difference(steps, root, inputs, gate, streams, probe_tokens)
        if detail is not None:
            return CollapseNearMiss(root, name, detail, nodes)
    return CollapseMatch(root, inputs.gate, inputs.streams, inputs.n, inputs.normed, nodes)


def _probe_plan(
    root: fx.Node, inputs: _Inputs, nodes: frozenset[fx.Node], tokens: tuple[object, ...]
) -> tuple[tuple[int, ...], dict[object, int] | None] | None:
    """The probe's token sizes and how to spell symbolic sizes (a symbol -> int map; None: keep the graph's static
    sizes, respelling the token dims of reshapes). None when the sub-DAG cannot be probed."""
    symbols = {s for d in tokens if isinstance(d, torch.SymInt) for s in sympy.sympify(d.node.expr).free_symbols}
    if symbols:
        values = {s: sympy.Integer(SYMBOL_PROBE_SIZE) for s in symbols}
        probe = tuple(
            int(sympy.sympify(d.node.expr).xreplace(values)) if isinstance(d, torch.SymInt) else int(d) for d in tokens
        )
        return probe, values
    static = tuple(int(d) for d in tokens)  # type: ignore[call-overload]
    if value_of(inputs.streams).numel() <= MAX_PROBE_ELEMENTS:
        return static, {}
    # shrunk: only reshapes that keep the token dims (or regroup token rows) may spell sizes
    for node in nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in SIZED_OPS and not (_keeps_tokens(node, tokens) or regroups_rows(node)):
            return None
    return (*([1] * (len(tokens) - 1)), PROBE_ROWS), None


def _keeps_tokens(node: fx.Node, tokens: tuple[object, ...]) -> bool:
    """A reshape whose input and output both lead with the token dims and whose other sizes are static."""
    if node.target not in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        return False
    src, out, lead = value_of(node.args[0]), value_of(node), len(tokens)
    if not all(isinstance(v, torch.Tensor) and v.dim() > lead for v in (src, out)):
        return False
    return same_sizes(src.shape[:lead], tokens) and same_sizes(out.shape[:lead], tokens)


Step = tuple[fx.Node, object, tuple[object, ...], dict[str, object]]


def _program(
    root: fx.Node, nodes: list[fx.Node], sizes: dict[object, int] | None, probe_tokens: tuple[int, ...]
) -> list[Step] | None:
    """The sub-DAG's nodes as ``(node, target, args, kwargs)`` steps, their sizes spelled for ``probe_tokens``
    (other nodes stay as references, looked up when run). Run directly rather than as a new GraphModule: its
    codegen would cost more than the probes."""
    tokens = tuple(value_of(root).shape[:-1])
    inside = set(nodes)

    def spell(node: fx.Node) -> object:
        value = node.meta.get("val")
        if node in inside or not isinstance(value, torch.SymInt):
            return node
        if sizes is None:
            raise _NotProbeable
        spelled = sympy.sympify(value.node.expr).xreplace(sizes)
        if spelled.free_symbols:  # a size of something else than the tokens
            raise _NotProbeable
        return int(spelled)

    steps: list[Step] = []
    try:
        for node in nodes:
            if sizes is None and (_keeps_tokens(node, tokens) or regroups_rows(node)):
                out = value_of(node).shape
                lead = [*probe_tokens] if _keeps_tokens(node, tokens) else [*([1] * (len(out) - 2)), -1]
                respelled = [*lead, *(int(d) for d in out[len(lead) :])]
                steps.append((node, torch.ops.aten.reshape.default, (node.args[0], respelled), {}))
            elif node.op == "get_attr":
                steps.append((node, _attribute, (root.graph.owning_module, node.target), {}))
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), spell)
                steps.append((node, node.target, args, kwargs))
    except _NotProbeable:
        return None
    return steps


def _attribute(module: torch.nn.Module, target: str) -> object:
    for name in target.split("."):
        module = getattr(module, name)
    return module


def _run(steps: list[Step], root: fx.Node, inputs: _Inputs, gate: torch.Tensor, streams: torch.Tensor) -> object:
    env: dict[fx.Node, object] = {inputs.gate: gate, inputs.streams: streams}
    for node, target, args, kwargs in steps:
        env[node] = target(*fx.node.map_arg(args, env.__getitem__), **fx.node.map_arg(kwargs, env.__getitem__))
    return env[root]


class _NotProbeable(Exception):
    """The sub-DAG reads a size the probe cannot spell."""


def _difference(
    steps: list[Step],
    root: fx.Node,
    inputs: _Inputs,
    gate: torch.Tensor,
    streams: torch.Tensor,
    probe_tokens: tuple[int, ...],
) -> str | None:
    """How the sub-DAG's x of the probe differs from the collapse, or None when within its rounding."""
    dtype, x_dtype = value_of(inputs.streams).dtype, value_of(root).dtype
    streams = streams.to(dtype)  # the probe as the graph holds it: values representable in its dtype
    gate = gate.to(dtype if inputs.normed else torch.float32)
    n, width = streams.shape[1], streams.shape[2]
    terms = (torch.sigmoid(gate.double()) / n if inputs.normed else gate.double().unsqueeze(-1)) * streams.double()
    exact = terms.sum(1)
    stacked = value_of(inputs.streams).dim() > len(probe_tokens) + 1
    try:  # any op may refuse a probe input; that is a difference too, reported as such
        graph_streams = streams.reshape(*probe_tokens, n, width) if stacked else streams.reshape(*probe_tokens, -1)
        graph_gate = gate.reshape(*probe_tokens, *value_of(inputs.gate).shape[len(probe_tokens) :])
        x = _run(steps, root, inputs, graph_gate, graph_streams)
    except Exception as err:
        return f"it raised {type(err).__name__}: {err}"
    if not isinstance(x, torch.Tensor) or x.dtype != x_dtype or x.numel() != exact.numel():
        return f"x {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}, the collapse's {tuple(exact.shape)}"
    x = x.double().reshape(exact.shape)
    bound = torch.finfo(x_dtype).eps * (exact.abs() + n * terms.abs().sum(1))
    apart = (x - exact).abs()
    if not bool((apart <= bound).all()):  # NaN compares false: a NaN where the collapse has a value is a difference
        index = int((apart > bound).logical_or(apart.isnan()).flatten().nonzero()[0, 0])
        got, want = float(x.flatten()[index]), float(exact.flatten()[index])
        return f"x {got!r} where the collapse gives {want!r} (within {float(bound.flatten()[index]):.3g})"
    return None

"""SP region analysis: which stretch of a post-grad graph can run on token-row shards, and why not.

Reads the graph, never changes it. ``find_regions`` returns a ``Plan``: the ``Region``s the rewrite
(``emit``) shards, and every cut (a ``NotRowLocal`` naming the node and why). The rules are
those of :mod:`hcpasses.passes.sp_rewrite`'s docstring: every region node row-local, every outside operand
free of tokens (or a full-size term entering the streams), token dims the leading dims of each value.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from hcpasses.patterns.collapse import FoundCollapse
from hcpasses.patterns.tracing import same_sizes, value_of

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
SYM_SIZE = aten.sym_size.int
FUSED_COLLAPSES = (torch.ops.hcpasses.gated_mean_quant.default, torch.ops.hcpasses.weighted_sum_quant.default)

SIZE_OPS = {aten.reshape.default, aten.view.default, aten.expand.default}  # sizes at args[1]
DIM_OPS = {  # op -> (position of its dim argument, default dim)
    aten.unsqueeze.default: (1, None),
    aten.squeeze.dim: (1, None),
    aten.select.int: (1, None),
    aten.slice.Tensor: (1, 0),
    aten.split.Tensor: (2, 0),
    aten.split_with_sizes.default: (2, 0),
    aten.cat.default: (1, 0),
}
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
ELEMENTWISE = {prims.convert_element_type.default, aten.clone.default, aten._to_copy.default}


class NotRowLocal(Exception):
    """A region node that cannot run on a row shard; ``node`` is where the region must not reach."""

    def __init__(self, node: fx.Node, why: str) -> None:
        super().__init__(f"{node.name} ({node.target}): {why}")
        self.node = node


@dataclasses.dataclass
class Region:
    start: fx.Node
    nodes: set[fx.Node]
    reduces: list[tuple[fx.Node, fx.Node]]  # (all_reduce, wait) pairs that become reduce-scatters
    collapses: list[FoundCollapse]
    why_start: str
    entries: list[tuple[fx.Node, fx.Node]]  # (region node, full-size operand from outside) pairs to shard


def same_size(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def descendants(graph: fx.Graph, roots: Iterable[fx.Node]) -> set[fx.Node]:
    reached = set(roots)
    for node in graph.nodes:
        if any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    return reached


def stream_value(collapse: FoundCollapse) -> fx.Node:
    """The residual stream value a collapse reads: the grouped norm's input, or the collapsed streams (behind
    the views and casts the collapse reads them through).

    For a gated mean the streams argument is the norm's output xn; walking back from it, every node
    used only inside the norm belongs to the norm, and the first node with a use outside it (the
    combine, the next layer) is the stream value.
    """
    if not collapse.normed:
        return _through_views(collapse.streams, collapse_tokens(collapse))
    inside = {collapse.streams}
    frontier: list[fx.Node] = []
    stack = list(collapse.streams.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in inside or node in frontier or not _has_rows_like(node, collapse.streams):
            continue
        if all(user in inside for user in node.users):
            inside.add(node)
            stack.extend(node.all_input_nodes)
        else:
            frontier.append(node)
    if len(frontier) != 1:
        names = [n.name for n in frontier]
        raise NotRowLocal(collapse.streams, f"the grouped norm does not read one stream value (found {names})")
    return frontier[0]


def _through_views(streams: fx.Node, tokens: Any) -> fx.Node:
    """The value behind the reshapes, copies and casts a collapse reads its ``tokens`` rows of streams through
    (DeepSeek's reference flattens the stacked streams, upcasts and views them back; a matmul or the fused op
    flattens ``[batch, seq, ...]`` tokens): the model's stream value, which the block's write-back reads too."""
    node = streams
    while node.target in VALUE_VIEWS or _is_noop_expand(node):
        source = node.args[0]
        if not isinstance(source, fx.Node) or token_dims(value_of(source), tokens) is None:
            break
        node = source
    return node


VALUE_VIEWS = {
    aten.reshape.default,
    aten.view.default,
    aten.clone.default,
    aten.unsqueeze.default,
    prims.convert_element_type.default,
}


def _is_noop_expand(node: fx.Node) -> bool:
    """``expand`` to the shape its input has (``torch.matmul`` puts one on each bmm operand)."""
    if node.target is not aten.expand.default:
        return False
    source, out = value_of(node.args[0]), value_of(node)
    return isinstance(source, torch.Tensor) and source.dim() == out.dim() and same_sizes(source.shape, out.shape)


def _has_rows_like(node: fx.Node, reference: fx.Node) -> bool:
    """Whether ``node`` is a tensor with at least the dims of ``reference`` and its leading (token) sizes."""
    val, ref = value_of(node), value_of(reference)
    if not isinstance(val, torch.Tensor) or val.dim() < ref.dim():
        return False
    lead = token_dims(ref, math.prod(ref.shape[:-1]))  # the streams' token dims: all but the last
    return lead is not None and all(same_size(a, b) for a, b in zip(val.shape[:lead], ref.shape[:lead], strict=True))


def token_dims(val: Any, tokens: Any) -> int | None:
    """How many leading dims of ``val`` hold the ``tokens`` rows (their sizes multiply to it), or None."""
    if not isinstance(val, torch.Tensor):
        return None
    count: Any = 1
    for k, size in enumerate(val.shape, start=1):
        count = count * size
        if same_size(count, tokens):
            return k
    return None


def collapse_tokens(collapse: FoundCollapse) -> Any:
    """The token count N of a collapse: its output x is ``[tokens..., S]``."""
    x = first_tensor(value_of(collapse.root))
    return math.prod(x.shape[:-1])


class _RegionBuilder:
    """Checks one candidate region; raises ``NotRowLocal`` naming the first node that breaks it."""

    def __init__(self, graph: fx.Graph, tokens: Any, token_carriers: set[fx.Node]) -> None:
        self.graph = graph
        self.tokens = tokens
        self.token_carriers = token_carriers

    def build(
        self,
        collapses: list[FoundCollapse],
        start: fx.Node,
        reduces: list[tuple[fx.Node, fx.Node]],
        sinks: Iterable[fx.Node] = (),
    ) -> set:
        """The region from ``start`` to the ``collapses`` and to ``sinks`` (the inputs of the node that cuts
        it: the region runs up to that node, which reads them gathered)."""
        self.entries: list[tuple[fx.Node, fx.Node]] = []
        stops = {out for c in collapses for out in c.outputs}
        live = {start, *(wait for _, wait in reduces)}
        skip = {node for pair in reduces for node in pair} | live
        reached: set[fx.Node] = set()
        for node in self.graph.nodes:
            if node in skip or node.op != "call_function" or node.target in (ALL_REDUCE, WAIT, SYM_SIZE):
                continue
            if any((arg in reached or arg in live) and arg not in stops for arg in node.all_input_nodes):
                reached.add(node)
        wanted = ancestors([*(c.root for c in collapses), *sinks]) | stops
        region = {node for node in reached if node in wanted}
        for node in [start, *(wait for _, wait in reduces)]:
            self._check_rows(node)
        for node in sorted(region, key=node_order(self.graph).__getitem__):
            self.check(node, region | live)
        for reduce, _ in reduces:
            self._check_partial_sum(reduce, region)
        return region

    def _check_partial_sum(self, reduce: fx.Node, region: set[fx.Node]) -> None:
        """An all-reduce's input is a TP partial sum: each rank's share of every row. Computed in the region it
        would hold this rank's share of this rank's rows only, which no collective can sum (nor may it be
        gathered: ranks' shares differ). That happens when the sub-layer input comes from a block whose
        collapse was not recognised (so not gathered there): the region must end where the streams branch
        into that block, which then runs on all rows."""
        partial = reduce.args[0]
        if partial not in region:
            return
        feeding = ancestors([partial]) & region
        order = node_order(self.graph)
        branches = [n for n in feeding if any(user in region and user not in feeding for user in n.users)]
        # No branch point: end the region at its first node on the way (it reads only replicated values).
        where = min(branches or feeding, key=order.__getitem__)
        raise NotRowLocal(
            where,
            f"feeds the TP partial sum {partial.name} of {reduce.name} through no recognised HC collapse "
            "(an unrecognised block's sub-layer must read all rows)",
        )

    def dims(self, node: fx.Node) -> int:
        """How many leading dims of ``node``'s value hold the tokens."""
        val = first_tensor(value_of(node))
        k = token_dims(val, self.tokens)
        if k is None:
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else val
            raise NotRowLocal(node, f"{shape} does not lead with the {self.tokens} tokens")
        return k

    def check(self, node: fx.Node, sharded: set[fx.Node]) -> None:
        self._check_rows(node)
        self._check_op(node)
        for position, arg in enumerate(node.args):
            for operand in _tensor_nodes(arg):
                if operand not in sharded:
                    self._check_operand(node, position, operand)

    def _check_rows(self, node: fx.Node) -> None:
        vals = value_of(node)
        for val in vals if isinstance(vals, (list, tuple)) else (vals,):
            if not isinstance(val, torch.Tensor):
                continue
            k = token_dims(val, self.tokens)
            if k is None:
                raise NotRowLocal(node, f"result {tuple(val.shape)} does not lead with the {self.tokens} tokens")
            if k > 1 and not all(isinstance(size, int) for size in val.shape[k:]):
                raise NotRowLocal(node, f"result {tuple(val.shape)} has symbolic sizes after its token dims")

    def _check_op(self, node: fx.Node) -> None:
        target = node.target
        if target in SIZE_OPS:
            self._check_resize(node)
        elif target in DIM_OPS:
            position, default = DIM_OPS[target]
            dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
            source = node.args[0][0] if target is aten.cat.default else node.args[0]
            ndim = value_of(source).dim() + (target is aten.unsqueeze.default)  # unsqueeze's dim indexes its output
            if not isinstance(dim, int) or dim % max(ndim, 1) < self.dims(source):
                raise NotRowLocal(node, f"works along dim {dim}, a token dim")
        elif target is aten.permute.default:
            k = self.dims(node.args[0])
            if [d % len(node.args[1]) for d in node.args[1][:k]] != list(range(k)):
                raise NotRowLocal(node, "moves a token dim")
        elif target in REDUCTIONS:
            ndim = value_of(node.args[0]).dim()
            dims = node.args[1] if len(node.args) > 1 else None
            if not dims or any(d % ndim < self.dims(node.args[0]) for d in dims):
                raise NotRowLocal(node, "reduces over a token dim")
        elif target is aten.mm.default:
            # Row i of x @ W is a function of row i of x alone, whatever W is (an HC weight, or a TP shard of
            # a projection that reads the streams); _check_operand makes sure W carries no tokens.
            if self.dims(node.args[0]) != 1:
                raise NotRowLocal(node, "a GEMM whose left operand does not lead with the tokens")
        elif target is aten.bmm.default:  # batched over tokens (mHC's per-token comb @ streams); operands checked
            if self.dims(node) != 1:
                raise NotRowLocal(node, "a batched GEMM whose batch dim is not the tokens")
        elif not (
            target in ELEMENTWISE
            or target in FUSED_COLLAPSES
            or target is operator.getitem
            or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)
        ):
            raise NotRowLocal(node, "not known to be row-local")

    def _check_resize(self, node: fx.Node) -> None:
        """A reshape may merge or split the token dims (token order is row-major either way); an expand
        must leave them as they are."""
        source = node.args[0]
        self.dims(source)
        if node.target is aten.expand.default:
            k_in, k_out = self.dims(source), self.dims(node)
            pairs = zip(value_of(source).shape[:k_in], value_of(node).shape[:k_out], strict=True)
            same = k_in == k_out and all(same_size(a, b) for a, b in pairs)
            if not same:
                raise NotRowLocal(node, "expands a token dim")

    def _check_operand(self, node: fx.Node, position: int, operand: fx.Node) -> None:
        if self._enters_streams(node, operand):
            self.entries.append((node, operand))
            return
        if operand in self.token_carriers:
            raise NotRowLocal(node, f"reads {operand.name}, which carries tokens but is not in the region")
        val, out = value_of(operand), first_tensor(value_of(node))
        if node.target is aten.mm.default and position == 1:
            return  # the right-hand side of a GEMM: carries no tokens (checked above), used whole by every row
        # Broadcasting aligns dims from the right: the operand's dims under the token dims must be 1.
        offset = out.dim() - val.dim()
        under_tokens = [val.shape[i - offset] for i in range(self.dims(node)) if i >= offset]
        if offset < 0 or not all(same_size(size, 1) for size in under_tokens):
            raise NotRowLocal(node, f"operand {operand.name} {tuple(val.shape)} is not broadcast over the tokens")

    def _enters_streams(self, node: fx.Node, operand: fx.Node) -> bool:
        """Whether ``operand`` is a full-size term added into the streams, e.g. an MTP drafter's projected
        next-token embedding: ``streams = norm(state) + e``. Streams that reach an HC block are replicated
        (DESIGN §3) and so is the region's term, hence so is ``e``: its token rows can be sharded."""
        if node.target not in (aten.add.Tensor, aten.sub.Tensor):
            return False
        val, out = value_of(operand), value_of(node)
        k = token_dims(val, self.tokens)
        return (
            k is not None
            and val.is_floating_point()
            and val.dim() == out.dim()
            and all(same_size(a, b) for a, b in zip(val.shape, out.shape, strict=True))
        )


def _tensor_nodes(arg: Any) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    fx.map_arg(arg, nodes.append)
    return [n for n in nodes if isinstance(value_of(n), torch.Tensor)]


def first_tensor(val: Any) -> torch.Tensor:
    if isinstance(val, (list, tuple)):
        return next(v for v in val if isinstance(v, torch.Tensor))
    return val


@dataclasses.dataclass
class Plan:
    """What the analysis found: the regions to shard in graph order, every cut (a node that ended a region or
    kept one from starting, and why), and the token count N."""

    regions: list[Region]
    cuts: list[NotRowLocal]
    tokens: Any


def find_regions(graph: fx.Graph, collapses: list[FoundCollapse], reduces: list[tuple[fx.Node, fx.Node]]) -> Plan:
    """Every region to shard, block by block; never raises.

    A region starts at an HC block's stream value and takes the later blocks it can: a node that cannot run
    on row shards ends it before that node (the values the node reads are gathered there) and the next HC
    block after the node starts the next region. A block whose stream value cannot be found, or after which
    no all-reduce feeds an HC block, starts none. One unfamiliar piece costs only the blocks it touches.
    """
    order = node_order(graph)
    tokens = collapse_tokens(collapses[0])
    carriers = descendants(
        graph,
        [n for n in graph.nodes if n.op == "placeholder" and _is_integer_tensor(n)] + [a for a, _ in reduces],
    )
    builder = _RegionBuilder(graph, tokens, carriers)
    plan = Plan([], [], tokens)
    first, why_start = 0, "first HC block of the graph"
    while first < len(collapses):
        region, cut = _region_from(builder, order, collapses[first:], reduces, why_start)
        if region is not None:
            plan.regions.append(region)
        if cut is None:
            break
        plan.cuts.append(cut)
        after = [i for i in range(first + 1, len(collapses)) if order[collapses[i].root] > order[cut.node]]
        if not after:
            break
        first, why_start = after[0], f"first HC block after {cut}"
    return plan


def _region_from(
    builder: _RegionBuilder,
    order: dict[fx.Node, int],
    blocks: list[FoundCollapse],
    reduces: list[tuple[fx.Node, fx.Node]],
    why_start: str,
) -> tuple[Region | None, NotRowLocal | None]:
    """The longest region starting at ``blocks[0]``'s stream value, and the cut that ended it (None when it
    takes every block). Each failed attempt drops the blocks from the failing node on and runs the region up
    to that node's inputs instead (the last sub-layer's reduce-scatter and write-back stay in the region)."""
    try:
        start = stream_value(blocks[0])
    except NotRowLocal as err:
        return None, err
    cut: NotRowLocal | None = None
    end, sinks = len(blocks), []
    while end > 0:
        feeding = ancestors([*(c.root for c in blocks[:end]), *sinks])
        used = [(ar, w) for ar, w in reduces if order[ar] > order[start] and w in feeding]
        if not used:
            return None, cut or NotRowLocal(start, "no all-reduce feeds an HC block after this point")
        try:
            nodes = builder.build(blocks[:end], start, used, sinks)
        except NotRowLocal as err:
            # Keep the blocks before the failing node and run the region up to it: each retry fails, if at
            # all, at a node before this one, so the loop ends.
            cut, sinks = err, err.node.all_input_nodes
            end = sum(1 for c in blocks[:end] if order[c.root] < order[err.node])
            continue
        return Region(start, nodes, used, blocks[:end], why_start, builder.entries), cut
    return None, cut


def _is_integer_tensor(node: fx.Node) -> bool:
    val = value_of(node)
    return isinstance(val, torch.Tensor) and not val.is_floating_point()


def all_reduces(graph: fx.Graph) -> tuple[list[tuple[fx.Node, fx.Node]], str | None]:
    world = dist.group.WORLD.group_name
    pairs = []
    for node in graph.nodes:
        if node.target is not ALL_REDUCE:
            continue
        waits = [u for u in node.users if u.target is WAIT]
        if node.args[1] != "sum" or node.args[2] != world or len(waits) != 1 or len(node.users) != 1:
            return [], f"all-reduce {node.name} is not a waited sum over the default group"
        pairs.append((node, waits[0]))
    if not pairs:
        return [], "no all-reduce: not a TP graph"
    return pairs, None

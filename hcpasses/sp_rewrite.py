"""SP rewrite pass: the HC residual streams are sharded by tokens across the TP ranks.

Before (every rank computes the HC work of all T tokens)::

    h[T,nS] -> mix -> x[T,S] -> sub-layer shard -> p[T,S] -> all_reduce -> y[T,S] -> combine(h, y) -> h'[T,nS]

After (rank r works on its R = ceil(T/tp) token rows; rows padded with zeros up to R)::

    hs = shard_rows(h, r, tp)[R,nS] -> mix -> x[R,S] -> all_gather, trim -> x[T,S] -> sub-layer shard
       -> p[T,S] -> pad to R*tp rows -> reduce_scatter -> y[R,S] -> combine(hs, y) -> h'[R,nS] -> next mix ...

All-reduce = reduce-scatter + all-gather, so the bytes on the wire are unchanged while each rank does
1/tp of the HC work. When the fusion pass ran first, the fused op is part of the region and the
gather moves FP8 codes (as uint8) and per-token scales instead of x.

How the region is found:

- HC blocks come from the collapse patterns (``hcpasses.patterns.collapse``): each collapse marks a
  mix; its stream value is the input of the grouped norm (gated mean) or the collapsed streams (mHC).
- The region is every node reachable from the first sharded stream value and from the outputs of the
  all-reduces that feed later HC blocks, without passing through a collapse (the sub-layer starts
  there) or an all-reduce, and that leads to a later collapse. Values the region computes but others
  use (the sub-layer input, the final mixer output, a returned HC state) are gathered.
- Tokens are the leading dims of a value: ``[T, ...]`` (vLLM style) or ``[batch, seq, ...]``
  (transformers); token i is row i of the value flattened over them. N = batch*seq is what is sharded;
  a shard keeps the rank, its token dims become ``[1, ..., 1, R]``, so the model's dim-addressed ops
  still apply. Each value's token dims are the shortest leading dims whose sizes multiply to N.
- Every region node must be row-local (pointwise, reductions over non-token dims, views and permutes
  that keep the token dims in front, ``mm`` with a weight, ``bmm`` batched over tokens, the fused
  collapse ops), and every operand from outside
  the region must carry no tokens: a weight or constant broadcast over rows, or the right-hand side of
  an HC GEMM. Weights in a mix or combine are HC weights, replicated by construction. An ``mm`` is
  accepted only on the way to a collapse gate, so a TP-sharded projection can never land in the region.
- A full-size term added into the streams from outside (an MTP drafter's projected next-token embedding,
  ``streams = norm(state) + e``) is sharded where it joins: streams are replicated, so is the term. So a
  target's HC state flows into its drafter still sharded when both are in one graph.
- The region starts at the first HC block after the last op that is not row-local (e.g. the PLE conv):
  when a region node fails a check, the start moves to the next HC block after it.

Applies when: torch.distributed is initialised with tp > 1, the all-reduces are sum over the default
group, T >= ``sp_min_tokens`` (static T; with symbolic T the graph is correct for every T and the
backend dispatches small T to an unsharded variant), and at least one all-reduce feeds an HC block
after the region start. Otherwise the graph is left untouched and the report says why.
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

import hcpasses.rows  # noqa: F401  (registers torch.ops.hcpasses.shard_rows)
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.collapse import CollapseFinder, FoundCollapse
from hcpasses.verify import refresh_fake_values

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


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
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
    """The residual stream value a collapse reads: the grouped norm's input, or the collapsed streams.

    For a gated mean the streams argument is the norm's output xn; walking back from it, every node
    used only inside the norm belongs to the norm, and the first node with a use outside it (the
    combine, the next layer) is the stream value.
    """
    if not collapse.normed:
        return collapse.streams
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


def _has_rows_like(node: fx.Node, reference: fx.Node) -> bool:
    """Whether ``node`` is a tensor with at least the dims of ``reference`` and its leading (token) sizes."""
    val, ref = _val(node), _val(reference)
    if not isinstance(val, torch.Tensor) or val.dim() < ref.dim():
        return False
    lead = token_dims(ref, math.prod(ref.shape[:-1]))  # the streams' token dims: all but the last
    return lead is not None and all(_same(a, b) for a, b in zip(val.shape[:lead], ref.shape[:lead], strict=True))


def token_dims(val: Any, tokens: Any) -> int | None:
    """How many leading dims of ``val`` hold the ``tokens`` rows (their sizes multiply to it), or None."""
    if not isinstance(val, torch.Tensor):
        return None
    count: Any = 1
    for k, size in enumerate(val.shape, start=1):
        count = count * size
        if _same(count, tokens):
            return k
    return None


def collapse_tokens(collapse: FoundCollapse) -> Any:
    """The token count N of a collapse: its output x is ``[tokens..., S]``."""
    x = _first_tensor(_val(collapse.root))
    return math.prod(x.shape[:-1])


class _RegionBuilder:
    """Checks one candidate region; raises ``NotRowLocal`` naming the first node that breaks it."""

    def __init__(self, graph: fx.Graph, tokens: Any, token_carriers: set[fx.Node]) -> None:
        self.graph = graph
        self.tokens = tokens
        self.token_carriers = token_carriers

    def build(self, collapses: list[FoundCollapse], start: fx.Node, reduces: list[tuple[fx.Node, fx.Node]]) -> set:
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
        wanted = ancestors(c.root for c in collapses) | stops
        region = {node for node in reached if node in wanted}
        gates = _feeders({c.gate for c in collapses}, region)
        for node in [start, *(wait for _, wait in reduces)]:
            self._check_rows(node)
        for node in sorted(region, key=_order(self.graph).__getitem__):
            self.check(node, region | live, gates)
        return region

    def dims(self, node: fx.Node) -> int:
        """How many leading dims of ``node``'s value hold the tokens."""
        val = _first_tensor(_val(node))
        k = token_dims(val, self.tokens)
        if k is None:
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else val
            raise NotRowLocal(node, f"{shape} does not lead with the {self.tokens} tokens")
        return k

    def check(self, node: fx.Node, sharded: set[fx.Node], gates: set[fx.Node]) -> None:
        self._check_rows(node)
        self._check_op(node, gates)
        for position, arg in enumerate(node.args):
            for operand in _tensor_nodes(arg):
                if operand not in sharded:
                    self._check_operand(node, position, operand)

    def _check_rows(self, node: fx.Node) -> None:
        vals = _val(node)
        for val in vals if isinstance(vals, (list, tuple)) else (vals,):
            if not isinstance(val, torch.Tensor):
                continue
            k = token_dims(val, self.tokens)
            if k is None:
                raise NotRowLocal(node, f"result {tuple(val.shape)} does not lead with the {self.tokens} tokens")
            if k > 1 and not all(isinstance(size, int) for size in val.shape[k:]):
                raise NotRowLocal(node, f"result {tuple(val.shape)} has symbolic sizes after its token dims")

    def _check_op(self, node: fx.Node, gates: set[fx.Node]) -> None:
        target = node.target
        if target in SIZE_OPS:
            self._check_resize(node)
        elif target in DIM_OPS:
            position, default = DIM_OPS[target]
            dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
            source = node.args[0][0] if target is aten.cat.default else node.args[0]
            ndim = _val(source).dim() + (target is aten.unsqueeze.default)  # unsqueeze's dim indexes its output
            if not isinstance(dim, int) or dim % max(ndim, 1) < self.dims(source):
                raise NotRowLocal(node, f"works along dim {dim}, a token dim")
        elif target is aten.permute.default:
            k = self.dims(node.args[0])
            if [d % len(node.args[1]) for d in node.args[1][:k]] != list(range(k)):
                raise NotRowLocal(node, "moves a token dim")
        elif target in REDUCTIONS:
            ndim = _val(node.args[0]).dim()
            dims = node.args[1] if len(node.args) > 1 else None
            if not dims or any(d % ndim < self.dims(node.args[0]) for d in dims):
                raise NotRowLocal(node, "reduces over a token dim")
        elif target is aten.mm.default:
            if node not in gates:
                raise NotRowLocal(node, "a GEMM that does not feed an HC collapse gate (its weight may be sharded)")
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
            same = k_in == k_out and all(
                _same(a, b) for a, b in zip(_val(source).shape[:k_in], _val(node).shape[:k_out], strict=True)
            )
            if not same:
                raise NotRowLocal(node, "expands a token dim")

    def _check_operand(self, node: fx.Node, position: int, operand: fx.Node) -> None:
        if self._enters_streams(node, operand):
            self.entries.append((node, operand))
            return
        if operand in self.token_carriers:
            raise NotRowLocal(node, f"reads {operand.name}, which carries tokens but is not in the region")
        val, out = _val(operand), _first_tensor(_val(node))
        if node.target is aten.mm.default and position == 1:
            return  # the weight of an HC GEMM (mm is only accepted on the way to a collapse gate)
        # Broadcasting aligns dims from the right: the operand's dims under the token dims must be 1.
        offset = out.dim() - val.dim()
        under_tokens = [val.shape[i - offset] for i in range(self.dims(node)) if i >= offset]
        if offset < 0 or not all(_same(size, 1) for size in under_tokens):
            raise NotRowLocal(node, f"operand {operand.name} {tuple(val.shape)} is not broadcast over the tokens")

    def _enters_streams(self, node: fx.Node, operand: fx.Node) -> bool:
        """Whether ``operand`` is a full-size term added into the streams, e.g. an MTP drafter's projected
        next-token embedding: ``streams = norm(state) + e``. Streams that reach an HC block are replicated
        (DESIGN §3) and so is the region's term, hence so is ``e``: its token rows can be sharded."""
        if node.target not in (aten.add.Tensor, aten.sub.Tensor):
            return False
        val, out = _val(operand), _val(node)
        k = token_dims(val, self.tokens)
        return (
            k is not None
            and val.is_floating_point()
            and val.dim() == out.dim()
            and all(_same(a, b) for a, b in zip(val.shape, out.shape, strict=True))
        )


def _feeders(gates: set[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
    """Region nodes from which a collapse gate is reached along region nodes only (the mix's GEMMs)."""
    seen: set[fx.Node] = set()
    stack = [g for g in gates if g in region]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(arg for arg in node.all_input_nodes if arg in region)
    return seen


def _tensor_nodes(arg: Any) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    fx.map_arg(arg, nodes.append)
    return [n for n in nodes if isinstance(_val(n), torch.Tensor)]


def _first_tensor(val: Any) -> torch.Tensor:
    if isinstance(val, (list, tuple)):
        return next(v for v in val if isinstance(v, torch.Tensor))
    return val


class SPRewrite(GraphPass):
    """Shards the HC streams by tokens: all-reduce -> reduce-scatter + all-gather around HC blocks."""

    name = "sp_rewrite"

    def __init__(self) -> None:
        self._finder = CollapseFinder()

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return PassResult(0, "not distributed (tp = 1): nothing to shard")
        rank, tp = dist.get_rank(), dist.get_world_size()
        collapses = self._finder.find(graph)
        if not collapses:
            return PassResult(0, "no HC block (stream collapse) in this graph")
        reduces, why_not = _all_reduces(graph)
        notes = [f"HC blocks (collapses) found: {len(collapses)}", f"all-reduces: {len(reduces)}"]
        if why_not:
            return PassResult(0, why_not, tuple(notes))
        try:
            region, tokens = self._find_region(graph, collapses, reduces)
        except NotRowLocal as err:
            return PassResult(0, f"no shardable region: {err}", tuple(notes))
        if isinstance(tokens, int) and tokens < config.sp_min_tokens:
            return PassResult(0, f"T={tokens} < sp_min_tokens={config.sp_min_tokens}", tuple(notes))
        rewriter = _Rewriter(graph, region, tokens, rank, tp)
        gathered = rewriter.apply()
        streams = [name for name in gathered if name in rewriter.stream_wide]
        notes += [
            f"region starts at {region.start.name}: {region.why_start}",
            f"HC blocks sharded: {len(region.collapses)}; region nodes: {len(region.nodes)}",
            f"collectives: {len(region.reduces)} all-reduce -> reduce-scatter; {len(gathered)} all-gathers added",
            f"region exits gathered: {', '.join(gathered)}",
            f"stream-wide values gathered (n*S wide, e.g. a returned HC state): {', '.join(streams) or 'none'}",
            f"streams continue into another HC stack without a gather (e.g. an MTP drafter): "
            f"{'yes' if region.entries else 'no'} ({len(region.entries)} full-size term(s) sharded where they join)",
            f"rows per rank: ceil({tokens}/{tp})",
        ]
        facts: dict[str, Any] = {"streams_gathered": len(streams), "entries_sharded": len(region.entries)}
        if not isinstance(tokens, int):
            facts["symbolic_tokens"] = str(tokens)
        return PassResult(len(region.collapses), None, tuple(notes), facts)

    def _find_region(
        self, graph: fx.Graph, collapses: list[FoundCollapse], reduces: list[tuple[fx.Node, fx.Node]]
    ) -> tuple[Region, Any]:
        order = _order(graph)
        sources = [stream_value(c) for c in collapses]
        tokens = collapse_tokens(collapses[0])
        carriers = descendants(
            graph,
            [n for n in graph.nodes if n.op == "placeholder" and _is_integer_tensor(n)] + [a for a, _ in reduces],
        )
        builder = _RegionBuilder(graph, tokens, carriers)
        first, why_start = 0, "first HC block of the graph"
        while first < len(collapses):
            start = sources[first]
            later = collapses[first:]
            feeding = ancestors(c.root for c in later)
            used = [(ar, w) for ar, w in reduces if order[ar] > order[start] and w in feeding]
            if not used:
                raise NotRowLocal(start, "no all-reduce feeds an HC block after this point")
            try:
                nodes = builder.build(later, start, used)
                return Region(start, nodes, used, later, why_start, builder.entries), tokens
            except NotRowLocal as err:
                after = [i for i in range(first + 1, len(collapses)) if order[sources[i]] > order[err.node]]
                if not after:
                    raise
                first, why_start = after[0], f"first HC block after {err}"
        raise AssertionError("unreachable: the loop returns or raises")


def _is_integer_tensor(node: fx.Node) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and not val.is_floating_point()


def _all_reduces(graph: fx.Graph) -> tuple[list[tuple[fx.Node, fx.Node]], str | None]:
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


class _Rewriter:
    """Rewrites one region in place (the analysis has already accepted every node in it)."""

    def __init__(self, graph: fx.Graph, region: Region, tokens: Any, rank: int, tp: int) -> None:
        self.graph, self.region, self.rank, self.tp = graph, region, rank, tp
        self.group = region.reduces[0][0].args[2]
        self.token_count = tokens  # N as an int or a SymInt expression
        # Token dims of every value the rewrite touches, read off the unsharded shapes before any change
        # (the analysis has checked that each has them).
        touched = [
            region.start,
            *region.nodes,
            *(ar.args[0] for ar, _ in region.reduces),
            *(e for _, e in region.entries),
        ]
        self.dims: dict[fx.Node, int] = {node: token_dims(_first_tensor(_val(node)), tokens) for node in touched}
        self.stream_wide: set[str] = set()  # names of gathered values as wide as the streams
        # The token sizes, N and R are computed right after the start, where every later use can read them.
        with graph.inserting_before(region.start.next):
            self.start_sizes = self._start_sizes()
            self.tokens, self.rows = self._token_sizes(tokens)

    def _start_sizes(self) -> list[Any]:
        """The sizes of the start's token dims: ints, or ``sym_size`` nodes of the (unsharded) start."""
        start = self.region.start
        return [
            size if isinstance(size, int) else self.graph.call_function(SYM_SIZE, (start, dim))
            for dim, size in enumerate(_val(start).shape[: self.dims[start]])
        ]

    def _token_sizes(self, tokens: Any) -> tuple[Any, Any]:
        """N and R = ceil(N/tp) as ints, or as graph nodes computing them when N is symbolic."""
        if isinstance(tokens, int):
            return tokens, -(-tokens // self.tp)
        count, *others = self.start_sizes
        for size in others:
            count = self.graph.call_function(operator.mul, (count, size))
        plus = self.graph.call_function(operator.add, (count, self.tp - 1))
        return count, self.graph.call_function(operator.floordiv, (plus, self.tp))

    def _size_of(self, expr: Any) -> Any:
        """A token-dim size of some value, as an int or a node: one of the start's token sizes, or N."""
        if isinstance(expr, int):
            return expr
        candidates = [
            *zip(_val(self.region.start).shape, self.start_sizes, strict=False),
            (self.token_count, self.tokens),
        ]
        for size, node in candidates:
            if _same(expr, size):
                return node
        raise NotRowLocal(self.region.start, f"token size {expr} is neither N nor one of the start's sizes")

    def _shard_sizes(self, node: fx.Node, sizes: list[Any]) -> list[Any]:
        """``sizes`` of a value with the token dims of ``node`` replaced by ``[1, ..., 1, R]``."""
        k = self.dims[node]
        return [*([1] * (k - 1)), self.rows, *sizes[k:]]

    def apply(self) -> list[str]:
        region = self.region
        self._keep_token_sizes()
        anchor = self.rows if isinstance(self.rows, fx.Node) else region.start
        with self.graph.inserting_after(anchor):
            self._use_in_region(region.start, self._shard(region.start))
        for node, operand in region.entries:
            with self.graph.inserting_before(node):
                node.replace_input_with(operand, self._shard(operand))
        for all_reduce, wait in region.reduces:
            self._reduce_scatter(all_reduce, wait)
        for node in region.nodes:
            if node.target in SIZE_OPS:
                node.args = (node.args[0], self._shard_sizes(node, list(node.args[1])), *node.args[2:])
        gathered = []
        for node in sorted(region.nodes, key=_order(self.graph).__getitem__):
            outside = [u for u in node.users if u not in region.nodes]
            if outside and isinstance(_val(node), torch.Tensor):
                full = self._gather(node)
                for user in outside:
                    user.replace_input_with(node, full)
                gathered.append(node.name)
                if self._stream_wide(node):
                    self.stream_wide.add(node.name)
        self.graph.eliminate_dead_code()
        refresh_fake_values(self.graph)
        return gathered

    def _stream_wide(self, node: fx.Node) -> bool:
        """Whether a value is as wide per token as the streams (n*S): the streams themselves or a state."""
        start = _val(self.region.start)
        return _same(
            math.prod(_val(node).shape[self.dims[node] :]), math.prod(start.shape[self.dims[self.region.start] :])
        )

    def _keep_token_sizes(self) -> None:
        """``sym_size(v, d)`` of a token dim d of a region value v: read it off the unsharded start instead."""
        for node in list(self.graph.nodes):
            if node.target is SYM_SIZE and node.args[0] in self.region.nodes:
                source, dim = node.args
                if dim < self.dims[source]:
                    size = self._size_of(_val(source).shape[dim])
                    for user in list(node.users):
                        user.args = fx.map_arg(user.args, lambda arg, old=node, new=size: new if arg is old else arg)
                    self.graph.erase_node(node)

    def _shard(self, value: fx.Node) -> fx.Node:
        """This rank's token rows of a full-size (replicated) value."""
        return self.graph.call_function(
            torch.ops.hcpasses.shard_rows.default, (value, self.rank, self.tp, self.dims[value])
        )

    def _use_in_region(self, old: fx.Node, new: fx.Node) -> None:
        """Region nodes read ``new`` where they read ``old``; everything else keeps ``old``."""
        for user in list(old.users):
            if user in self.region.nodes:
                user.replace_input_with(old, new)

    def _reduce_scatter(self, all_reduce: fx.Node, wait: fx.Node) -> None:
        partial = all_reduce.args[0]
        shape = list(_val(partial).shape)
        with self.graph.inserting_before(all_reduce):
            flat = self._flatten_tokens(partial, self.dims[partial])
            padded = self._pad_rows(flat, len(shape) - self.dims[partial] + 1)
            scattered = self.graph.call_function(
                c10d.reduce_scatter_tensor.default, (padded, "sum", self.tp, self.group)
            )
            new_wait = self.graph.call_function(WAIT, (scattered,))
            local = new_wait
            if self.dims[partial] > 1:
                local = self.graph.call_function(aten.reshape.default, (new_wait, self._shard_sizes(partial, shape)))
        self.dims[local] = self.dims[partial]
        self.region.nodes.add(local)  # its users outside the region get a gather like any region value
        wait.replace_all_uses_with(local)
        self.graph.erase_node(wait)  # collectives are impure: dead-code elimination keeps them
        self.graph.erase_node(all_reduce)

    def _flatten_tokens(self, node: fx.Node, k: int) -> fx.Node:
        """``node`` reshaped to ``[tokens, rest...]`` (a no-op when it has one token dim)."""
        if k == 1:
            return node
        rest = list(_val(node).shape[k:])  # ints: _check_rows rejects symbolic sizes after the token dims
        return self.graph.call_function(aten.reshape.default, (node, [-1, *rest]))

    def _pad_rows(self, flat: fx.Node, ndim: int) -> fx.Node:
        """``flat [N, ...]`` (``ndim`` dims) padded with zero rows to ``[R*tp, ...]``."""
        if isinstance(self.tokens, int) and self.tokens % self.tp == 0:
            return flat
        if isinstance(self.tokens, int):
            missing: Any = self.rows * self.tp - self.tokens
        else:
            total = self.graph.call_function(operator.mul, (self.rows, self.tp))
            missing = self.graph.call_function(operator.sub, (total, self.tokens))
        pad = [0, 0] * (ndim - 1) + [0, missing]
        return self.graph.call_function(aten.constant_pad_nd.default, (flat, pad, 0.0))

    def _gather(self, node: fx.Node) -> fx.Node:
        """All token rows of a region value: all_gather (FP8 as uint8 bytes), trim the pad rows, restore
        the token dims."""
        val, k = _val(node), self.dims[node]
        as_bytes = val.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        with self.graph.inserting_before(node.next):  # keeps the new nodes in order, right after node
            source = self.graph.call_function(aten.view.dtype, (node, torch.uint8)) if as_bytes else node
            flat = self._flatten_tokens(source, k)
            gathered = self.graph.call_function(c10d.all_gather_into_tensor.default, (flat, self.tp, self.group))
            waited = self.graph.call_function(WAIT, (gathered,))
            full = self.graph.call_function(aten.slice.Tensor, (waited, 0, 0, self.tokens))
            if k > 1:
                sizes = [self._size_of(size) for size in val.shape[:k]] + list(val.shape[k:])
                full = self.graph.call_function(aten.reshape.default, (full, sizes))
            return self.graph.call_function(aten.view.dtype, (full, val.dtype)) if as_bytes else full

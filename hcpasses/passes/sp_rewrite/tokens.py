"""Tokens in values: which dims of a value hold the N token rows (its ``Layout``), and the stream value of an HC block.

Values that enter or leave a region lead with their tokens: ``[T, ...]`` (vLLM style) or ``[batch, seq, ...]``
(transformers); token i is row i of the value flattened over them, and the token dims are the shortest leading dims
whose sizes multiply to N (``leading_layout``). Inside a region a value may hold them elsewhere, as a collapse
written with einsum or stack does (``Layout``): the layout follows each op from its operands' (``rules``), never
from the shape alone, which cannot tell ``[n*T, S]`` (stacked streams) from ``[T*n, S]`` (tokens merged with
streams). Sizes may be ints or SymInts; comparisons never add guards (``statically_known_true``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.functions import FloorDiv

from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.collapse import FoundCollapse
from hcpasses.patterns.tracing import same_sizes, value_of

aten = torch.ops.aten
prims = torch.ops.prims


@dataclasses.dataclass(frozen=True)
class SizeOf:
    """A symbolic token size as the emission spells it: dim ``dim`` of the region's (unsharded) start, or N itself
    when ``dim`` is None. Static sizes are plain ints."""

    dim: int | None = None


Size = int | SizeOf


def same_size(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a value holds its N tokens: dims ``[first, end)`` flattened row-major are ``(outer, N, inner)``.

    ``[T, S]``: ``Layout(0, 1)``; ``[batch, seq, S]``: ``Layout(0, 2)``; ``[n, T, S]`` (streams stacked in
    front): ``Layout(1, 2)``; ``[n*T, S]`` (a ``cat`` of per-stream ``[T, S]`` values): ``Layout(0, 1, outer=n)``;
    ``[T*S, 1, n]`` (a per-token bmm's batch, an einsum): ``Layout(0, 1, inner=S)``. ``outer`` and ``inner`` are
    static. A shard holds the same with R tokens: its dims ``[first, end)`` are ``[1, ..., 1, outer*R*inner]``
    (``sharded_sizes``), every other dim unchanged. ``halo`` rows come before the tokens in their one dim where a
    causal token window (a depthwise conv) reads them: ``[1, C, halo + T]`` after its front zero pad,
    ``Layout(2, 3, halo=9)``; on a shard they are the rows of the ranks before (``rules``, ``emit``).
    """

    first: int
    end: int
    outer: int = 1
    inner: int = 1
    halo: int = 0

    def leading_dims(self, shape: Sequence[Any]) -> int | None:
        """How many leading dims hold exactly the tokens (``[1, ..., tokens..., rest]``), or None: the layout the
        values a region shards, reduce-scatters or gathers must have."""
        plain = self.outer == self.inner == 1 and not self.halo and all(same_size(s, 1) for s in shape[: self.first])
        return self.end if plain else None

    def shifted(self, by: int) -> Layout:
        return dataclasses.replace(self, first=self.first + by, end=self.end + by)

    def holds(self, dim: int) -> bool:
        return self.first <= dim < self.end

    def matches(self, shape: Sequence[Any], tokens: Any) -> bool:
        """Whether a value of ``shape`` can hold its tokens so: its dims ``[first, end)`` multiply to outer*N*inner."""
        return 0 <= self.first < self.end <= len(shape) and same_size(
            math.prod(shape[self.first : self.end]), self.outer * (tokens + self.halo) * self.inner
        )

    def sharded_sizes(self, sizes: Sequence[Any], rows: Any) -> list[Any]:
        """``sizes`` (a shape, or an op's size argument) with its token dims as a shard's: ``[1, ..., 1, O*R*I]``."""
        group = [*([1] * (self.end - self.first - 1)), _scaled(rows, self.outer * self.inner)]
        return [*sizes[: self.first], *group, *sizes[self.end :]]


def _scaled(rows: Any, factor: int) -> Any:
    return rows if factor == 1 else rows * factor


def leading_layout(val: Any, tokens: Any) -> Layout | None:
    """The layout of a value that leads with its ``tokens`` rows (``token_dims``), or None."""
    k = token_dims(val, tokens)
    return None if k is None else normalized(Layout(0, k), val.shape)


def normalized(layout: Layout, shape: Sequence[Any]) -> Layout:
    """The same layout without size-1 dims at either end of its token dims (``[1, T, S]`` holds them in dim 1
    alone), so that two values holding their tokens alike have equal layouts."""
    first, end = layout.first, layout.end
    while end - first > 1 and same_size(shape[first], 1):
        first += 1
    while end - first > 1 and same_size(shape[end - 1], 1):
        end -= 1
    return dataclasses.replace(layout, first=first, end=end)


def reshaped_layout(layout: Layout, source: Sequence[Any], out: Sequence[Any], tokens: Any) -> Layout | None:
    """The layout after reshaping a ``source``-shaped value of ``layout`` to ``out``, or None where the reshape
    splits the token rows.

    Row-major, the source is ``(A*outer, N, inner*B)`` (A: its dims before the tokens, B: those after). The
    output's dims before its tokens are its shortest prefix whose product is A*outer (else the longest whose
    product divides it: the rest of it is the new outer factor); its token dims end at the shortest prefix whose
    product is a multiple of A*outer*N (the excess is the new inner factor). Both factors must be static.
    """
    before = math.prod(source[: layout.first]) * layout.outer
    if not isinstance(before, int):
        return None
    prefixes = [math.prod(out[:i]) for i in range(len(out) + 1)]
    exact = [i for i, size in enumerate(prefixes) if same_size(size, before)]
    dividing = [i for i, size in enumerate(prefixes) if isinstance(size, int) and before % size == 0]
    first = exact[0] if exact else max(dividing)
    outer = 1 if exact else before // prefixes[first]
    for end in range(first + 1, len(out) + 1):
        inner = _static_quotient(prefixes[end], before * tokens)
        if inner is not None:
            return normalized(Layout(first, end, outer, inner), out)
    return None


def _static_quotient(size: Any, divisor: Any) -> int | None:
    """``size / divisor`` when it is provably a static int, else None."""
    if isinstance(size, int) and isinstance(divisor, int):
        return size // divisor if size % divisor == 0 else None
    quotient = _expr(size) / _expr(divisor)  # sympy cancels common factors: (32*s0) / s0 is 32
    if quotient.is_Integer:
        return int(quotient) if quotient > 0 else None
    # A reshape to (seqs, T // seqs) makes rows s1*(s0//s1) that sympy cannot cancel with s0. Read floor
    # divisions as exact ones to find a candidate, then let the shape env prove it from what Dynamo guarded
    # (Eq(s0, s1*(s0//s1)) when it traced the reshape): a wrong candidate is refused, and no guard is added.
    # FloorDiv is torch's internal sympy class for //, the same in 2.11 and 2.13; tests/test_sp_layouts.py pins it.
    candidate = quotient.replace(lambda e: isinstance(e, FloorDiv), lambda e: e.args[0] / e.args[1])
    if candidate.is_Integer and candidate > 0 and same_size(size, int(candidate) * divisor):
        return int(candidate)
    return None


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def first_tensor(val: Any) -> Any:
    """The value, or the first tensor of a tuple of values (a multi-output op's)."""
    if isinstance(val, (list, tuple)):
        return next(v for v in val if isinstance(v, torch.Tensor))
    return val


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


def resolve_size(size: Any, start_sizes: Sequence[Any], tokens: Any) -> Size | None:
    """``size`` (a token-dim size of some region value) as an int, one of the region start's token sizes
    ``start_sizes``, or N; None when it is none of them."""
    if isinstance(size, int):
        return size
    for dim, start_size in enumerate(start_sizes):
        if same_size(size, start_size):
            return SizeOf(dim)
    return SizeOf() if same_size(size, tokens) else None


def stream_value(collapse: FoundCollapse) -> fx.Node | NotShardable:
    """The residual stream value a collapse reads: the grouped norm's input, or the collapsed streams (behind
    the views and casts the collapse reads them through).

    For a gated mean the streams argument is the norm's output xn; walking back from it, every node
    used only inside the norm belongs to the norm, and the first node with a use outside it (the
    combine, the next layer) is the stream value. Where the norm is its stream value's only reader (the final
    mixer's norm reads the last write-back ``h + y``, used nowhere else), the walk passes it and finds several
    such nodes (h, and what y is made of): the stream value is then where every path from them to xn joins.
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
    if len(frontier) == 1:
        return frontier[0]
    join = _join(collapse.streams, inside, frontier)
    if join is None:
        names = [n.name for n in frontier]
        return NotShardable(f"the grouped norm does not read one stream value (found {names})", collapse.streams)
    return join


def _join(xn: fx.Node, inside: set[fx.Node], frontier: list[fx.Node]) -> fx.Node | None:
    """The first node (in graph order) of ``inside`` that is as large as ``xn`` and on every path from the
    ``frontier`` to ``xn``, or None (``xn`` itself does not count)."""
    size = value_of(xn).numel()
    order = {node: i for i, node in enumerate(xn.graph.nodes)}
    candidates = [
        node
        for node in inside
        if node is not xn
        and _numel(node) is not None
        and same_size(_numel(node), size)
        and _on_every_path(node, frontier, inside, xn)
    ]
    return min(candidates, key=order.__getitem__, default=None)


def _numel(node: fx.Node) -> Any:
    val = value_of(node)
    return val.numel() if isinstance(val, torch.Tensor) else None


def _on_every_path(node: fx.Node, frontier: list[fx.Node], inside: set[fx.Node], xn: fx.Node) -> bool:
    """Whether every path from ``frontier`` through ``inside`` to ``xn`` passes ``node``."""
    seen = {node}
    stack = [user for source in frontier for user in source.users if user in inside]
    while stack:
        current = stack.pop()
        if current is xn:
            return False
        if current not in seen:
            seen.add(current)
            stack.extend(user for user in current.users if user in inside)
    return True


VALUE_VIEWS = {
    aten.reshape.default,
    aten.view.default,
    aten.clone.default,
    aten.unsqueeze.default,
    prims.convert_element_type.default,
}


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

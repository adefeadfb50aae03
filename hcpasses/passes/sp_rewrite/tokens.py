"""Tokens in values: which leading dims of a value hold the N token rows, and the stream value of an HC block.

Tokens are the leading dims of a value: ``[T, ...]`` (vLLM style) or ``[batch, seq, ...]`` (transformers); token i
is row i of the value flattened over them. Each value's token dims are the shortest leading dims whose sizes
multiply to N. Sizes may be ints or SymInts; comparisons never add guards (``statically_known_true``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

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
        return NotShardable(f"the grouped norm does not read one stream value (found {names})", collapse.streams)
    return frontier[0]


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

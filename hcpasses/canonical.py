"""Canonical forms pass: spellings of the per-token quant and of the stream collapse that compute the same
values become the one form the fusion's and SP's patterns are written in.

Before (spellings seen in public code)::

    values, _ = aten.max.dim(abs(xf), -1, True)          # torch.max(xf.abs(), dim=-1, keepdim=True).values
    a = convert(amax(abs(x), [-1], True), f32)           # x.abs().amax(-1, keepdim=True).float(), x bf16/fp16
    m = mul(sum(g, [d]), 0.25)                           # g.sum(d) * (1 / n), g's dim d of size n = 4
    s = sigmoid(reshape(u, [T, n, S]))                   # u.unflatten(-1, (n, S)).sigmoid(), u [T, n*S]
    y = convert(x, f32)                                  # x already fp32 (left by torch 2.11's pointless_convert)

After::

    values = aten.amax(abs(xf), [-1], True)
    a = amax(abs(xf), [-1], True)       xf = convert(x, f32): the quant's own upcast of x when it has one
    m = div(sum(g, [d]), 4)
    s = reshape(sigmoid(u), [T, n, S])
    y = x

All are exact: ``max.dim``'s values are ``amax``'s; upcasting bf16 / fp16 to fp32 is exact and keeps order, so
the max of the upcast values is the upcast of the max; for n a power of two, ``1 / n`` is exact and both
products are the same real number, rounded once; an elementwise op commutes with a reshape. Forms that would
change numerics are left alone (their quant then does not fuse and the fusion's report names the path to it):
a multiply by the reciprocal scale instead of a division, an amax clamped before the division, another FP8
max, ``* (1 / n)`` for an n that is not a power of two.

Applies to every graph (each rewrite is local); reports each rewrite with its node. Hand-written on plain FX
rather than with Inductor's pattern matcher: each is a one-node rewrite with a dtype precondition.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.tracing import split_streams

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def max_values_to_amax(graph: fx.Graph, node: fx.Node) -> str | None:
    """``max.dim(t, d, keepdim)`` whose indices nothing reads -> ``amax(t, [d], keepdim)``."""
    if node.target is not aten.max.dim or not all(user.target is operator.getitem for user in node.users):
        return None
    if any(user.args[1] != 0 for user in node.users) or len(node.users) != 1:
        return None
    source, dim, *rest = node.args
    keepdim = rest[0] if rest else node.kwargs.get("keepdim", False)
    [values] = node.users
    with graph.inserting_before(node):
        amax = graph.call_function(aten.amax.default, (source, [dim], keepdim))
    amax.meta["val"] = _val(values)
    values.replace_all_uses_with(amax)
    graph.erase_node(values)
    graph.erase_node(node)
    return f"max.dim -> amax: {amax.name}"


def upcast_before_amax(graph: fx.Graph, node: fx.Node) -> str | None:
    """``convert(amax(abs(x)), f32)`` with x bf16 / fp16 -> ``amax(abs(convert(x, f32)))``."""
    if node.target is not CONVERT or node.args[1] != torch.float32:
        return None
    amax = node.args[0]
    if not isinstance(amax, fx.Node) or amax.target is not aten.amax.default or len(amax.users) != 1:
        return None
    absolute = amax.args[0]
    if not isinstance(absolute, fx.Node) or absolute.target is not aten.abs.default or len(absolute.users) != 1:
        return None
    x = absolute.args[0]
    if not isinstance(_val(x), torch.Tensor) or _val(x).dtype not in LOW_PRECISION:
        return None
    upcast = next((u for u in x.users if u.target is CONVERT and u.args[1] == torch.float32 and not u.kwargs), None)
    with graph.inserting_before(node):
        if upcast is None:
            upcast = graph.call_function(CONVERT, (x, torch.float32))
            upcast.meta["val"] = _val(x).float()
        new_abs = graph.call_function(aten.abs.default, (upcast,))
        new_abs.meta["val"] = _val(upcast).abs()
        new_amax = graph.call_function(aten.amax.default, (new_abs, *amax.args[1:]), dict(amax.kwargs))
    new_amax.meta["val"] = _val(node)
    _move_before(graph, upcast, new_abs)
    node.replace_all_uses_with(new_amax)
    for dead in (node, amax, absolute):
        graph.erase_node(dead)
    return f"amax in {_val(x).dtype} then float32 -> amax of the float32 upcast: {new_amax.name}"


def _move_before(graph: fx.Graph, node: fx.Node, user: fx.Node) -> None:
    """Place ``node`` before ``user`` when the graph has it later (an existing upcast defined further down;
    its one input, x, comes before the amax it replaces)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[node] > order[user]:
        user.prepend(node)


def reciprocal_to_division(graph: fx.Graph, node: fx.Node) -> str | None:
    """``mul(sum(g, [d]), 1/n)`` with n = g's size along d a power of two -> ``div(sum(g, [d]), n)``."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    total, factor = node.args
    if not isinstance(total, fx.Node) or total.target is not aten.sum.dim_IntList or not isinstance(factor, float):
        return None
    dims, source = total.args[1], _val(total.args[0])
    if not isinstance(source, torch.Tensor) or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    n = source.shape[dims[0]]
    if not isinstance(n, int) or n < 1 or n & (n - 1) or factor != 1.0 / n:
        return None
    with graph.inserting_before(node):
        division = graph.call_function(aten.div.Tensor, (total, n))
    division.meta["val"] = _val(node)
    node.replace_all_uses_with(division)
    graph.erase_node(node)
    return f"sum * (1/{n}) -> sum / {n}: {division.name}"


def sigmoid_before_stream_split(graph: fx.Graph, node: fx.Node) -> str | None:
    """``sigmoid(reshape(u, [..., n, S]))`` of a ``[..., n*S]`` u -> ``reshape(sigmoid(u), [..., n, S])``."""
    if node.target is not aten.sigmoid.default:
        return None
    split = node.args[0]
    if not isinstance(split, fx.Node) or split.target is not aten.reshape.default:
        return None
    # n >= 2: a [1, S] -> [1, 1, S] reshape (one token, a batch dim added) also "splits" S into 1 x S
    streams = split_streams(split)
    if streams is None or streams[0] < 2:
        return None
    source = split.args[0]
    with graph.inserting_before(node):
        gate = graph.call_function(aten.sigmoid.default, (source,))
        gate.meta["val"] = _val(source).sigmoid()
        reshaped = graph.call_function(aten.reshape.default, (gate, split.args[1]))
    reshaped.meta["val"] = _val(node)
    node.replace_all_uses_with(reshaped)
    graph.erase_node(node)
    if not split.users:
        graph.erase_node(split)
    return f"sigmoid after the stream split -> before it: {gate.name}"


def drop_noop_convert(graph: fx.Graph, node: fx.Node) -> str | None:
    """``convert(t, dtype)`` of a t that has that dtype -> ``t``.

    torch 2.11's ``pointless_convert`` (a joint-graph pass) folds ``convert(convert(x, bf16), f32)`` of an fp32
    x into ``convert(x, f32)``, dropping the user's bf16 rounding of the collapse output; what is left between
    the collapse and its quant is this no-op (torch 2.13 keeps the rounding and leaves no such node).
    """
    if node.target is not CONVERT or len(node.args) != 2 or node.kwargs:
        return None
    source = node.args[0]
    if not isinstance(_val(source), torch.Tensor) or _val(source).dtype != node.args[1]:
        return None
    node.replace_all_uses_with(source)
    graph.erase_node(node)
    return f"convert to the dtype it has -> dropped: {node.name}"


REWRITES = (
    max_values_to_amax,
    upcast_before_amax,
    reciprocal_to_division,
    sigmoid_before_stream_split,
    drop_noop_convert,
)


class CanonicalForms(GraphPass):
    """Rewrites equivalent quant and collapse spellings into the patterns' canonical form (exact rewrites only)."""

    name = "canonical_forms"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        notes = []
        while note := self._rewrite_one(graph):  # a rewrite erases nodes: scan again (graphs are small)
            notes.append(note)
        if not notes:
            return PassResult(
                0,
                "no equivalent spelling to rewrite (max.dim values, amax before the upcast, sum * (1/2^k), "
                "sigmoid after the stream split, no-op convert)",
            )
        return PassResult(len(notes), None, tuple(notes))

    @staticmethod
    def _rewrite_one(graph: fx.Graph) -> str | None:
        for node in graph.nodes:
            for rewrite in REWRITES:
                note = rewrite(graph, node)
                if note:
                    return note
        return None

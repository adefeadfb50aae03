"""Canonical forms pass: spellings of the per-token quant and of the stream collapse that compute the same
values become the one form the fusion's and SP's patterns are written in.

Before (spellings seen in public code)::

    values, _ = aten.max.dim(abs(xf), -1, True)          # torch.max(xf.abs(), dim=-1, keepdim=True).values
    a = convert(amax(abs(x), [-1], True), f32)           # x.abs().amax(-1, keepdim=True).float(), x bf16/fp16
    m = mul(sum(g, [d]), 0.25)                           # g.sum(d) * (1 / n), g's dim d of size n = 4
    s = sigmoid(reshape(u, [T, n, S]))                   # u.unflatten(-1, (n, S)).sigmoid(), u [T, n*S]
    y = convert(x, f32)                                  # x already fp32 (left by torch 2.11's pointless_convert)
    g = mul(unsqueeze(w, 2), h)                          # w[..., None] * h, w [b, s, n], feeding a sum
    g = mul(w, reshape(convert(h, f32), [.., n, S]))     # h bf16 / fp16 upcast before a promoting mul into a sum
    x = reshape(bmm(reshape(w, [B, 1, n]), reshape(h, [B, n, S])), [b, s, S])   # matmul / einsum collapse

After::

    values = aten.amax(abs(xf), [-1], True)
    a = amax(abs(xf), [-1], True)       xf = convert(x, f32): the quant's own upcast of x when it has one
    m = div(sum(g, [d]), 4)
    s = reshape(sigmoid(u), [T, n, S])
    y = x
    g = mul(unsqueeze(w, -1), h)
    g = mul(w, reshape(h, [.., n, S]))
    x = convert(sum(mul(unsqueeze(convert(reshape(w, [b, s, n]), f32), -1), reshape(h, [b, s, n, S])), [-2]))

All but the last are exact: ``max.dim``'s values are ``amax``'s; upcasting bf16 / fp16 to fp32 is exact and
keeps order, so the max of the upcast values is the upcast of the max; for n a power of two, ``1 / n`` is exact
and both products are the same real number, rounded once; an elementwise op commutes with a reshape. Forms that would
change numerics are left alone (their quant then does not fuse and the fusion's report names the path to it):
a multiply by the reciprocal scale instead of a division, an amax clamped before the division, another FP8
max, ``* (1 / n)`` for an n that is not a power of two. The unsqueeze and the mul index the same dims; a mul
promotes a bf16 operand to fp32 exactly as the convert does. The per-token ``bmm`` of a gate row and n stream
rows becomes the gated sum of the same products in fp32, rounded once, as the GEMM computes it; only the order
of its n terms may differ (within the fp32 rounding of an n-term sum). It applies to n <= ``MAX_STREAMS`` only,
with no permute on the streams' side (attention's ``q @ k^T`` at one query is no collapse).

Applies to every graph (each rewrite is local); reports each rewrite with its node. Hand-written on plain FX
rather than with Inductor's pattern matcher: each is a local rewrite (one node, or a bmm and the views around
it) with dtype and shape preconditions that a traced pattern cannot state.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.tracing import split_streams, value_of

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
LOW_PRECISION = (torch.bfloat16, torch.float16)


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
    amax.meta["val"] = value_of(values)
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
    if not isinstance(value_of(x), torch.Tensor) or value_of(x).dtype not in LOW_PRECISION:
        return None
    upcast = next((u for u in x.users if u.target is CONVERT and u.args[1] == torch.float32 and not u.kwargs), None)
    with graph.inserting_before(node):
        if upcast is None:
            upcast = graph.call_function(CONVERT, (x, torch.float32))
            upcast.meta["val"] = value_of(x).float()
        new_abs = graph.call_function(aten.abs.default, (upcast,))
        new_abs.meta["val"] = value_of(upcast).abs()
        new_amax = graph.call_function(aten.amax.default, (new_abs, *amax.args[1:]), dict(amax.kwargs))
    new_amax.meta["val"] = value_of(node)
    _move_before(graph, upcast, new_abs)
    node.replace_all_uses_with(new_amax)
    for dead in (node, amax, absolute):
        graph.erase_node(dead)
    return f"amax in {value_of(x).dtype} then float32 -> amax of the float32 upcast: {new_amax.name}"


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
    dims, source = total.args[1], value_of(total.args[0])
    if not isinstance(source, torch.Tensor) or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    n = source.shape[dims[0]]
    if not isinstance(n, int) or n < 1 or n & (n - 1) or factor != 1.0 / n:
        return None
    with graph.inserting_before(node):
        division = graph.call_function(aten.div.Tensor, (total, n))
    division.meta["val"] = value_of(node)
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
        gate.meta["val"] = value_of(source).sigmoid()
        reshaped = graph.call_function(aten.reshape.default, (gate, split.args[1]))
    reshaped.meta["val"] = value_of(node)
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
    if not isinstance(value_of(source), torch.Tensor) or value_of(source).dtype != node.args[1]:
        return None
    node.replace_all_uses_with(source)
    graph.erase_node(node)
    return f"convert to the dtype it has -> dropped: {node.name}"


def _feeds_only_sums(node: fx.Node) -> bool:
    """Whether ``node`` is a product whose every user is a ``sum`` (the gated sum of a collapse)."""
    return bool(node.users) and all(user.target is aten.sum.dim_IntList for user in node.users)


def gate_unsqueeze_last_dim(graph: fx.Graph, node: fx.Node) -> str | None:
    """``unsqueeze(w, w.dim())`` (``w[..., None]``) feeding a gated sum -> ``unsqueeze(w, -1)``."""
    if node.target is not aten.unsqueeze.default or len(node.args) != 2:
        return None
    source, dim = node.args
    if not isinstance(value_of(source), torch.Tensor) or dim != value_of(source).dim():
        return None
    if not all(user.target is aten.mul.Tensor and _feeds_only_sums(user) for user in node.users):
        return None
    node.args = (source, -1)
    return f"unsqueeze at dim {dim} (the last) -> dim -1: {node.name}"


def upcast_into_promoting_mul(graph: fx.Graph, node: fx.Node) -> str | None:
    """``mul(unsqueeze(w, -1), [reshape](convert(h, f32)))`` with w fp32 and h bf16 / fp16, feeding a sum (the
    mHC gated sum) -> ``mul(unsqueeze(w, -1), [reshape](h))``: the mul promotes h to fp32 itself, exactly as the
    convert does. A full-width fp32 factor (ATOM's ``sigmoid(u.float()) * xn.float()``) keeps its converts: that
    pattern is written with them."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or not _feeds_only_sums(node):
        return None
    for position, operand in enumerate(node.args):
        other = node.args[1 - position]
        if not isinstance(value_of(other), torch.Tensor) or value_of(other).dtype != torch.float32:
            continue
        if other.target is not aten.unsqueeze.default or other.args[1] != -1:
            continue
        view = operand if isinstance(operand, fx.Node) and operand.target is aten.reshape.default else None
        convert = view.args[0] if view is not None else operand
        if not isinstance(convert, fx.Node) or convert.target is not CONVERT or convert.args[1] != torch.float32:
            continue
        low = convert.args[0]
        if not isinstance(value_of(low), torch.Tensor) or value_of(low).dtype not in LOW_PRECISION:
            continue
        with graph.inserting_before(node):
            if view is not None:
                low_view = graph.call_function(aten.reshape.default, (low, view.args[1]))
                low_view.meta["val"] = value_of(low).reshape(value_of(view).shape)
                low = low_view
        node.args = tuple(low if i == position else arg for i, arg in enumerate(node.args))
        for dead in (view, convert):
            if dead is not None and not dead.users:
                graph.erase_node(dead)
        return f"upcast of {value_of(low).dtype} into a promoting mul -> dropped: {node.name}"
    return None


# An HC has a handful of streams (4 in DeepSeek-V4 and Qwen3.8-Flash-Next; 2 to 8 in the papers). A per-token
# vector-matrix product over more rows is another GEMM: an expert projection at one token per expert, say.
MAX_STREAMS = 8


def token_bmm_to_gated_sum(graph: fx.Graph, node: fx.Node) -> str | None:
    """``bmm(a [B, 1, n], x [B, n, S])`` (``torch.matmul(w.view(B, 1, n), h.view(B, n, S))``, an einsum
    ``"...n,...nd->...d"``) -> ``convert(sum(unsqueeze(float(a), -1) * x, [-2]))``, in the token layout the bmm's
    result is viewed back to (``[batch, seq, S]``: the gates and streams are viewed to it instead, so the quant
    that follows reads the collapse itself).

    The same products (exact in fp32 for bf16 / fp16 operands) summed in fp32 and rounded once, as the GEMM
    does; only the order of the n terms may differ (the one non-exact canonical rewrite: within the fp32
    rounding of an n-term sum)."""
    if node.target is not aten.bmm.default:
        return None
    a, x = node.args
    x_operand = x
    a_val, x_val = value_of(a), value_of(x)
    if not isinstance(a_val, torch.Tensor) or not isinstance(x_val, torch.Tensor):
        return None
    n, hidden = x_val.shape[-2], x_val.shape[-1]
    if a_val.shape[1] != 1 or not isinstance(n, int) or not isinstance(hidden, int):
        return None
    if not 2 <= n <= MAX_STREAMS or n >= hidden:
        return None
    if not _stream_view(x):
        return None
    dtype = x_val.dtype
    end = _token_view_end(node, hidden)
    lead = list(end.args[1][:-1]) if end is not None else None
    with graph.inserting_before(end or node):  # end's sizes may be computed after the bmm
        if lead is None:  # the result [B, 1, S] is used as it is ([batch, 1] tokens: decode): keep that layout
            gate, x = _same_shape_source(a), _same_shape_source(x)
            x = _call(graph, aten.unsqueeze.default, (x, 1), value_of(x).unsqueeze(1))
        else:  # view the values behind the bmm's operand relayouts to the result's token layout
            tokens = value_of(end).shape[:-1]
            gate, x = _before_relayouts(a), _before_relayouts(x)
            gate = _call(graph, aten.reshape.default, (gate, [*lead, n]), value_of(gate).reshape(*tokens, n))
            x = _call(graph, aten.reshape.default, (x, [*lead, n, hidden]), value_of(x).reshape(*tokens, n, hidden))
        if dtype != torch.float32:
            gate = _call(graph, CONVERT, (gate, torch.float32), value_of(gate).float())
        column = _call(graph, aten.unsqueeze.default, (gate, -1), value_of(gate).unsqueeze(-1))
        product = _call(graph, aten.mul.Tensor, (column, x), value_of(column) * value_of(x))
        total = _call(graph, aten.sum.dim_IntList, (product, [-2]), value_of(product).sum(-2))
        if dtype != torch.float32:
            total = _call(graph, CONVERT, (total, dtype), value_of(total).to(dtype))
    replaced = end or node
    replaced.replace_all_uses_with(total)
    while replaced is not node:  # the view chain from the bmm to its end, last first
        source = replaced.args[0]
        graph.erase_node(replaced)
        replaced = source
    graph.erase_node(node)
    for operand in (a, x_operand):  # relayouts of the operands nothing reads now (SP must not see them)
        while isinstance(operand, fx.Node) and not operand.users and operand.target in RELAYOUTS:
            source = operand.args[0]
            graph.erase_node(operand)
            operand = source
    return f"per-token bmm [B, 1, {n}] @ [B, {n}, {hidden}] -> gated sum over the {n} streams: {total.name}"


def _stream_view(x: fx.Node) -> bool:
    """Whether the bmm's right operand can be HC streams: reshapes, copies, casts, expands of a value, or permutes
    that together only move unit dims (an einsum's), and no real transpose (an attention score's ``k^T``)."""
    node = x
    while True:
        if node.target is aten.permute.default:
            node, unit_only = _through_permutes(node)
            if not unit_only:
                return False
        elif node.target in (aten.reshape.default, aten.view.default, aten.expand.default, aten.clone.default, CONVERT):
            node = node.args[0]
            if not isinstance(node, fx.Node):
                return False
        else:
            return node.target not in (aten.transpose.int, aten.t.default)


def _through_permutes(permute: fx.Node) -> tuple[fx.Node, bool]:
    """The value behind a chain of permutes, and whether the chain as a whole only moves unit dims (keeps the
    order of the dims of size other than 1, so it moves no data)."""
    order, source = list(permute.args[1]), permute.args[0]
    while source.target is aten.permute.default:  # compose: out dim i is source dim order[i]
        order, source = [source.args[1][d] for d in order], source.args[0]
    shape = value_of(source).shape
    kept = [d for d in order if shape[d] != 1]
    return source, kept == sorted(kept)


RELAYOUTS = {
    aten.reshape.default,
    aten.view.default,
    aten.clone.default,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
}


def _same_shape_source(node: fx.Node) -> fx.Node:
    """``_before_relayouts(node)`` when it has ``node``'s shape (only copies, no-op expands and permutes of unit
    dims that cancel lie between), else ``node``."""
    source = _before_relayouts(node)
    return source if tuple(value_of(source).shape) == tuple(value_of(node).shape) else node


def _before_relayouts(node: fx.Node) -> fx.Node:
    """The value behind a chain of reshapes, copies, no-op expands and permutes that only move unit dims (none
    changes the row-major order of the elements, so a reshape of it is a reshape of the chain's end)."""
    while node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0]
        if node.target is aten.permute.default:
            source, unit_only = _through_permutes(node)
            if not unit_only:
                break
        elif node.target is aten.expand.default:
            if tuple(value_of(source).shape) != tuple(value_of(node).shape):
                break
        elif node.target not in (aten.reshape.default, aten.view.default, aten.clone.default):
            break
        node = source
    return node


def _token_view_end(bmm: fx.Node, hidden: int) -> fx.Node | None:
    """The last reshape of the chain of single-user views the bmm's ``[B, 1, S]`` result goes through to a
    ``[..., S]`` token layout (reshapes, and permutes that only move the unit dim), or None."""
    node, end = bmm, None
    while len(node.users) == 1:
        [user] = node.users
        if user.target is aten.permute.default:
            if not _through_permutes(user)[1]:
                break
        elif user.target not in (aten.reshape.default, aten.view.default):
            break
        node = user
        out = value_of(node)
        if node.target is not aten.permute.default and out.dim() >= 2 and out.shape[-1] == hidden:
            end = node
    return end


def _call(graph: fx.Graph, target: object, args: tuple, val: object) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


REWRITES = (
    max_values_to_amax,
    upcast_before_amax,
    reciprocal_to_division,
    sigmoid_before_stream_split,
    drop_noop_convert,
    gate_unsqueeze_last_dim,
    upcast_into_promoting_mul,
    token_bmm_to_gated_sum,
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
                "sigmoid after the stream split, no-op convert, positive unsqueeze dim or upcast into a gated sum, "
                "per-token bmm collapse)",
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

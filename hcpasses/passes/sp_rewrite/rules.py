"""Row-locality rules: which ops may run on a shard of the token rows, which operands they may read, and where
their results hold the tokens (``Layout``).

A region node's layout follows from its region operands' layouts by what the op does (``RowRules.layout``): a
pointwise op keeps its operands' (which must agree), a reduction or a dim op shifts it, a reshape regroups it
(``reshaped_layout``), a ``cat`` of per-stream values along their token dim stacks them (``outer``), a causal
token window (a front zero pad of the token dim read by a depthwise-style ``convolution`` that reaches exactly that
far back) takes ``halo`` rows from the ranks before. Every check
returns a ``NotShardable`` naming the node the region must not reach (the checked node, or the operand whose layout
breaks it) and why. Op knowledge is a table (``OP_RULES``); ops not in it are row-local when they are elementwise,
pointwise-tagged or the fused collapse ops. The values a region shards, reduce-scatters or gathers lead with their
tokens (``check_leading``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from hcpasses.passes.sp_rewrite.graph import tensor_operands
from hcpasses.passes.sp_rewrite.tokens import (
    Layout,
    first_tensor,
    leading_layout,
    normalized,
    reshaped_layout,
    same_size,
    token_dims,
)
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.tracing import value_of

aten = torch.ops.aten
prims = torch.ops.prims
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
CONVOLUTION = aten.convolution.default
EMBEDDING = aten.embedding.default
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
Layouts = Mapping[fx.Node, Layout]


class RowRules:
    """The checks for one graph whose values carry ``tokens`` rows; ``token_carriers`` are the values outside any
    region that carry tokens of their own (integer inputs such as ids, all-reduce outputs, what they feed)."""

    def __init__(self, tokens: Any, token_carriers: set[fx.Node]) -> None:
        self.tokens = tokens
        self.token_carriers = token_carriers

    def dims(self, node: fx.Node) -> int | None:
        """How many leading dims of ``node``'s value hold the tokens, or None."""
        return token_dims(first_tensor(value_of(node)), self.tokens)

    def check_leading(self, node: fx.Node) -> NotShardable | None:
        """Every tensor the node makes leads with the tokens, with static sizes after several token dims: a value
        the region shards, reduce-scatters or gathers (the collectives move ``[tokens, ...]`` rows)."""
        vals = value_of(node)
        for val in vals if isinstance(vals, (list, tuple)) else (vals,):
            if not isinstance(val, torch.Tensor):
                continue
            k = token_dims(val, self.tokens)
            if k is None:
                return NotShardable(f"result {tuple(val.shape)} does not lead with the {self.tokens} tokens", node)
            if k > 1 and not all(isinstance(size, int) for size in val.shape[k:]):
                return NotShardable(f"result {tuple(val.shape)} has symbolic sizes after its token dims", node)
        return None

    def layout(self, node: fx.Node, layouts: Layouts) -> Layout | NotShardable:
        """Where ``node``'s results hold the tokens, from the ``layouts`` of its region operands; a
        ``NotShardable`` where it cannot run on row shards."""
        haloed = [arg for arg in tensor_operands(node.args) if arg in layouts and layouts[arg].halo]
        if haloed and node.target not in (aten.slice.Tensor, CONVOLUTION):
            why = f"reads {haloed[0].name}, which holds {layouts[haloed[0]].halo} rows before its tokens for a conv"
            return NotShardable(why, node)
        rule = OP_RULES.get(node.target)
        if rule is not None:
            source = _source(node)
            layout = rule(self, node, layouts[source], layouts) if source in layouts else _no_tokens_in(self, source)
        elif node.target is operator.getitem:
            layout = self._item(node, layouts)
        elif node.target in FUSED_COLLAPSES:
            layout = self._per_token(node, layouts)
        elif is_pointwise(node):
            layout = self._broadcast(node, layouts)
        else:
            return NotShardable("not known to be row-local", node)
        if isinstance(layout, NotShardable):
            return layout
        vals = value_of(node)
        for val in vals if isinstance(vals, (list, tuple)) else (vals,):
            if isinstance(val, torch.Tensor) and not layout.matches(val.shape, self.tokens):
                why = f"result {tuple(val.shape)} does not hold the {self.tokens} tokens as {layout}"
                return NotShardable(why, node)
        return layout

    def _broadcast(self, node: fx.Node, layouts: Layouts) -> Layout | NotShardable:
        """A pointwise op: its region operands, aligned from the right, hold the tokens in the same dims, which
        they do not broadcast."""
        out = first_tensor(value_of(node))
        found: Layout | None = None
        for operand in (arg for arg in tensor_operands(node.args) if arg in layouts):
            val = value_of(operand)
            offset = out.dim() - val.dim()
            layout = normalized(layouts[operand].shifted(offset), out.shape)
            dims = range(layouts[operand].first, layouts[operand].end)
            if not all(same_size(val.shape[d], out.shape[d + offset]) for d in dims):
                return NotShardable(f"broadcasts the token dims of {operand.name}", node)
            if found is not None and layout != found:
                return NotShardable(f"combines values that hold their tokens differently ({found}, {layout})", node)
            found = layout
        return found if found is not None else _no_tokens_in(self, node)

    def _item(self, node: fx.Node, layouts: Layouts) -> Layout | NotShardable:
        """An item of a split holds the tokens as the split's source; any other item (a fused collapse's codes or
        scales) leads with them."""
        source = node.args[0]
        if source.target in SPLITS and source in layouts:
            return layouts[source]
        return leading_layout(value_of(node), self.tokens) or _no_tokens_in(self, node)

    def _per_token(self, node: fx.Node, layouts: Layouts) -> Layout | NotShardable:
        """A fused collapse: ``[tokens, ...]`` rows in, ``[tokens, ...]`` rows out."""
        for operand in (arg for arg in tensor_operands(node.args) if arg in layouts):
            if layouts[operand].leading_dims(value_of(operand).shape) is None:
                return NotShardable(f"reads {operand.name}, which does not lead with the tokens", node)
        return leading_layout(first_tensor(value_of(node)), self.tokens) or _no_tokens_in(self, node)

    def read_by_rows(self, node: fx.Node, operand: fx.Node, layouts: Layouts) -> bool:
        """Whether a pointwise region node reads ``operand``, a value from outside that leads with its tokens, row
        for row: its token dims line up with the node's (broadcasting aligns from the right) and are not broadcast.
        Then this rank's rows of ``operand`` are all the node needs, and the region shards it where it reads it:
        an MTP drafter's projected next-token embedding (``streams = norm(state) + e``), a PLE's features of the
        token ids (``gate = key(ids) * query(streams)``), the result of a piece the region was cut around.

        Sound whatever ``operand`` is: the values a region passes on (the streams, the gathered sub-layer
        inputs, the exits) are replicated across the group (DESIGN §3), so they are the same whichever rank's
        copy of ``operand`` computed which rows."""
        if node not in layouts or not is_pointwise(node) or layouts[node].halo:
            return False
        val, out = value_of(operand), first_tensor(value_of(node))
        lead = leading_layout(val, self.tokens)
        offset = out.dim() - val.dim() if isinstance(out, torch.Tensor) else -1
        if lead is None or offset < 0:
            return False
        aligned = all(same_size(val.shape[d], out.shape[d + offset]) for d in range(lead.first, lead.end))
        return aligned and normalized(lead.shifted(offset), out.shape) == layouts[node]

    def check_operand(self, node: fx.Node, position: int, operand: fx.Node, layout: Layout) -> NotShardable | None:
        """An operand from outside the region, read by a node that holds its tokens as ``layout``: it must carry
        no tokens (a weight or constant broadcast over the rows, or the right-hand side of a GEMM)."""
        if operand in self.token_carriers:
            return NotShardable(f"reads {operand.name}, which carries tokens but is not in the region", node)
        if (
            (node.target is aten.mm.default and position == 1)
            or (node.target is CONVOLUTION and position in (1, 2))
            or (node.target is EMBEDDING and position == 0)
        ):
            return None  # the right-hand side of a GEMM, a conv's weight and bias, a table: used whole by every row
        val, out = value_of(operand), first_tensor(value_of(node))
        # Broadcasting aligns dims from the right: the operand's dims under the token dims must be 1.
        offset = out.dim() - val.dim()
        under_tokens = [val.shape[i - offset] for i in range(layout.first, layout.end) if i >= offset]
        if offset < 0 or not all(same_size(size, 1) for size in under_tokens):
            return NotShardable(f"operand {operand.name} {tuple(val.shape)} is not broadcast over the tokens", node)
        return None


def is_pointwise(node: fx.Node) -> bool:
    return node.target in ELEMENTWISE or (
        isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
    )


def _no_tokens_in(rules: RowRules, node: fx.Node) -> NotShardable:
    """``node``'s value, read by the checked node, has no token dims: the region must not reach ``node``."""
    val = first_tensor(value_of(node))
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else val
    return NotShardable(f"{shape} does not lead with the {rules.tokens} tokens", node)


def _source(node: fx.Node) -> fx.Node:
    """The operand an op's rule reads the layout of: its input (a ``cat``'s first input, an embedding's indices)."""
    if node.target is aten.cat.default:
        return node.args[0][0]
    return node.args[1] if node.target is EMBEDDING else node.args[0]


def dim_arg(node: fx.Node) -> Any:
    """The dim argument of a ``DIM_OPS`` op (its default where not given)."""
    position, default = DIM_OPS[node.target]
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


# Each rule gets the node, ``layout``, that of its source, and the layouts of the region values so far.


def _resize(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """A reshape regroups the dims around the token rows (row-major order keeps each token's values together);
    an expand adds dims in front or broadcasts size-1 dims, never a token dim."""
    source, out = value_of(node.args[0]).shape, value_of(node).shape
    if node.target is not aten.expand.default:
        return reshaped_layout(layout, source, out, rules.tokens) or NotShardable("splits the token rows", node)
    offset = len(out) - len(source)
    if not all(same_size(source[d], out[d + offset]) for d in range(layout.first, layout.end)):
        return NotShardable("expands a token dim", node)
    return layout.shifted(offset)


def _along_dim(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    dim = dim_arg(node)
    source = value_of(_source(node))
    ndim = source.dim() + (node.target is aten.unsqueeze.default)  # unsqueeze's dim: its output's
    if not isinstance(dim, int):
        return NotShardable(f"works along dim {dim}, which is not static", node)
    dim %= max(ndim, 1)
    if node.target is aten.cat.default:
        return _cat(node, dim, layout, layouts)
    if node.target is aten.unsqueeze.default:
        if layout.first < dim < layout.end:
            return NotShardable(f"works along dim {dim}, a token dim", node)
        return layout.shifted(1) if dim <= layout.first else layout
    if layout.holds(dim):
        if _is_identity_slice(node, dim):
            return layout  # the emission drops it: on a shard it would cut the rows to the unsharded bounds
        return NotShardable(f"works along dim {dim}, a token dim", node)
    removed = node.target is aten.select.int or (node.target is aten.squeeze.dim and same_size(source.shape[dim], 1))
    return layout.shifted(-1) if removed and dim < layout.first else layout


def _is_identity_slice(node: fx.Node, dim: int) -> bool:
    """A slice that keeps every row of its dim (``x[..., -(halo + T):]`` of a value with halo + T rows)."""
    return node.target is aten.slice.Tensor and same_size(value_of(node.args[0]).shape[dim], value_of(node).shape[dim])


def _cat(node: fx.Node, dim: int, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """A ``cat`` of values holding their tokens alike; along their one token dim (``torch.stack`` of per-stream
    ``[T, S]`` values, decomposed), the result holds each input's tokens in turn: ``outer`` = the input count."""
    inputs = node.args[0]
    if not all(value in layouts and layouts[value] == layout for value in inputs):
        return NotShardable("concatenates values that do not hold their tokens alike", node)
    if not layout.holds(dim):
        return layout
    if layout.end - layout.first > 1 or layout.outer != 1:
        return NotShardable(f"works along dim {dim}, one of several token dims", node)
    return Layout(layout.first, layout.end, len(inputs), layout.inner)


def _permute(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    perm = [d % len(node.args[1]) for d in node.args[1]]
    places = [perm.index(d) for d in range(layout.first, layout.end)]
    if places != list(range(places[0], places[0] + len(places))):
        return NotShardable("splits or reorders the token dims", node)
    return Layout(places[0], places[0] + len(places), layout.outer, layout.inner)


def _reduction(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    ndim = value_of(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not dims or any(layout.holds(d % ndim) for d in dims):
        return NotShardable("reduces over a token dim", node)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return layout if keepdim else layout.shifted(-sum(d % ndim < layout.first for d in dims))


def _mm(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    # Row i of x @ W is a function of row i of x alone, whatever W is (an HC weight, or a TP shard of a
    # projection that reads the streams); check_operand makes sure W carries no tokens.
    if (layout.first, layout.end) != (0, 1):  # tokens in the rows only: the contraction dim holds none
        return NotShardable("a GEMM whose left operand does not hold the tokens in its rows", node)
    return layout


def _bmm(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    # Batched over tokens (mHC's per-token comb @ streams, an einsum's [T*S, 1, n] x [T*S, n, 1]); a right operand
    # from the region must hold its tokens alike, one from outside is checked like any other.
    other = node.args[1]
    if (layout.first, layout.end) != (0, 1) or (other in layouts and layouts[other] != layout):
        return NotShardable("a batched GEMM whose batch dim is not the tokens of both operands", node)
    return layout


def _pad(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """A constant pad of the dims under the tokens keeps each row's values in its row: Inductor's ``pad_mm``
    (CUDA only) writes one on each operand of a GEMM whose K or N is not a multiple of 8 (bf16) / 4 (fp32).
    Zero rows in front of the one token dim, and nothing else, are a causal token window's halo: on a shard the
    emission puts the rows of the ranks before there (zeros before the sequence start, as the pad)."""
    pads = node.args[1]  # (before, after) pairs from the last dim backwards
    ndim = value_of(node.args[0]).dim()
    # (dim, 0 before / 1 after) of every non-zero pad
    padded = [(ndim - 1 - i // 2, i % 2) for i, size in enumerate(pads) if not (isinstance(size, int) and size == 0)]
    if not any(layout.holds(dim) for dim, _ in padded):
        return layout
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
    if padded != [(layout.first, 0)] or value != 0 or layout.end - layout.first > 1 or layout.halo:
        return NotShardable("pads a token dim (other than with zero rows in front of its one token dim)", node)
    front = pads[2 * (ndim - 1 - layout.first)]
    if layout.outer != 1 or layout.inner != 1 or not isinstance(front, int):
        return NotShardable(f"pads the token dim of {layout} by {front} rows", node)
    return dataclasses.replace(layout, halo=front)


def _convolution(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """A 1-D convolution along the token dim, stride 1 and no padding of its own, over ``halo`` rows in front
    of the tokens that are exactly its reach, ``(kernel - 1) * dilation``: output row t reads input rows t - halo
    to t, each of its batch (a PLE's or a short conv's depthwise causal conv: ``conv1d(pad(x, (reach, 0)))``)."""
    _, weight, _, stride, padding, dilation, transposed, _, _ = node.args
    reach = (value_of(weight).shape[-1] - 1) * dilation[0]
    if value_of(node.args[0]).dim() != 3 or (layout.first, layout.end) != (2, 3):
        return NotShardable(f"a convolution whose input holds its tokens as {layout}, not in its one spatial dim", node)
    if transposed or list(stride) != [1] or list(padding) != [0]:
        return NotShardable("a convolution along the tokens with a stride, a padding of its own or transposed", node)
    if layout.halo != reach:
        why = f"a convolution reaching {reach} rows back over {layout.halo} halo rows (a causal window: both equal)"
        return NotShardable(why, node)
    return dataclasses.replace(layout, halo=0)


def _repeat(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """Tiling along the dims under the tokens (``conv_out.repeat(1, n)``: one copy per stream) keeps each row's
    values in its row; new dims come in front."""
    repeats = node.args[1]
    added = len(repeats) - value_of(node.args[0]).dim()
    shifted = layout.shifted(added)
    if any(shifted.holds(d) and not (isinstance(r, int) and r == 1) for d, r in enumerate(repeats)):
        return NotShardable("repeats along a token dim", node)
    return normalized(shifted, value_of(node).shape)


def _embedding(rules: RowRules, node: fx.Node, layout: Layout, layouts: Layouts) -> Layout | NotShardable:
    """A table lookup: row i of the result is the table's row at index i (``layout`` is the indices')."""
    return layout


OP_RULES: dict[Any, Callable[[RowRules, fx.Node, Layout, Layouts], Layout | NotShardable]] = {
    **dict.fromkeys(SIZE_OPS, _resize),
    **dict.fromkeys(DIM_OPS, _along_dim),
    aten.permute.default: _permute,
    **dict.fromkeys(REDUCTIONS, _reduction),
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.constant_pad_nd.default: _pad,
    CONVOLUTION: _convolution,
    aten.repeat.default: _repeat,
    EMBEDDING: _embedding,
}

"""Row-locality rules: which ops may run on a shard of the token rows, and which operands they may read.

Every check returns a ``NotShardable`` naming the node the region must not reach (the checked node, or the operand
whose layout breaks it) and why, or ``None`` when the node can run on row shards. Op knowledge is a table
(``OP_RULES``) of checks; ops not in it are row-local when they are elementwise, pointwise-tagged or the fused
collapse ops.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from hcpasses.passes.sp_rewrite.tokens import first_tensor, same_size, token_dims
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
ENTERS_STREAMS = (aten.add.Tensor, aten.sub.Tensor)


class RowRules:
    """The checks for one graph whose values carry ``tokens`` rows; ``token_carriers`` are the values outside any
    region that carry tokens of their own (integer inputs such as ids, all-reduce outputs, what they feed)."""

    def __init__(self, tokens: Any, token_carriers: set[fx.Node]) -> None:
        self.tokens = tokens
        self.token_carriers = token_carriers

    def dims(self, node: fx.Node) -> int | None:
        """How many leading dims of ``node``'s value hold the tokens, or None."""
        return token_dims(first_tensor(value_of(node)), self.tokens)

    def check_rows(self, node: fx.Node) -> NotShardable | None:
        """Every tensor the node makes leads with the tokens, with static sizes after several token dims."""
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

    def check_op(self, node: fx.Node) -> NotShardable | None:
        rule = OP_RULES.get(node.target)
        if rule is not None:
            k = self.dims(_source(node))
            return _no_tokens_in(self, _source(node)) if k is None else rule(self, node, k)
        target = node.target
        if (
            target in ELEMENTWISE
            or target in FUSED_COLLAPSES
            or target is operator.getitem
            or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)
        ):
            return None
        return NotShardable("not known to be row-local", node)

    def enters_streams(self, node: fx.Node, operand: fx.Node) -> bool:
        """Whether ``operand`` is a full-size term added into the streams, e.g. an MTP drafter's projected
        next-token embedding: ``streams = norm(state) + e``. Streams that reach an HC block are replicated
        (DESIGN §3) and so is the region's term, hence so is ``e``: its token rows can be sharded."""
        if node.target not in ENTERS_STREAMS:
            return False
        val, out = value_of(operand), value_of(node)
        return (
            token_dims(val, self.tokens) is not None
            and val.is_floating_point()
            and val.dim() == out.dim()
            and all(same_size(a, b) for a, b in zip(val.shape, out.shape, strict=True))
        )

    def check_operand(self, node: fx.Node, position: int, operand: fx.Node) -> NotShardable | None:
        """An operand from outside the region: it must carry no tokens (a weight or constant broadcast over the
        rows, or the right-hand side of a GEMM)."""
        if operand in self.token_carriers:
            return NotShardable(f"reads {operand.name}, which carries tokens but is not in the region", node)
        if node.target is aten.mm.default and position == 1:
            return None  # the right-hand side of a GEMM: used whole by every row
        val, out = value_of(operand), first_tensor(value_of(node))
        # Broadcasting aligns dims from the right: the operand's dims under the token dims must be 1.
        offset = out.dim() - val.dim()
        under_tokens = [val.shape[i - offset] for i in range(self.dims(node) or 0) if i >= offset]
        if offset < 0 or not all(same_size(size, 1) for size in under_tokens):
            return NotShardable(f"operand {operand.name} {tuple(val.shape)} is not broadcast over the tokens", node)
        return None


def _no_tokens_in(rules: RowRules, node: fx.Node) -> NotShardable:
    """``node``'s value, read by the checked node, has no token dims: the region must not reach ``node``."""
    val = first_tensor(value_of(node))
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else val
    return NotShardable(f"{shape} does not lead with the {rules.tokens} tokens", node)


def _source(node: fx.Node) -> fx.Node:
    """The operand an op's rule reads the token dims of: its input (a ``cat``'s first input)."""
    return node.args[0][0] if node.target is aten.cat.default else node.args[0]


# Each rule gets the node and ``k``, the token dims of its source (already known to lead with the tokens).


def _resize(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    """A reshape may merge or split the token dims (token order is row-major either way); an expand must leave
    them as they are."""
    if node.target is not aten.expand.default:
        return None
    k_out = rules.dims(node)
    if k_out is None:
        return _no_tokens_in(rules, node)
    pairs = zip(value_of(node.args[0]).shape[:k], value_of(node).shape[:k_out], strict=False)
    if k != k_out or not all(same_size(a, b) for a, b in pairs):
        return NotShardable("expands a token dim", node)
    return None


def _along_dim(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    position, default = DIM_OPS[node.target]
    dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
    ndim = value_of(_source(node)).dim() + (node.target is aten.unsqueeze.default)  # unsqueeze's dim: its output's
    if not isinstance(dim, int) or dim % max(ndim, 1) < k:
        return NotShardable(f"works along dim {dim}, a token dim", node)
    return None


def _permute(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    if [d % len(node.args[1]) for d in node.args[1][:k]] != list(range(k)):
        return NotShardable("moves a token dim", node)
    return None


def _reduction(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    ndim = value_of(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else None
    if not dims or any(d % ndim < k for d in dims):
        return NotShardable("reduces over a token dim", node)
    return None


def _mm(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    # Row i of x @ W is a function of row i of x alone, whatever W is (an HC weight, or a TP shard of a
    # projection that reads the streams); check_operand makes sure W carries no tokens.
    return None if k == 1 else NotShardable("a GEMM whose left operand does not lead with the tokens", node)


def _bmm(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    # Batched over tokens (mHC's per-token comb @ streams); the operands are checked like any other.
    k_out = rules.dims(node)
    if k_out is None:
        return _no_tokens_in(rules, node)
    return None if k_out == 1 else NotShardable("a batched GEMM whose batch dim is not the tokens", node)


def _pad(rules: RowRules, node: fx.Node, k: int) -> NotShardable | None:
    """A constant pad of the dims under the tokens keeps each row's values in its row: Inductor's ``pad_mm``
    (CUDA only) writes one on each operand of a GEMM whose K or N is not a multiple of 8 (bf16) / 4 (fp32)."""
    pads = node.args[1]  # (before, after) pairs from the last dim backwards
    ndim = value_of(node.args[0]).dim()
    padded = [ndim - 1 - i // 2 for i, size in enumerate(pads) if not (isinstance(size, int) and size == 0)]
    if any(dim < k for dim in padded):
        return NotShardable("pads a token dim", node)
    return None


OP_RULES: dict[Any, Callable[[RowRules, fx.Node, int], NotShardable | None]] = {
    **dict.fromkeys(SIZE_OPS, _resize),
    **dict.fromkeys(DIM_OPS, _along_dim),
    aten.permute.default: _permute,
    **dict.fromkeys(REDUCTIONS, _reduction),
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.constant_pad_nd.default: _pad,
}

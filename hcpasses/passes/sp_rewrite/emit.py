"""SP emission: rewrites one analysed region in place (``region`` has accepted every node).

The start and full-size entries are sharded (``hcpasses::shard_rows``), each all-reduce becomes pad +
reduce-scatter, size arguments of reshapes take ``[1, ..., 1, R]`` token dims, and every region value used
outside the region is all-gathered (FP8 as bytes) and trimmed to the T rows.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

import hcpasses.rows  # noqa: F401  (registers torch.ops.hcpasses.shard_rows)
from hcpasses.passes.sp_rewrite.region import (
    SIZE_OPS,
    SYM_SIZE,
    WAIT,
    NotRowLocal,
    Region,
    aten,
    c10d,
    first_tensor,
    node_order,
    same_size,
    token_dims,
)
from hcpasses.patterns.tracing import value_of


class RegionRewriter:
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
        self.dims: dict[fx.Node, int] = {node: token_dims(first_tensor(value_of(node)), tokens) for node in touched}
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
            for dim, size in enumerate(value_of(start).shape[: self.dims[start]])
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
            *zip(value_of(self.region.start).shape, self.start_sizes, strict=False),
            (self.token_count, self.tokens),
        ]
        for size, node in candidates:
            if same_size(expr, size):
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
        for node in sorted(region.nodes, key=node_order(self.graph).__getitem__):
            outside = [u for u in node.users if u not in region.nodes]
            if outside and isinstance(value_of(node), torch.Tensor):
                full = self._gather(node)
                for user in outside:
                    user.replace_input_with(node, full)
                gathered.append(node.name)
                if self._stream_wide(node):
                    self.stream_wide.add(node.name)
        self.graph.eliminate_dead_code()
        return gathered

    def _stream_wide(self, node: fx.Node) -> bool:
        """Whether a value is as wide per token as the streams (n*S): the streams themselves or a state."""
        start = value_of(self.region.start)
        return same_size(
            math.prod(value_of(node).shape[self.dims[node] :]), math.prod(start.shape[self.dims[self.region.start] :])
        )

    def _keep_token_sizes(self) -> None:
        """``sym_size(v, d)`` of a token dim d of a region value v: read it off the unsharded start instead."""
        for node in list(self.graph.nodes):
            if node.target is SYM_SIZE and node.args[0] in self.region.nodes:
                source, dim = node.args
                if dim < self.dims[source]:
                    size = self._size_of(value_of(source).shape[dim])
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
        shape = list(value_of(partial).shape)
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
        rest = list(value_of(node).shape[k:])  # ints: _check_rows rejects symbolic sizes after the token dims
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
        val, k = value_of(node), self.dims[node]
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

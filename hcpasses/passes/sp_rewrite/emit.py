"""SP emission: rewrites one analysed region in place. Every check ran in the analysis (``region``), every size is
resolved there, so the emitters only insert nodes and rewire uses; a rewrite that starts always finishes.

The start and the values read row for row from outside (entries) are sharded (a slice of the rows zero-padded to
R*tp, no pad where a static N splits evenly; ``hcpasses::shard_rows`` where a size after the token dims is
symbolic), each all-reduce becomes pad +
reduce-scatter, size arguments of reshapes take a shard's token dims (``Layout.sharded_sizes``), a token window's
front zero pad becomes the rows of the ranks before (one small all-gather of every rank's last rows), slices that
kept every row are dropped, and every exit is all-gathered (FP8 as bytes; as FP8 with ``overlap``) and trimmed to
the N rows. Row arithmetic is
``hcpasses.rows``'s, applied to ints or, for a symbolic N, to ``fx.Proxy`` values so that the same functions emit
the graph's ``operator`` nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from hcpasses.passes.sp_rewrite.collectives import WAIT, AllReduceMatch, c10d
from hcpasses.passes.sp_rewrite.kept import KeptRows
from hcpasses.passes.sp_rewrite.overlap import feed_gemms_untrimmed, gemm_of_partial, gemm_on_padded_rows
from hcpasses.passes.sp_rewrite.region import SYM_SIZE, Exit, Halo, Region
from hcpasses.passes.sp_rewrite.tokens import Size, SizeOf
from hcpasses.patterns.tracing import value_of
from hcpasses.rows import pad_rows, rows_per_rank, shard_token_sizes

aten = torch.ops.aten
SHARD_ROWS = torch.ops.hcpasses.shard_rows.default  # registered by importing hcpasses.rows


@dataclasses.dataclass(frozen=True)
class Emitted:
    """What the rewrite of a region made for overlap (``overlap``): how many GEMMs read a gather's rows directly and
    how many reduce-scatters read a GEMM's output directly."""

    gemms_after_gathers: int = 0
    gemms_before_scatters: int = 0


def rewrite_region(graph: fx.Graph, region: Region, overlap: bool = False) -> Emitted:
    """Shard ``region`` over its group (this process's rank in it, its size); with ``overlap``, in the form
    Inductor's micro-pipeline TP fuses (``overlap``)."""
    return _Emitter(graph, region, overlap).emit()


class _Emitter:
    def __init__(self, graph: fx.Graph, region: Region, overlap: bool) -> None:
        self.graph, self.region, self.overlap = graph, region, overlap
        self.rank, self.tp = region.group.rank, region.group.size
        self.untrimmed: dict[fx.Node, tuple[fx.Node, Any]] = {}  # a gathered [N, K] value -> ([R*tp, K] rows, K)
        self.gemms_before_scatters = 0

    def emit(self) -> Emitted:
        region, graph = self.region, self.graph
        # N, R and the start's token sizes right after the start, where every later use can read them.
        with graph.inserting_before(region.start.next):
            self.start_sizes, self.tokens, self.rows = self._token_sizes()
        for read, size in region.token_size_reads:
            _replace_uses(read, self._size(size))
            graph.erase_node(read)
        anchor = self.rows if isinstance(self.rows, fx.Node) else region.start
        with graph.inserting_before(anchor.next):  # the new nodes in order, right after the anchor
            shard = self._shard(region.start)
        for user in list(region.start.users):
            if user in region.nodes:
                user.replace_input_with(region.start, shard)
        shards: dict[fx.Node, fx.Node] = {}
        for entry in region.entries:  # in graph order: one shard per value, before its first reader
            if entry.operand not in shards:
                with graph.inserting_before(entry.user):
                    shards[entry.operand] = self._shard(entry.operand)
            entry.user.replace_input_with(entry.operand, shards[entry.operand])
        for halo in region.halos:
            self._window(halo)
        for node in region.identity_slices:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        local = {match.wait: self._reduce_scatter(match) for match in region.reduces}
        for node, layout in region.reshapes:
            with graph.inserting_before(node):  # a symbolic R times a layout's factors: new nodes, before the use
                sizes = [_node(size) for size in layout.sharded_sizes(node.args[1], _proxy(self.rows))]
            node.args = (node.args[0], sizes, *node.args[2:])
        for exit_ in region.exits:
            source = local.get(exit_.value, exit_.value)
            for kept in exit_.kept:  # slices that keep a few rows: each gathers those alone
                self._gather_kept(source, exit_, kept)
            if not exit_.kept:
                full = self._gather(source, exit_)
                for user in exit_.users:
                    user.replace_input_with(source, full)
        gemms_after_gathers = feed_gemms_untrimmed(self.untrimmed, self.tokens) if self.overlap else 0
        graph.eliminate_dead_code()
        return Emitted(gemms_after_gathers, self.gemms_before_scatters)

    def _token_sizes(self) -> tuple[list[Any], Any, Any]:
        """The start's token sizes, N and R = ceil(N/tp): ints, or nodes computing them when N is symbolic."""
        start = self.region.start
        if isinstance(self.region.tokens, int):
            return list(self.region.start_sizes), self.region.tokens, rows_per_rank(self.region.tokens, self.tp)
        sizes = [
            size if isinstance(size, int) else self.graph.call_function(SYM_SIZE, (start, dim))
            for dim, size in enumerate(self.region.start_sizes)
        ]
        tokens = functools.reduce(operator.mul, map(_proxy, sizes))
        return sizes, _node(tokens), _node(rows_per_rank(tokens, self.tp))

    def _size(self, size: Size) -> Any:
        if isinstance(size, SizeOf):
            return self.tokens if size.dim is None else self.start_sizes[size.dim]
        return size

    def _shard(self, value: fx.Node) -> fx.Node:
        """This rank's token rows of a full-size (replicated) value: ``slice(pad(flat, R*tp - N zero rows), rank*R,
        (rank+1)*R)``, both views that Inductor fuses into the value's readers (a mask and an affine row index in
        each), as the hand-written SP's ``pad(x[rank*R:(rank+1)*R])``; no pad where a static N splits evenly. Padding
        first keeps the slice inside the padded rows for every N, so Inductor need not clamp its end: a slice of
        the unpadded rows with a symbolic end made it guard on the clamp, and the pass adds no guards (``tokens``).
        An indexed read (``flat[row]``, the rewrite up to 2026-12-07) made the row index data to Inductor: every
        reader loaded the rows indirectly (the benchmark model's first layer read its embedding through the index,
        0.07 ms of 18.4 at tp 2, T = 16384, H100). ``shard_rows`` (a copy of all N rows, opaque to Inductor) where
        a size after the token dims is symbolic."""
        k = self.region.dims[value]
        rest = list(value_of(value).shape[k:])
        if not all(isinstance(size, int) for size in rest):
            return self.graph.call_function(SHARD_ROWS, (value, self.rank, self.tp, k))
        flat = self._flatten_tokens(value, k, rest)
        padded = self._pad_rows(flat, 1 + len(rest))
        begin = 0 if self.rank == 0 else _node(_proxy(self.rows) * self.rank)  # ints stay ints
        end = self.rows if self.rank == 0 else _node(_proxy(self.rows) * (self.rank + 1))
        rows = self.graph.call_function(aten.slice.Tensor, (padded, 0, begin, end))
        if k == 1:
            return rows
        return self.graph.call_function(aten.reshape.default, (rows, [*shard_token_sizes(self.rows, k), *rest]))

    def _window(self, halo: Halo) -> None:
        """``pad(x, rows zeros in front of dim)`` -> ``cat([the rows before this rank's, x], dim)``.

        Every rank sends its last m rows, m = min(R, rows) (R when a static R is short of the reach: then the ranks
        before hold whole shards), in one all-gather; rank r takes the ``rows`` rows that end at its first, from
        the gathered ``r*m`` rows of the ranks before it, and zeros for rows before the sequence start (as the pad
        had). With a symbolic R, m = rows: the analysis made sure R >= rows for every N the backend runs this graph
        on (N >= sp_min_tokens), and the graph asserts it, so that a direct call with fewer tokens fails loudly."""
        pad, dim, reach = halo.pad, halo.dim, halo.rows
        x = pad.args[0]
        ndim = value_of(x).dim()
        m = min(self.rows, reach) if isinstance(self.rows, int) else reach
        lead = [dim, *(d for d in range(ndim) if d != dim)]  # the collective gathers along dim 0
        with self.graph.inserting_before(pad):
            if not isinstance(self.rows, int):
                enough = self.graph.call_function(operator.ge, (self.rows, reach))
                why = f"hcpasses SP: a token window reaches {reach} rows back, more than this rank's rows"
                self.graph.call_function(aten._assert_scalar.default, (enough, why))
            begin = _node(_proxy(self.rows) - m)
            tail = self.graph.call_function(aten.slice.Tensor, (x, dim, begin, self.rows))
            rows_first = self.graph.call_function(aten.permute.default, (tail, lead))
            contiguous = self.graph.call_function(
                aten.clone.default, (rows_first,), {"memory_format": torch.contiguous_format}
            )
            gathered = self.graph.call_function(
                c10d.all_gather_into_tensor.default, (contiguous, self.tp, self.region.group.arg)
            )
            tails = self.graph.call_function(WAIT, (gathered,))
            stop = self.rank * m
            start = max(0, stop - reach)
            before = self.graph.call_function(aten.slice.Tensor, (tails, 0, start, stop))
            if reach - (stop - start):  # zeros before the sequence start
                zeros = [0, 0] * (ndim - 1) + [reach - (stop - start), 0]
                before = self.graph.call_function(aten.constant_pad_nd.default, (before, zeros, 0.0))
            in_place = self.graph.call_function(aten.permute.default, (before, [lead.index(d) for d in range(ndim)]))
            window = self.graph.call_function(aten.cat.default, ([in_place, x], dim))
        pad.replace_all_uses_with(window)
        self.graph.erase_node(pad)

    def _reduce_scatter(self, match: AllReduceMatch) -> fx.Node:
        """``wait(all_reduce(partial))`` -> this rank's rows of the sum: pad to R*tp rows, reduce-scatter."""
        partial, k = match.partial, self.region.dims[match.partial]
        shape = list(value_of(partial).shape)
        gemm = gemm_of_partial(partial) if self.overlap else None
        with self.graph.inserting_before(match.all_reduce):
            if gemm is not None:  # the reduce-scatter reads the GEMM's rows, padded in its left operand
                padded = self._gemm_on_all_rows(gemm)
                self.gemms_before_scatters += 1
            else:
                flat = self._flatten_tokens(partial, k, shape[k:])
                padded = self._pad_rows(flat, len(shape) - k + 1)
            scattered = self.graph.call_function(
                c10d.reduce_scatter_tensor.default, (padded, "sum", self.tp, self.region.group.arg)
            )
            local = self.graph.call_function(WAIT, (scattered,))
            if k > 1:
                local = self.graph.call_function(
                    aten.reshape.default, (local, [*shard_token_sizes(self.rows, k), *shape[k:]])
                )
        match.wait.replace_all_uses_with(local)
        self.graph.erase_node(match.wait)  # collectives are impure: dead-code elimination keeps them
        self.graph.erase_node(match.all_reduce)
        return local

    def _gemm_on_all_rows(self, gemm: fx.Node) -> fx.Node:
        """``gemm`` ([N, S]) on R*tp rows: its left operand padded with zero rows (none when they divide evenly)."""
        with self.graph.inserting_before(gemm):  # a symbolic count is computed where the new GEMM can read it
            missing = self._missing_rows()
        return gemm if isinstance(missing, int) and missing == 0 else gemm_on_padded_rows(gemm, missing)

    def _missing_rows(self) -> Any:
        """The zero rows that make N split evenly: an int, or a node computing it for a symbolic N."""
        if isinstance(self.tokens, int):
            return pad_rows(self.tokens, self.tp)
        return _node(pad_rows(_proxy(self.tokens), self.tp))

    def _flatten_tokens(self, node: fx.Node, k: int, rest: list[Any]) -> fx.Node:
        """``node`` (``k`` token dims, then ``rest``) reshaped to ``[tokens, *rest]`` (a no-op for one token dim);
        ``rest`` are ints: the analysis rejects symbolic sizes after several token dims."""
        if k == 1:
            return node
        return self.graph.call_function(aten.reshape.default, (node, [-1, *rest]))

    def _pad_rows(self, flat: fx.Node, ndim: int) -> fx.Node:
        """``flat [N, ...]`` (``ndim`` dims) padded with zero rows to ``[R*tp, ...]``."""
        missing = self._missing_rows()
        if isinstance(missing, int) and missing == 0:
            return flat
        pad = [0, 0] * (ndim - 1) + [0, missing]
        return self.graph.call_function(aten.constant_pad_nd.default, (flat, pad, 0.0))

    def _gather(self, node: fx.Node, exit_: Exit) -> fx.Node:
        """All token rows of a region value: all_gather (FP8 as uint8 bytes), trim the pad rows, restore the token
        dims."""
        k, val = self.region.dims[exit_.value], value_of(exit_.value)
        # FP8 codes travel as bytes (gloo has no FP8), but as FP8 where overlap is on (NCCL sends FP8): given the
        # bytes, Inductor's fusion would hand fused_all_gather_scaled_matmul uint8 codes (torch 2.13).
        as_bytes = exit_.as_bytes and not self.overlap
        rest, group = list(val.shape[k:]), self.region.group.arg
        with self.graph.inserting_before(node.next):  # keeps the new nodes in order, right after node
            source = self.graph.call_function(aten.view.dtype, (node, torch.uint8)) if as_bytes else node
            flat = self._flatten_tokens(source, k, rest)
            gathered = self.graph.call_function(c10d.all_gather_into_tensor.default, (flat, self.tp, group))
            waited = self.graph.call_function(WAIT, (gathered,))
            # FP8 codes back to their dtype right after the wait: the form Inductor's fusions match (``overlap``)
            rows = self.graph.call_function(aten.view.dtype, (waited, val.dtype)) if as_bytes else waited
            full = self.graph.call_function(aten.slice.Tensor, (rows, 0, 0, self.tokens))
            if k > 1:
                full = self.graph.call_function(aten.reshape.default, (full, [*map(self._size, exit_.sizes), *rest]))
            if len(rest) == 1:  # [N, K] values: GEMMs can read their rows
                self.untrimmed[full] = (rows, rest[0])
            return full

    def _gather_kept(self, node: fx.Node, exit_: Exit, kept: KeptRows) -> None:
        """``x[..., first:first + count]`` along a token dim of an exit (``kept``) -> those K rows alone, not all N.

        Every rank sends its copy of each kept row, row % R of its rows (where it does not hold the row, another of
        its rows stands in), in one all-gather of tp blocks of K rows; kept row j is row j of the block of the rank
        that holds it, block ``row // R``. One row of a static N is sent and picked by slices, several by an index
        (``_one_static_row``). A symbolic N must give the dim the rows the slice keeps: the graph
        asserts it (the analysis made sure every N >= sp_min_tokens does)."""
        k, val = kept.k, value_of(exit_.value)
        rest, group = list(val.shape[k:]), self.region.group.arg
        sizes = [self._size(size) for size in exit_.sizes]  # the unsharded token sizes
        call = self.graph.call_function
        with self.graph.inserting_before(kept.slice):
            if not isinstance(sizes[kept.dim], int):
                enough = call(operator.ge, (sizes[kept.dim], kept.least))
                why = f"hcpasses SP: a slice keeps rows up to {kept.least} of a token dim, which is shorter"
                call(aten._assert_scalar.default, (enough, why))
            # FP8 codes travel as bytes (gloo has no FP8)
            source = call(aten.view.dtype, (node, torch.uint8)) if exit_.as_bytes else node
            flat = self._flatten_tokens(source, k, rest)
            row = _one_static_row(sizes, kept, self.rows)
            if row is not None:  # logits_to_keep=1 at a static N: two views, no copy after the gather
                mine = call(aten.slice.Tensor, (flat, 0, row % self.rows, row % self.rows + 1))
                gathered = call(WAIT, (call(c10d.all_gather_into_tensor.default, (mine, self.tp, group)),))
                picked = call(aten.slice.Tensor, (gathered, 0, row // self.rows, row // self.rows + 1))
            else:
                rows = self._kept_token_rows(sizes, kept, val.device)
                local = call(aten.remainder.Scalar, (rows, self.rows))
                mine = call(aten.index.Tensor, (flat, [local]))
                gathered = call(WAIT, (call(c10d.all_gather_into_tensor.default, (mine, self.tp, group)),))
                owner = call(aten.div.Tensor_mode, (rows, self.rows), {"rounding_mode": "floor"})
                block = call(aten.mul.Tensor, (owner, kept.rows))
                picked = call(
                    aten.index.Tensor, (gathered, [call(aten.add.Tensor, (block, self._iota(kept.rows, val.device)))])
                )
            picked = call(aten.view.dtype, (picked, val.dtype)) if exit_.as_bytes else picked
            token_sizes = [kept.count if d == kept.dim else sizes[d] for d in range(k)]  # ints: K is static
            if kept.drops_dim:  # a select: its result has no such dim
                del token_sizes[kept.dim]
            out = call(aten.reshape.default, (picked, [*token_sizes, *rest]))
        kept.slice.replace_all_uses_with(out)
        self.graph.erase_node(kept.slice)

    def _kept_token_rows(self, sizes: list[Any], kept: KeptRows, device: torch.device) -> fx.Node:
        """The flattened token rows (row-major over the token dims ``sizes``) that ``kept.slice`` keeps, in its order:
        ``[K]`` int64. Dim by dim: each of the rows so far plus each kept index of this dim times its stride; the
        sliced dim's indices run from its first kept row."""
        call, index = self.graph.call_function, None
        for d in range(kept.k):
            count = kept.count if d == kept.dim else sizes[d]
            if d != kept.dim and count == 1:
                continue  # a dim of one row adds nothing to the row index
            stride = functools.reduce(operator.mul, map(_proxy, sizes[d + 1 : kept.k]), 1)
            first = kept.first if d == kept.dim else 0
            first = _proxy(sizes[d]) - first if d == kept.dim and kept.from_end else first
            start = 0 if isinstance(first, int) and first == 0 else _node(first * stride)
            steps = self._iota(count, device, start, _node(stride))
            if index is not None:
                pairs = call(aten.add.Tensor, (call(aten.unsqueeze.default, (index, -1)), steps))
                steps = call(aten.reshape.default, (pairs, [-1]))
            index = steps
        return index

    def _iota(self, count: Any, device: torch.device, start: Any = 0, step: Any = 1) -> fx.Node:
        """``start + step * arange(count)``, int64: ``prims.iota``, which Inductor lowers (``aten.arange``, like
        ``aten.clamp`` and ``aten.index_select``, it expects decomposed before the post-grad passes: none of them may
        be emitted here)."""
        kwargs = {"start": start, "step": step, "dtype": torch.int64, "device": device, "requires_grad": False}
        return self.graph.call_function(torch.ops.prims.iota.default, (count,), kwargs)


def _one_static_row(sizes: list[Any], kept: KeptRows, rows_per_rank: Any) -> int | None:
    """The flattened token row ``kept`` keeps where it keeps one row of static token sizes; else None. (One row
    only: the local rows of several, ``row % R``, need not be one run, and an index gives Inductor a copy after the
    gather, one kernel the hand-written SP does not run; a symbolic row's slice bounds would add guards.)"""
    if kept.rows != 1 or not isinstance(rows_per_rank, int) or not all(isinstance(size, int) for size in sizes):
        return None
    # one kept row: every other token dim has one row, so the kept index along ``dim`` is the flattened row; counted
    # from the start, as ``kept_rows`` gives it for a dim of static size
    return kept.first


def _replace_uses(old: fx.Node, new: Any) -> None:
    """Every use of ``old`` reads ``new``, a node or a plain int (``Node.replace_all_uses_with`` takes nodes only)."""
    for user in list(old.users):
        user.args, user.kwargs = fx.map_arg((user.args, user.kwargs), lambda arg: new if arg is old else arg)


def _proxy(value: Any) -> Any:
    return fx.Proxy(value) if isinstance(value, fx.Node) else value


def _node(value: Any) -> Any:
    return value.node if isinstance(value, fx.Proxy) else value

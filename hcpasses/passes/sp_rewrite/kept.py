"""Kept rows: a slice along a token dim that keeps a few rows of a region value (serving's ``logits_to_keep=1``:
``hidden[:, -1:]`` before the LM head; or a select, ``hidden[:, -1]``) needs only those rows, not a gather of all N.

``kept_rows`` decides, from the slice's arguments and the value's token sizes, whether a slice is such a narrowing
and which rows it keeps; the emission (``emit._Emitter._gather_kept``) gathers those rows alone: every rank sends
its copy of each kept row (row % R of its shard), one all-gather of ``tp * K`` rows, and each kept row is
taken from the rank that holds it. So the exit moves ``tp * K`` rows instead of N.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from hcpasses.passes.sp_rewrite.rules import dim_arg

aten = torch.ops.aten
ROW_PICKS = (aten.slice.Tensor, aten.select.int)  # the ops that keep some rows of a dim by static bounds
TO_THE_END = 2**62  # slice ends at or past this keep every row to the end (``x[-1:]`` ends at INT64_MAX)


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """``slice`` keeps ``count`` rows of token dim ``dim`` of a region value with ``k`` token dims: from index
    ``first`` on, counted from the dim's end where ``from_end`` (``x[:, -1:]``: first 1, from the end). The other
    token dims are static, so the kept rows are ``rows`` = count * their sizes. ``least``: the size the dim must have
    for the slice to keep ``count`` rows (asserted in the graph when the token count is symbolic). ``drops_dim``: a
    select, whose result has no dim ``dim``."""

    slice: fx.Node
    dim: int
    k: int
    first: int
    from_end: bool
    count: int
    rows: int
    least: int
    drops_dim: bool = False


def kept_rows(
    node: fx.Node, k: int | None, shape: Sequence[Any], tokens: Any, tp: int, min_tokens: int
) -> KeptRows | str | None:
    """``node`` as a slice keeping a few rows of a value of ``shape`` whose ``k`` leading dims hold the tokens: its
    ``KeptRows``; why it cannot gather only them (a str); None when it is no slice along a token dim that drops rows.

    Narrowing pays when the ``tp * K`` rows it gathers are fewer than N. With a symbolic N, only a static K counts
    (a slice by static bounds: ``x[-k:]`` or ``x[a:b]``), and only where every N the sharded graph runs on
    (N >= ``min_tokens``) has as many rows along the dim as the slice needs, as the emitted graph asserts."""
    if node.target not in ROW_PICKS or k is None:
        return None
    dim = dim_arg(node)
    if not isinstance(dim, int) or not 0 <= dim % len(shape) < k:
        return None
    dim %= len(shape)
    start, end, step = _bounds(node)
    start = 0 if start is None else start
    end = TO_THE_END if end is None else end
    if not all(isinstance(bound, int) for bound in (start, end, step)):
        return "slices at a bound that is not static"
    if step != 1:
        return f"slices with step {step}"
    others = [size for d, size in enumerate(shape[:k]) if d != dim]
    if not all(isinstance(size, int) for size in others):
        return "other token dims than the sliced one are symbolic"
    kept = _static_bounds(shape[dim], start, end)
    if kept is None:
        return "keeps a symbolic number of rows"
    first, from_end, count, least = kept
    if count == 0 or (isinstance(shape[dim], int) and count == shape[dim]):
        return None  # keeps no row or every row: nothing to narrow
    rows = count * math.prod(others)
    fewest = tokens
    if not isinstance(tokens, int):  # N >= min_tokens on every call of the sharded graph
        fewest = min_tokens
        if -(-min_tokens // math.prod(others)) < least:
            return (
                f"keeps rows up to {least} along dim {dim}; with a symbolic token count, sharded graphs run from "
                f"sp_min_tokens={min_tokens} tokens, fewer rows along it"
            )
    if rows * tp >= fewest:
        of = fewest if isinstance(tokens, int) else f"as few as {fewest}"
        return f"keeps {rows} of {of} rows: {tp} copies of them are no fewer than all rows"
    return KeptRows(node, dim, k, first, from_end, count, rows, least, node.target is aten.select.int)


def indexed_rows(node: fx.Node, k: int | None, shape: Sequence[Any], tokens: Any, tp: int) -> str | None:
    """Why a tensor index that picks a few token rows (``hidden[arange(B), lengths - 1]``: the last token of each
    sequence of a ragged batch, or vLLM's ``hidden[logits_indices]``) still reads every row: which rows it keeps is a
    run-time value, and only slices and selects by static bounds are narrowed. None for any other node, and for an
    index whose row count is not static or would not gather fewer rows (an MoE's dispatch of every token)."""
    if node.target is not aten.index.Tensor or k is None:
        return None
    indices = node.args[1]
    if not any(index is not None for index in indices[:k]):
        return None
    out = node.meta.get("val")
    row_width = math.prod(shape[k:])
    if not isinstance(out, torch.Tensor) or not all(isinstance(size, int) for size in (*out.shape, row_width)):
        return None
    rows = out.numel() // max(row_width, 1)
    if not isinstance(tokens, int) or rows * tp >= tokens:
        return None
    return f"a tensor index keeping {rows} of {tokens} rows: only slices and selects by static bounds are narrowed"


def _bounds(node: fx.Node) -> tuple[Any, Any, Any]:
    """A ``slice.Tensor``'s start, end and step, their defaults where not given; a ``select.int``'s as the slice of
    its one row (``x[i]`` keeps what ``x[i:i + 1]`` does, ``x[-1]`` what ``x[-1:]`` does)."""
    if node.target is aten.select.int:
        index = node.args[2] if len(node.args) > 2 else node.kwargs["index"]
        if not isinstance(index, int):
            return index, None, 1
        return index, (None if index == -1 else index + 1), 1
    given = {**dict(zip(("start", "end", "step"), node.args[2:], strict=False)), **node.kwargs}
    return given.get("start"), given.get("end"), given.get("step", 1)


def _static_bounds(size: Any, start: int, end: int) -> tuple[int, bool, int, int] | None:
    """(first, from_end, count, least) of ``x[start:end]`` along a dim of ``size`` rows, as Python slices do; None
    where the count depends on a symbolic size."""
    if isinstance(size, int):
        kept = range(size)[start:end]
        return kept.start, False, len(kept), size
    if start < 0 and end >= TO_THE_END:  # x[-c:]: the last c rows, given at least c
        return -start, True, -start, -start
    if start < end < 0:  # x[-a:-b]: a - b rows from the a-th last, given at least a
        return -start, True, end - start, -start
    if 0 <= start < end < TO_THE_END:  # x[a:b]: given at least b rows
        return start, False, end - start, end
    return None

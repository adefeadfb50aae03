"""Blocked scans pass: a long running max or min whose indices nothing reads becomes a blocked scan.

Before (``x`` scanned along dim ``d`` of length N; ``i`` unused)::

    v, i = aten.cummax(x, d)

After (L elements per block, C = ceil(N / L) blocks; ``x`` moved so that ``d`` is last)::

    b = reshape(constant_pad_nd(x, [0, C*L - N]), [..., C, L])
    inner = cummax(b, -1)[0]                               # C scans of L elements
    carry = cummax(select(inner, -1, -1), -1)[0]           # the running max over whole blocks (blocked in turn if
                                                           # Inductor would split it: a scan of C elements)
    before = constant_pad_nd(carry[..., :-1], [1, 0], lowest)
    v = reshape(where(inner >= before | isnan(inner), inner, before[..., None]), [..., C*L])[..., :N]

Why: Inductor splits a scan over several thread blocks when its rows are long and few (its own heuristic,
``InductorChoices.reduction_split_factor`` > 1), and it cannot split a scan with two results (cummax's values and
indices): such a scan falls back to ATen's kernel, one thread block per row. qwen4_exp's n-gram hashing takes a
``cummax`` of the EOS positions along the whole sequence: at T = 16384 that is ATen's
``tensor_kernel_scan_innermost_dim_with_indices``, 0.095 ms on an H200 (torch 2.11, docs/BENCHMARKS.md), the largest
difference between hcpasses' SP and a hand-written SP of that model. Each level here is one Inductor scans unsplit,
in Triton. Hand-written on plain FX: a local rewrite of one node whose precondition (which results are read, what
Inductor would do with its size) a traced pattern cannot state.

Which heuristic: Inductor asks one of two, for an inner or an outer reduction, after classifying the scan by the
strides of the indices it reads once lowered, which the pass cannot see. They differ a lot: 17 rows of 1024 elements
are one Triton scan as an inner reduction and 8 splits (so ATen) as an outer one. And the classification is not the
layout alone: qwen4_exp scans ``where(cat([eos history, ids]) == eos, ...)``, whose read of ``ids`` Inductor indexes
as ``Identity(1024*c + r - 2)``, stride hints 0, so outer (torch 2.11, on the H200). So the pass asks both, and
picks the largest block (1024 down to 32) that neither splits; Inductor never splits a scan of 32 elements or fewer
(``Reduction.num_splits``' floor), so a block is always found. One row is always an inner reduction
(``Reduction.num_splits``' easy case). Asking both may block a scan Inductor would have run unsplit (an outer
verdict that its reads would not have given): a few small Triton kernels more, against ATen's kernel when it does.

Exact, as ``torch.cummax`` / ``cummin`` compute values: the scan is causal, so the pad after the row changes none
of the N values kept; max and min are associative; the combine takes the block's own value on a tie and on NaN,
as cummax does (``x >= running or isnan(x)``), so a NaN propagates and a tie keeps the later element.

Applies when: the scan's device is CUDA (Inductor scans in Triton there; on CPU every scan is ATen's), its
indices are unused, its dtype is a float or integer one, its sizes are static, and Inductor may split it (either
heuristic above). Bails out (graph untouched, the report says why): no cummax / cummin, indices read, another
device or dtype, a scan neither heuristic splits, and symbolic sizes: the blocks' sizes (``ceil(N / L)``, the pad,
the slice back to N) make the fake values add shape guards (``Ne(ceil(N / 1024), 1)``, ``N <= 1024 * ceil(N /
1024)``, checked on torch 2.13), which Dynamo would then check on every call, specialising a graph meant for every
length (and a lazily compiled variant would be given up). A prefill compiled for one length (``dynamic=False``, as
``benchmarks/prefill_hf.py`` does) is blocked; one with a symbolic T is not.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.tracing import value_of

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig

aten = torch.ops.aten
SCANS = {aten.cummax.default: "max", aten.cummin.default: "min"}
# Elements per block, largest first. The last is Inductor's floor: it never splits a scan of 32 elements or fewer
# (``Reduction.num_splits``: ``reduction_numel <= min_elements_per_thread``).
BLOCK_SIZES = (1024, 512, 256, 128, 64, 32)
# (length, rows) of a scan along the last dim -> the elements per block to scan it in, or None to scan it as it is
BlockChoice = Callable[[int, int], "int | None"]


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A scan the pass leaves alone, and why."""

    scan: fx.Node
    why: str

    def __str__(self) -> str:
        return f"{self.scan.name} left as it is: {self.why}"


class BlockedScans(GraphPass):
    name = "blocked_scans"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        scans = [node for node in graph.nodes if node.target in SCANS]
        if not scans:
            return PassResult(0, "no cummax or cummin")
        notes, skipped = [], []
        for scan in scans:
            verdict = blocked_length(scan)
            if isinstance(verdict, Skipped):
                skipped.append(str(verdict))
                continue
            name = scan.name  # erased below
            values, blocks = block_scan(graph, scan, functools.partial(inductor_block, value_of(scan.args[0]).device))
            levels = " then ".join(map(str, blocks))
            notes.append(f"{name}: {verdict} elements scanned in blocks of {levels} -> {values.name}")
        return PassResult(len(notes), "; ".join(skipped) or None, tuple(notes + skipped))


def blocked_length(scan: fx.Node) -> int | Skipped:
    """The scanned length of a ``scan`` this pass rewrites, else why not."""
    x, dim = scan.args[0], _dim(scan)
    val = value_of(x)
    if any(user.target is not operator.getitem or (user.args[1] != 0 and user.users) for user in scan.users):
        return Skipped(scan, "its indices are read (the blocks compute values only)")
    if val.device.type != "cuda":
        return Skipped(scan, f"on {val.device.type}, where Inductor runs every scan as ATen's kernel")
    if not (val.dtype.is_floating_point or _is_integer(val.dtype)):
        return Skipped(scan, f"dtype {val.dtype} has no lowest value to start a block from")
    if val.dim() == 0:
        return Skipped(scan, "a 0-d tensor has nothing to scan")
    if not all(isinstance(size, int) for size in val.shape):
        return Skipped(scan, f"symbolic sizes {tuple(val.shape)}: the blocks' sizes would add shape guards")
    length = val.shape[dim]
    rows = functools.reduce(operator.mul, (size for d, size in enumerate(val.shape) if d != dim), 1)
    if not inductor_may_split(val.device, length, rows):
        return Skipped(scan, f"Inductor scans {rows} row(s) of {length} elements unsplit, in Triton")
    return length


def inductor_may_split(device: torch.device, length: int, rows: int) -> bool:
    """Whether Inductor may split a scan of ``rows`` rows of ``length`` elements (and so fall back to ATen for a scan
    with two results): its own heuristic for an inner reduction, and for more than one row the outer one too (see the
    module docstring). Internal to Inductor: pinned on the GPU by ``tests/test_blocked_scans.py``."""
    from torch._inductor.choices import InductorChoices

    factor = functools.partial(InductorChoices.reduction_split_factor, device, length, rows)
    return factor(inner_reduction=True) > 1 or (rows > 1 and factor(inner_reduction=False) > 1)


def inductor_block(device: torch.device, length: int, rows: int) -> int | None:
    """The largest block of ``BLOCK_SIZES`` whose scans Inductor runs unsplit, for a scan of ``rows`` rows of
    ``length`` elements that it may split; None for one it does not."""
    if length <= BLOCK_SIZES[-1] or not inductor_may_split(device, length, rows):
        return None
    fits = (
        block
        for block in BLOCK_SIZES
        if block < length and not inductor_may_split(device, block, rows * -(-length // block))
    )
    return next(fits, BLOCK_SIZES[-1])


def block_scan(graph: fx.Graph, scan: fx.Node, choose: BlockChoice) -> tuple[fx.Node, list[int]]:
    """Replace the values of ``scan`` (a cummax / cummin node of static sizes) with the blocked scan of the module
    docstring, each level's block chosen by ``choose`` (the carry's scan is the next level; a level it gives None is
    one scan); the new values node, and the block of each level."""
    x, dim = scan.args[0], _dim(scan)
    val = value_of(x)
    rank = val.dim()
    with graph.inserting_before(scan):
        order = [d for d in range(rank) if d != dim] + [dim]
        moved = x if dim == rank - 1 else _call(graph, aten.permute.default, x, order)
        shape = [val.shape[d] for d in order]
        values, blocks = _blocked_values(graph, scan.target, moved, shape, val.dtype, choose)
        if dim != rank - 1:
            values = _call(graph, aten.permute.default, values, _inverse(order))
    for user in list(scan.users):  # the values' getitem, and an unused one of the indices
        user.replace_all_uses_with(values)
        graph.erase_node(user)
    graph.erase_node(scan)
    return values, blocks


def _blocked_values(
    graph: fx.Graph, target: Any, x: fx.Node, shape: Sequence[int], dtype: torch.dtype, choose: BlockChoice
) -> tuple[fx.Node, list[int]]:
    """The values of ``target(x, -1)`` for ``x`` of ``shape``: blocked if ``choose`` gives a block, else the scan."""
    *outer, length = shape
    block = choose(length, functools.reduce(operator.mul, outer, 1))
    if block is None:
        return _call(graph, operator.getitem, _call(graph, target, x, -1), 0), []
    if not 1 < block < length:  # a block of 1 never shortens the carry; one of the whole row is the scan again
        raise ValueError(f"a block of {block} elements cannot block a scan of {length}")
    call = functools.partial(_call, graph)
    kind = SCANS[target]
    blocks = -(-length // block)
    padded = call(aten.constant_pad_nd.default, x, [0, blocks * block - length])
    tiles = call(aten.reshape.default, padded, [*outer, blocks, block])
    inner = call(operator.getitem, call(target, tiles, -1), 0)
    last = call(aten.select.int, inner, -1, -1)
    carry, deeper = _blocked_values(graph, target, last, [*outer, blocks], dtype, choose)
    earlier = call(aten.slice.Tensor, carry, -1, 0, -1)
    before = call(aten.unsqueeze.default, call(aten.constant_pad_nd.default, earlier, [1, 0], _lowest(dtype, kind)), -1)
    compare = aten.ge.Tensor if kind == "max" else aten.le.Tensor
    own = call(compare, inner, before)
    if dtype.is_floating_point:
        own = call(aten.logical_or.default, own, call(aten.isnan.default, inner))
    combined = call(aten.where.self, own, inner, before)
    rows = call(aten.reshape.default, combined, [*outer, blocks * block])
    return call(aten.slice.Tensor, rows, -1, 0, length), [block, *deeper]


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    return graph.call_function(target, args)


def _dim(scan: fx.Node) -> int:
    dim = scan.args[1] if len(scan.args) > 1 else scan.kwargs["dim"]
    return dim % max(1, value_of(scan.args[0]).dim())


def _lowest(dtype: torch.dtype, kind: str) -> float | int:
    """The identity of the running max (min): the dtype's lowest (highest) value."""
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, d in enumerate(order):
        inverse[d] = position
    return inverse

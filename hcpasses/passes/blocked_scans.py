"""Blocked scans pass: a long running max or min whose indices nothing reads becomes a two-level blocked scan.

Before (``x`` scanned along dim ``d`` of length N; ``i`` unused)::

    v, i = aten.cummax(x, d)

After (L = ``SCAN_BLOCK`` elements per block, C = ceil(N / L) blocks; ``x`` moved so that ``d`` is last)::

    b = reshape(constant_pad_nd(x, [0, C*L - N]), [..., C, L])
    inner = cummax(b, -1)[0]                               # C scans of L elements
    carry = cummax(select(inner, -1, -1), -1)[0]           # the running max over whole blocks
    before = constant_pad_nd(carry[..., :-1], [1, 0], lowest)
    v = reshape(where(inner >= before | isnan(inner), inner, before[..., None]), [..., C*L])[..., :N]

Why: Inductor splits a scan of a long row over several thread blocks when there are few rows (Inductor's own
heuristic, ``InductorChoices.reduction_split_factor`` > 1: more than 8192 elements per row before sm100), and it
cannot split a scan with two results (cummax's values and indices): such a scan falls back to ATen's kernel, one
thread block per row. qwen4_exp's n-gram hashing takes a ``cummax`` of the EOS positions along the whole sequence:
at T = 16384 that is ATen's ``tensor_kernel_scan_innermost_dim_with_indices``, 0.095 ms on an H200 (torch 2.11,
docs/BENCHMARKS.md), the largest difference between hcpasses' SP and a hand-written SP of that model. Each level
here is short enough for Inductor to scan in Triton. Hand-written on plain FX: a local rewrite of one node whose
precondition (which results are read, what Inductor would do with its size) a traced pattern cannot state.

Exact, as ``torch.cummax`` / ``cummin`` compute values: the scan is causal, so the pad after the row changes none
of the N values kept; max and min are associative; the combine takes the block's own value on a tie and on NaN,
as cummax does (``x >= running or isnan(x)``), so a NaN propagates and a tie keeps the later element.

Applies when: the scan's device is CUDA (Inductor scans in Triton there; on CPU every scan is ATen's), its
indices are unused, its dtype is a float or integer one, its sizes are static, and Inductor would split it (the
heuristic above). Bails out (graph untouched, the report says why): no cummax / cummin, indices read, another
device or dtype, a row Inductor scans unsplit, more than ``SCAN_BLOCK`` blocks per row (the carry scan would split
in turn), and symbolic sizes: the blocks' sizes (``ceil(N / L)``, the pad, the slice back to N) make the fake
values add shape guards (``Ne(ceil(N / 1024), 1)``, ``N <= 1024 * ceil(N / 1024)``, checked on torch 2.13), which
Dynamo would then check on every call, specialising a graph meant for every length (and a lazily compiled variant
would be given up). A prefill compiled for one length (``dynamic=False``, as ``benchmarks/prefill_hf.py`` does) is
blocked; one with a symbolic T is not.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.tracing import value_of

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig

aten = torch.ops.aten
SCANS = {aten.cummax.default: "max", aten.cummin.default: "min"}
SCAN_BLOCK = 1024  # elements per block: below every no-split threshold of Inductor's scans (8192 before sm100)


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
            values = block_scan(graph, scan, SCAN_BLOCK)
            notes.append(f"{name}: {verdict} elements scanned in blocks of {SCAN_BLOCK} -> {values.name}")
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
    if not inductor_splits(val.device, length, rows):
        return Skipped(scan, f"Inductor scans {rows} row(s) of {length} elements unsplit, in Triton")
    if -(-length // SCAN_BLOCK) > SCAN_BLOCK:
        return Skipped(scan, f"{length} elements make more than {SCAN_BLOCK} blocks")
    return length


def inductor_splits(device: torch.device, length: int, rows: int) -> bool:
    """Whether Inductor splits a scan of ``rows`` rows of ``length`` elements (and so falls back to ATen for a scan
    with two results): its own heuristic. Internal to Inductor: pinned on the GPU by ``tests/test_blocked_scans.py``."""
    from torch._inductor.choices import InductorChoices

    return InductorChoices.reduction_split_factor(device, length, rows, inner_reduction=True) > 1


def block_scan(graph: fx.Graph, scan: fx.Node, block: int) -> fx.Node:
    """Replace the values of ``scan`` (a cummax / cummin node of static sizes) with the blocked scan of the module
    docstring; the new values node."""
    x, dim = scan.args[0], _dim(scan)
    val = value_of(x)
    kind, rank = SCANS[scan.target], val.dim()
    lowest = _lowest(val.dtype, kind)
    with graph.inserting_before(scan):
        call = functools.partial(_call, graph)
        order = [d for d in range(rank) if d != dim] + [dim]
        outer, length = [val.shape[d] for d in order[:-1]], val.shape[dim]
        blocks = -(-length // block)
        moved = x if dim == rank - 1 else call(aten.permute.default, x, order)
        padded = call(aten.constant_pad_nd.default, moved, [0, blocks * block - length])
        tiles = call(aten.reshape.default, padded, [*outer, blocks, block])
        inner = call(operator.getitem, call(scan.target, tiles, -1), 0)
        last = call(aten.select.int, inner, -1, -1)
        carry = call(operator.getitem, call(scan.target, last, -1), 0)
        earlier = call(aten.slice.Tensor, carry, -1, 0, -1)
        before = call(aten.unsqueeze.default, call(aten.constant_pad_nd.default, earlier, [1, 0], lowest), -1)
        compare = aten.ge.Tensor if kind == "max" else aten.le.Tensor
        own = call(compare, inner, before)
        if val.dtype.is_floating_point:
            own = call(aten.logical_or.default, own, call(aten.isnan.default, inner))
        combined = call(aten.where.self, own, inner, before)
        rows = call(aten.reshape.default, combined, [*outer, blocks * block])
        kept = call(aten.slice.Tensor, rows, -1, 0, length)
        values = kept if dim == rank - 1 else call(aten.permute.default, kept, _inverse(order))
    for user in list(scan.users):  # the values' getitem, and an unused one of the indices
        user.replace_all_uses_with(values)
        graph.erase_node(user)
    graph.erase_node(scan)
    return values


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

"""The passes never change a graph's side effects: the audit every property-test capture runs (issue #23).

A side effect is a node whose running matters beyond its value: FX's impure nodes (in-place ops such as the
``copy_`` of an input mutation, a buffer update or a KV-cache write), collectives, and RNG ops. Around each run
of the pass pipeline, :class:`AuditedManager` takes them before and after and checks that

- the non-collective ones are the same ops in the same order (a pass may rewire what they read, e.g. SP
  gathers the rows a cache write stores, but never drops, adds or reorders one);
- the collectives are the same multiset, except for what the SP record says it did: ``k`` all-reduces became
  reduce-scatters and ``g`` all-gathers were added, each with its ``wait_tensor``.

SP's own runtime checks (``aten._assert_scalar`` with a message from ``hcpasses SP``: a token window's rows per rank
with a symbolic token count) change no state and are not counted; every other assert is.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from hcpasses.report import GraphReport

from .simulator import collective_name, is_collective

SP_NOTE = re.compile(r"collectives: (\d+) all-reduce -> reduce-scatter; (\d+) all-gathers added")
ALL_REDUCE = "_c10d_functional::all_reduce"
REDUCE_SCATTER = "_c10d_functional::reduce_scatter_tensor"
ALL_GATHER = "_c10d_functional::all_gather_into_tensor"
WAIT = "_c10d_functional::wait_tensor"


def _is_rng(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _is_sp_check(node: fx.Node) -> bool:
    return node.target is torch.ops.aten._assert_scalar.default and str(node.args[1]).startswith("hcpasses SP")


@dataclasses.dataclass(frozen=True)
class SideEffects:
    """A graph's side-effect nodes: the non-collective ones in graph order, the collectives counted by op."""

    ordered: tuple[str, ...]
    collectives: collections.Counter[str]


def side_effects(graph: fx.Graph) -> SideEffects:
    ordered, collectives = [], collections.Counter()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if is_collective(node.target):
            collectives[collective_name(node.target)] += 1
        elif (node.is_impure() or _is_rng(node.target)) and not _is_sp_check(node):
            ordered.append(str(node.target))
    return SideEffects(tuple(ordered), collectives)


def expected_after(before: SideEffects, report: GraphReport) -> SideEffects:
    """What the side effects must be after the pipeline whose report this is."""
    record = next((r for r in report.passes if r.name == "sp_rewrite"), None)
    if record is None or record.status != "applied":
        return before
    notes = [m for m in map(SP_NOTE.search, record.notes) if m]
    assert len(notes) == 1, f"the SP record names no collective counts: {record.notes}"
    reduces, gathers = (int(group) for group in notes[0].groups())
    collectives = collections.Counter(before.collectives)
    collectives.subtract({ALL_REDUCE: reduces})
    collectives.update({REDUCE_SCATTER: reduces, ALL_GATHER: gathers, WAIT: gathers})
    return SideEffects(before.ordered, +collectives)


def check_side_effects(before: SideEffects, after: SideEffects, report: GraphReport) -> None:
    want = expected_after(before, report)
    assert after.ordered == want.ordered, f"side effects changed: {want.ordered} -> {after.ordered}\n{report}"
    assert after.collectives == want.collectives, (
        f"collectives: before {dict(before.collectives)}, expected {dict(want.collectives)}, "
        f"after {dict(after.collectives)}\n{report}"
    )


class AuditedManager(CustomGraphPass):
    """A pass manager whose every run is checked by :func:`check_side_effects` (``audited`` counts the runs)."""

    def __init__(self, manager: Callable[[fx.Graph], None] | CustomGraphPass, reports: list[GraphReport]) -> None:
        self.manager, self.reports = manager, reports
        self.audited = 0

    def __call__(self, graph: fx.Graph) -> None:
        before = side_effects(graph)
        count = len(self.reports)
        self.manager(graph)
        assert len(self.reports) == count + 1, "the manager made no report"
        check_side_effects(before, side_effects(graph), self.reports[-1])
        self.audited += 1

    def uuid(self) -> Any:
        return self.manager.uuid() if isinstance(self.manager, CustomGraphPass) else None

    def __deepcopy__(self, memo: dict[int, Any]) -> AuditedManager:
        return self  # Inductor may deep-copy its config: the copy must count into the same object

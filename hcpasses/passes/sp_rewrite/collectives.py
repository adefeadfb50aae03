"""The all-reduces the SP rewrite turns into reduce-scatters, as typed matches."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from hcpasses.passes.sp_rewrite.verdict import NotShardable

c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default


@dataclasses.dataclass(frozen=True)
class AllReduceMatch:
    """``wait(all_reduce(partial, "sum", group))``: a TP sub-layer's partial sums, summed over ``group``."""

    all_reduce: fx.Node
    wait: fx.Node

    def __post_init__(self) -> None:
        if self.all_reduce.target is not ALL_REDUCE or self.wait.target is not WAIT:
            raise ValueError(f"not an all-reduce and its wait: {self.all_reduce.name}, {self.wait.name}")

    @property
    def partial(self) -> fx.Node:
        return self.all_reduce.args[0]

    @property
    def group(self) -> Any:
        """The group argument as the graph spells it (a name on torch 2.11; reused as is, DESIGN §5)."""
        return self.all_reduce.args[2]


def find_all_reduces(graph: fx.Graph) -> tuple[AllReduceMatch, ...] | NotShardable:
    """Every all-reduce of ``graph``, each a waited sum over the default group, or why not."""
    world = dist.group.WORLD.group_name
    matches = []
    for node in graph.nodes:
        if node.target is not ALL_REDUCE:
            continue
        waits = [u for u in node.users if u.target is WAIT]
        if node.args[1] != "sum" or node.args[2] != world or len(waits) != 1 or len(node.users) != 1:
            return NotShardable(f"all-reduce {node.name} is not a waited sum over the default group")
        matches.append(AllReduceMatch(node, waits[0]))
    if not matches:
        return NotShardable("no all-reduce: not a TP graph")
    return tuple(matches)

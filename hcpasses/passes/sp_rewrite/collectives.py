"""The all-reduces the SP rewrite turns into reduce-scatters, as typed matches, each with the group it sums over."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from hcpasses.passes.sp_rewrite.verdict import NotShardable

c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """The process group an all-reduce sums over, and this process's place in it: a region shards its token
    rows over this group (``rank`` of ``size``), not over the default one (a DP x TP job has several)."""

    arg: Any  # the group argument as the graph spells it (a name on torch 2.11): reused as is, DESIGN §5
    name: str
    rank: int
    size: int

    def __str__(self) -> str:
        return f"group '{self.name}' (rank {self.rank} of {self.size})"


@dataclasses.dataclass(frozen=True)
class AllReduceMatch:
    """``wait(all_reduce(partial, "sum", group))``: a TP sub-layer's partial sums, summed over ``group``."""

    all_reduce: fx.Node
    wait: fx.Node
    group: TPGroup

    def __post_init__(self) -> None:
        if self.all_reduce.target is not ALL_REDUCE or self.wait.target is not WAIT:
            raise ValueError(f"not an all-reduce and its wait: {self.all_reduce.name}, {self.wait.name}")

    @property
    def partial(self) -> fx.Node:
        return self.all_reduce.args[0]


def resolve_group(arg: Any) -> TPGroup | NotShardable:
    """The group a collective's group argument names, or why it names none of this process's groups.

    Internal API: ``torch.distributed.distributed_c10d._resolve_process_group`` (name -> ProcessGroup, what
    Inductor's own passes use; pinned in ``tests/test_sp_groups.py`` for torch 2.11 and 2.13)."""
    if isinstance(arg, dist.ProcessGroup):
        group = arg
    else:
        try:
            group = _resolve_process_group(str(arg))
        except RuntimeError:
            return NotShardable(f"group {arg!r} is no process group of this process")
    return TPGroup(arg, group.group_name, dist.get_rank(group), dist.get_world_size(group))


def find_all_reduces(graph: fx.Graph) -> tuple[AllReduceMatch, ...] | NotShardable:
    """Every all-reduce of ``graph``, each a waited sum over a group of this process, or why not."""
    matches = []
    for node in graph.nodes:
        if node.target is not ALL_REDUCE:
            continue
        waits = [u for u in node.users if u.target is WAIT]
        if node.args[1] != "sum" or len(waits) != 1 or len(node.users) != 1:
            return NotShardable(f"all-reduce {node.name} is not a waited sum")
        group = resolve_group(node.args[2])
        if isinstance(group, NotShardable):
            return NotShardable(f"all-reduce {node.name}: {group.why}")
        matches.append(AllReduceMatch(node, waits[0], group))
    if not matches:
        return NotShardable("no all-reduce: not a TP graph")
    return tuple(matches)

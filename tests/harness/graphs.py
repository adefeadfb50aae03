"""Small traced graphs and edits of them for tests of the pass infrastructure: ``make_fx`` with fake tensors, so
every node has a ``meta["val"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx


def traced(fn: Callable[..., Any], *shapes: tuple[int, ...]) -> fx.GraphModule:
    """``fn`` traced on fake inputs of ``shapes`` (default: x [5, 4] and w [4, 6])."""
    shapes = shapes or ((5, 4), (4, 6))
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(shape) for shape in shapes))


def first_node(graph: fx.Graph, target: object) -> fx.Node:
    return next(n for n in graph.nodes if n.target == target)


def add_unused_neg(graph: fx.Graph) -> None:
    """A ``neg`` of the first ``relu`` that nothing uses, with its value: what a rewrite can leave behind."""
    relu = first_node(graph, torch.ops.aten.relu.default)
    with graph.inserting_after(relu):
        neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
    neg.meta["val"] = relu.meta["val"]


def node_program(graph: fx.Graph) -> list[tuple[object, ...]]:
    """Each node's op, target and arguments, nodes written as their positions: the program without names."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    return [(n.op, n.target, fx.map_arg((n.args, n.kwargs), position.__getitem__)) for n in graph.nodes]

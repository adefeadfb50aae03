"""Graph helpers of the SP analysis: node order, ancestors, descendants, tensor operands. They read, never change."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from hcpasses.patterns.tracing import value_of


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node they read, transitively."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def descendants(graph: fx.Graph, roots: Iterable[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node that reads them, transitively."""
    reached = set(roots)
    for node in graph.nodes:
        if any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    return reached


def tensor_operands(arg: Any) -> list[fx.Node]:
    """The nodes in an argument (nested lists included) whose values are tensors."""
    nodes: list[fx.Node] = []
    fx.map_arg(arg, nodes.append)
    return [n for n in nodes if isinstance(value_of(n), torch.Tensor)]

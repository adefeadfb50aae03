"""Graph checks and rollback used by the manager after every pass.

``verify_graph`` lints the graph and re-propagates shapes with fake tensors: every node is run again
on the fake inputs recorded on the placeholders, and the result must have the shape and dtype the
node's ``meta["val"]`` records. A pass that wires a full-size tensor into a sharded one, or forgets
to set ``meta["val"]`` consistently, fails here instead of producing a wrong program.

``snapshot_graph`` / ``restore_graph`` put a graph back as it was before a failed pass. FX has no
transaction API, so this copies nodes with ``Graph.graph_copy``; placeholders are kept as the very
same nodes (passes must not touch graph inputs) so Inductor sees the inputs it expects.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true


class GraphVerificationError(RuntimeError):
    """The graph after a pass is malformed or its shapes do not re-propagate."""


def _same_dims(recorded: Any, fresh: Any) -> bool:
    if isinstance(recorded, int) and isinstance(fresh, int):
        return recorded == fresh
    return statically_known_true(recorded == fresh)


def _check_value(node: fx.Node, recorded: Any, fresh: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        if not isinstance(fresh, torch.Tensor):
            raise GraphVerificationError(f"node {node.name}: recorded a tensor, re-propagation gave {type(fresh)}")
        same_shape = recorded.dim() == fresh.dim() and all(
            _same_dims(a, b) for a, b in zip(recorded.shape, fresh.shape, strict=True)
        )
        if not same_shape or recorded.dtype != fresh.dtype:
            raise GraphVerificationError(
                f"node {node.name} ({node.target}): meta records {tuple(recorded.shape)} {recorded.dtype}, "
                f"its inputs now give {tuple(fresh.shape)} {fresh.dtype}"
            )
    elif isinstance(recorded, (list, tuple)) and isinstance(fresh, (list, tuple)):
        if len(recorded) != len(fresh):
            raise GraphVerificationError(f"node {node.name}: {len(recorded)} outputs recorded, {len(fresh)} now")
        for rec, new in zip(recorded, fresh, strict=True):
            _check_value(node, rec, new)


class _FakeRepropagation(fx.Interpreter):
    """Runs the graph on fake tensors; checks each result against the node's recorded meta
    (``overwrite=False``) or records it (``overwrite=True``)."""

    def __init__(self, module: fx.GraphModule, graph: fx.Graph, overwrite: bool) -> None:
        super().__init__(module, garbage_collect_values=True, graph=graph)
        self.overwrite = overwrite

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("placeholder", "output"):
            return result
        recorded = n.meta.get("val")
        if recorded is None or self.overwrite:
            n.meta["val"] = result
        else:
            _check_value(n, recorded, result)
        return result


def verify_graph(graph: fx.Graph) -> None:
    """Lint ``graph`` and re-propagate fake shapes; raise ``GraphVerificationError`` on a mismatch."""
    try:
        graph.lint()
    except Exception as err:  # lint raises bare RuntimeErrors; give them one type
        raise GraphVerificationError(f"graph lint failed: {err}") from err
    _propagate(graph, overwrite=False)


def refresh_fake_values(graph: fx.Graph) -> None:
    """Recompute every node's ``meta["val"]`` from the placeholders' fake values (after a rewrite)."""
    _propagate(graph, overwrite=True)


def _propagate(graph: fx.Graph, overwrite: bool) -> None:
    inputs = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    if any(value is None for value in inputs):
        return  # graphs built by hand in tests may carry no fake values; lint is all we can do
    fake_mode = detect_fake_mode(inputs)
    module = graph.owning_module
    if fake_mode is None or module is None:
        return
    with fake_mode:
        _FakeRepropagation(module, graph, overwrite).run(*inputs)


@dataclasses.dataclass(frozen=True)
class GraphSnapshot:
    """A copy of a graph, and which original placeholder each copied placeholder stands for."""

    copy: fx.Graph
    placeholders: dict[fx.Node, fx.Node]


def snapshot_graph(graph: fx.Graph) -> GraphSnapshot:
    """A copy of ``graph`` that ``restore_graph`` can put back."""
    copy = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    result, output_node = copy.graph_copy(graph, value_map, return_output_node=True)
    copy.output(result).meta = dict(output_node.meta)
    placeholders = {value_map[n]: n for n in graph.nodes if n.op == "placeholder"}
    return GraphSnapshot(copy, placeholders)


def restore_graph(graph: fx.Graph, snapshot: GraphSnapshot) -> None:
    """Make ``graph`` equal to the snapshot again, keeping its original placeholder nodes."""
    originals = set(snapshot.placeholders.values())
    present = set(graph.nodes)
    missing = sorted(n.name for n in originals if n not in present)
    if missing:
        raise RuntimeError(f"cannot roll back: graph inputs {missing} were removed by the pass")
    doomed = [n for n in graph.nodes if n not in originals]
    for node in doomed:  # drop every use edge first, so erase order cannot matter
        node.args, node.kwargs = (), {}
    for node in doomed:
        graph.erase_node(node)
    value_map: dict[fx.Node, fx.Node] = {}
    for copied, original in snapshot.placeholders.items():
        original.meta = dict(copied.meta)
        value_map[copied] = original
    for node in snapshot.copy.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], value_map.__getitem__)).meta = dict(node.meta)
        else:
            value_map[node] = graph.node_copy(node, value_map.__getitem__)

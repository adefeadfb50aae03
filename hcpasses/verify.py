"""Graph checks and rollback used by the manager after every pass.

``verify_graph`` lints the graph and re-propagates shapes with fake tensors: a node is run again on
its inputs' fake values, and the result must have the shape and dtype the node's ``meta["val"]``
records. A pass that wires a full-size tensor into a sharded one, or forgets to set ``meta["val"]``
consistently, fails here instead of producing a wrong program. Given the :class:`GraphState` from
before the pass, only what the pass touched is run again: nodes it added, nodes whose target,
arguments or recorded value it changed, and the users of a node with a new value. The nodes it left
alone were consistent before the pass and still read the same values, so by induction this proves
what re-running every node would, for the cost of the nodes touched (a full fake propagation of a
377-node mHC graph took 0.14 s on CPU; the manager checks after every pass, on every rank's graph).

For a pass that resizes values (the SP rewrite) the manager first re-propagates the fake values of what it
touched (:func:`refresh_fake_values`) and then verifies from the state that propagation left: every value in
it is what its inputs give, so only what changed after it is run again.

``restore_graph`` puts a graph back as it was in a :class:`GraphState` (taken before a failed pass). FX has no
transaction API, so the state keeps each node's name, type and a shallow copy of its meta besides what
:meth:`GraphState.touched` compares, and the restore rebuilds the nodes from it; taking it costs a dict
per node, not a graph copy (``Graph.graph_copy`` before each pass cost 15 ms per rank graph, 4 passes per
graph). Placeholders are kept as the very same nodes (passes must not touch graph inputs) so Inductor sees
the inputs it expects.
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
    elif isinstance(recorded, (list, tuple)):
        raise GraphVerificationError(
            f"node {node.name}: recorded a {type(recorded).__name__}, re-propagation gave {type(fresh)}"
        )


class _FakeRepropagation(fx.Interpreter):
    """Runs the graph on fake tensors; checks each result against the node's recorded meta
    (``overwrite=False``) or records it (``overwrite=True``; a recorded value of the same metadata stays, so
    that :meth:`GraphState.touched` sees only the values that changed)."""

    def __init__(self, module: fx.GraphModule, graph: fx.Graph, overwrite: bool) -> None:
        super().__init__(module, garbage_collect_values=True, graph=graph)
        self.overwrite = overwrite

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as err:  # e.g. a sharded operand meeting a full-size one: name the node
            raise GraphVerificationError(f"node {n.name} ({n.target}): its inputs do not propagate: {err}") from err
        if n.op in ("placeholder", "output"):
            return result
        recorded = n.meta.get("val")
        if recorded is None or (self.overwrite and not _same_metadata(recorded, result)):
            n.meta["val"] = result
        elif not self.overwrite:
            _check_value(n, recorded, result)
        return result


def _same_metadata(recorded: Any, fresh: Any) -> bool:
    """Whether two fake values are interchangeable as a node's record: dtype, device, shape and strides."""
    if isinstance(recorded, torch.Tensor) and isinstance(fresh, torch.Tensor):
        return (
            recorded.dtype == fresh.dtype
            and recorded.device == fresh.device
            and recorded.dim() == fresh.dim()
            and all(_same_dims(a, b) for a, b in zip(recorded.shape, fresh.shape, strict=True))
            and all(_same_dims(a, b) for a, b in zip(recorded.stride(), fresh.stride(), strict=True))
        )
    if isinstance(recorded, (list, tuple)) and isinstance(fresh, (list, tuple)):
        return len(recorded) == len(fresh) and all(map(_same_metadata, recorded, fresh))
    return type(recorded) is int and type(fresh) is int and recorded == fresh


@dataclasses.dataclass(frozen=True)
class GraphState:
    """What a pass can change in a graph, held by reference: per node its op, target, argument tuples and
    recorded fake value. FX replaces a node's argument tuple whenever an input changes, so identity tells
    whether anything changed; values are never compared by ``==`` (fake tensors and SymInts would compute,
    and a SymInt comparison may add a guard). ``saved`` holds the rest :func:`restore_graph` needs."""

    nodes: dict[fx.Node, tuple[Any, ...]]
    saved: dict[fx.Node, tuple[str, Any, dict[str, Any]]]  # name, type, meta (a shallow copy): for restore_graph

    def structure_differs(self, graph: fx.Graph) -> bool:
        """Whether ``graph`` has other nodes, in another order, or a node another target or other arguments,
        than recorded (a changed fake value alone is not a change of the program)."""
        if len(graph.nodes) != len(self.nodes):
            return True
        return any(
            node is not recorded or not _same_items(_node_entry(node)[:4], self.nodes[node][:4])
            for node, recorded in zip(graph.nodes, self.nodes, strict=True)
        )

    def touched(self, graph: fx.Graph) -> list[fx.Node]:
        """The nodes of ``graph`` to run again (see the module docstring), in graph order."""
        changed = {node for node in graph.nodes if not _same_items(_node_entry(node), self.nodes.get(node, ()))}
        new_values = [node for node in changed if node not in self.nodes or _value(node) is not self.nodes[node][4]]
        changed.update(user for node in new_values for user in node.users)
        return [node for node in graph.nodes if node in changed]


def _value(node: fx.Node) -> Any:
    return node.meta.get("val")


def _node_entry(node: fx.Node) -> tuple[Any, ...]:
    return (node.op, node.target, node.args, node.kwargs, _value(node))


def _same_items(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def graph_state(graph: fx.Graph) -> GraphState:
    """The state of ``graph`` now, for :meth:`GraphState.structure_differs` and ``verify_graph(since=...)``."""
    nodes = list(graph.nodes)
    return GraphState(
        {node: _node_entry(node) for node in nodes}, {node: (node.name, node.type, dict(node.meta)) for node in nodes}
    )


def verify_graph(graph: fx.Graph, since: GraphState | None = None) -> None:
    """Lint ``graph`` and re-propagate fake shapes: every node, or with ``since`` the nodes a pass touched
    since that state. Raise ``GraphVerificationError`` on a mismatch."""
    try:
        graph.lint()
    except Exception as err:  # lint raises bare RuntimeErrors; give them one type
        raise GraphVerificationError(f"graph lint failed: {err}") from err
    if since is None or not _rerun(graph, since.touched(graph)):
        _propagate(graph, overwrite=False)


def _rerun(graph: fx.Graph, nodes: list[fx.Node], overwrite: bool = False) -> bool:
    """Run ``nodes`` again on their inputs' recorded fake values, checking (or filling in) each result; with
    ``overwrite``, record each result, and run the users of every value that changed in turn.

    False when that cannot be done (an input without a recorded value): the caller propagates the whole graph.
    """
    inputs = [_value(n) for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(inputs) if all(v is not None for v in inputs) else None
    module = graph.owning_module
    if fake_mode is None or module is None:
        return False
    interpreter = _FakeRepropagation(module, graph, overwrite)
    pending = set(nodes)
    with fake_mode:
        for node in graph.nodes:
            if node not in pending or node.op == "placeholder":  # passes keep the inputs; only a whole run feeds them
                continue
            for arg in node.all_input_nodes:
                if _value(arg) is None:
                    return False
                interpreter.env[arg] = _value(arg)
            recorded = _value(node)
            interpreter.run_node(node)
            if _value(node) is not recorded:
                pending.update(node.users)
    return True


def refresh_fake_values(graph: fx.Graph, since: GraphState | None = None) -> GraphState | None:
    """Recompute ``meta["val"]`` from the placeholders' fake values after a rewrite: of every node, or with
    ``since`` (the state before the rewrite) of the nodes touched since and, in turn, of the users of every
    value that changed (an SP rewrite leaves the sub-layers' values as they were: they read gathered rows).

    Returns the graph's state right after (the manager verifies what changed since), or ``None`` where the
    graph carries no fake values to propagate from. Raises ``GraphVerificationError`` naming a node whose
    inputs no longer give a value (a sharded operand meeting a full-size one).
    """
    if since is not None and _rerun(graph, since.touched(graph), overwrite=True):
        return graph_state(graph)
    return graph_state(graph) if _propagate(graph, overwrite=True) else None


def _propagate(graph: fx.Graph, overwrite: bool) -> bool:
    """Run the whole graph on its placeholders' fake values; False where it has none to run on."""
    inputs = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    if any(value is None for value in inputs):
        return False  # graphs built by hand in tests may carry no fake values; lint is all we can do
    fake_mode = detect_fake_mode(inputs)
    module = graph.owning_module
    if fake_mode is None or module is None:
        return False
    with fake_mode:
        _FakeRepropagation(module, graph, overwrite).run(*inputs)
    return True


def restore_graph(graph: fx.Graph, state: GraphState) -> None:
    """Make ``graph`` what it was in ``state`` again (new node objects), keeping its original placeholder nodes."""
    originals = [node for node, entry in state.nodes.items() if entry[0] == "placeholder"]
    present = set(graph.nodes)
    missing = sorted(n.name for n in originals if n not in present)
    if missing:
        raise RuntimeError(f"cannot roll back: graph inputs {missing} were removed by the pass")
    kept = set(originals)
    doomed = [n for n in graph.nodes if n not in kept]
    for node in doomed:  # drop every use edge first, so erase order cannot matter
        node.args, node.kwargs = (), {}
    for node in doomed:
        graph.erase_node(node)
    value_map: dict[fx.Node, fx.Node] = {node: node for node in originals}
    for node, (op, target, args, kwargs, _) in state.nodes.items():
        name, type_, meta = state.saved[node]
        if op == "placeholder":
            node.meta = dict(meta)
            continue
        args, kwargs = fx.map_arg(args, value_map.__getitem__), fx.map_arg(kwargs, value_map.__getitem__)
        if op == "output":
            restored = graph.output(args[0], type_)
        else:
            restored = graph.create_node(op, target, args, kwargs, name, type_)
        restored.meta = dict(meta)
        value_map[node] = restored

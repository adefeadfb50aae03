"""``hcpasses.verify`` on small traced graphs, without Inductor: what a state records, what verification runs
again and catches, what a refresh records, and what a rollback restores (kwargs, several users, several outputs).

These are the fast tests the mutation run (docs/TESTING.md) uses for ``verify.py``.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from harness.graphs import first_node, node_program, traced
from torch.fx.experimental.proxy_tensor import make_fx

from hcpasses.verify import (
    GraphState,
    GraphVerificationError,
    graph_state,
    refresh_fake_values,
    restore_graph,
    verify_graph,
)

aten = torch.ops.aten


def with_kwargs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kwargs in the traced graph (``dtype=``, ``correction=``), a node with several users, one with two outputs."""
    y = torch.relu(x @ w)
    total = torch.sum(y, dim=1, keepdim=True, dtype=torch.float64)
    mean, var = torch.var_mean(y, dim=0, correction=0)
    return total, y * 2 + y.exp(), mean + var


def test_state_of_an_unchanged_graph_differs_in_nothing() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    assert not state.structure_differs(graph)
    assert state.touched(graph) == []
    assert set(state.nodes) == set(graph.nodes) == set(state.saved)


def test_each_kind_of_change_is_a_structural_change() -> None:
    """A new node, a new target, new kwargs, new args, another order: each is a change; a node added and erased
    again is none."""
    changes = [
        lambda g, relu: relu.append(g.call_function(aten.neg.default, (relu,))),
        lambda g, relu: setattr(relu, "target", aten.abs.default),
        lambda g, relu: setattr(first_node(g, aten.sum.dim_IntList), "kwargs", {"dtype": torch.float32}),
        lambda g, relu: first_node(g, aten.exp.default).replace_input_with(relu, first_node(g, aten.mm.default)),
        lambda g, relu: first_node(g, aten.exp.default).prepend(first_node(g, aten.var_mean.correction)),
        lambda g, relu: g.erase_node(g.call_function(aten.neg.default, (relu,))) or None,
    ]
    for index, change in enumerate(changes):
        graph = traced(with_kwargs).graph
        state = graph_state(graph)
        change(graph, first_node(graph, aten.relu.default))
        assert state.structure_differs(graph) is (index != 5), index  # the last adds and removes: no change


def test_a_new_value_alone_is_not_a_structural_change_but_is_touched_with_its_users() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    relu = first_node(graph, aten.relu.default)
    relu.meta["val"] = relu.meta["val"][:2]
    assert not state.structure_differs(graph)
    touched = state.touched(graph)
    assert touched[0] is relu and set(touched) == {relu, *relu.users}
    assert touched == [n for n in graph.nodes if n in set(touched)]  # graph order
    with pytest.raises(GraphVerificationError, match=r"node relu .*meta records \(2, 6\)"):
        verify_graph(graph, since=state)


def test_a_rewired_node_is_touched_but_its_users_only_if_its_value_changed() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    exp = first_node(graph, aten.exp.default)
    exp.replace_input_with(first_node(graph, aten.relu.default), first_node(graph, aten.mm.default))
    assert state.touched(graph) == [exp]


def test_verify_checks_every_node_without_a_state() -> None:
    graph = traced(with_kwargs).graph
    verify_graph(graph)
    mul = first_node(graph, aten.mul.Tensor)
    mul.meta["val"] = mul.meta["val"].to(torch.float16)  # wrong dtype only
    with pytest.raises(GraphVerificationError, match="float16"):
        verify_graph(graph)


def test_verify_catches_a_wrong_number_of_outputs() -> None:
    graph = traced(with_kwargs).graph
    var_mean = first_node(graph, aten.var_mean.correction)
    var_mean.meta["val"] = var_mean.meta["val"][:1]
    with pytest.raises(GraphVerificationError, match="node var_mean: 1 outputs recorded, 2 now"):
        verify_graph(graph)


@pytest.mark.parametrize("kind", ["tensor recorded, tuple now", "tuple recorded, tensor now"])
def test_verify_catches_a_value_of_another_kind(kind: str) -> None:
    graph = traced(with_kwargs).graph
    relu = first_node(graph, aten.relu.default)
    if kind.startswith("tensor"):
        relu.target = aten.var_mean.correction  # two tensors where one was recorded
        match = "node relu: recorded a tensor, re-propagation gave <class 'tuple'>"
    else:
        relu.meta["val"] = (relu.meta["val"], relu.meta["val"])
        match = "node relu: recorded a tuple, re-propagation gave <class 'torch._subclasses.fake_tensor.FakeTensor'>"
    with pytest.raises(GraphVerificationError, match=match):
        verify_graph(graph)


def test_verify_lint_failure_is_a_verification_error() -> None:
    graph = traced(with_kwargs).graph
    relu = first_node(graph, aten.relu.default)
    mm = first_node(graph, aten.mm.default)
    mm.args = (relu, *mm.args[1:])  # uses a value defined after it
    with pytest.raises(GraphVerificationError, match="graph lint failed"):
        verify_graph(graph)


def test_verify_fills_in_a_missing_value_of_a_new_node() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        neg = graph.call_function(aten.neg.default, (relu,))
    verify_graph(graph, since=state)
    assert neg.meta["val"].shape == relu.meta["val"].shape


def test_verify_without_fake_values_only_lints() -> None:
    graph = fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph  # no meta["val"] anywhere
    verify_graph(graph)
    verify_graph(graph, since=graph_state(graph))
    assert refresh_fake_values(graph) is None


def test_refresh_records_what_the_inputs_give_and_returns_the_state_after() -> None:
    graph = traced(with_kwargs).graph
    before = graph_state(graph)
    relu, exp = first_node(graph, aten.relu.default), first_node(graph, aten.exp.default)
    with graph.inserting_after(relu):
        neg = graph.call_function(aten.neg.default, (relu,))
    exp.replace_input_with(relu, neg)
    exp_value = exp.meta["val"]
    state = refresh_fake_values(graph, since=before)
    assert isinstance(state, GraphState) and not state.structure_differs(graph) and state.touched(graph) == []
    assert tuple(neg.meta["val"].shape) == (5, 6)
    assert exp.meta["val"] is exp_value  # the same metadata: the record stays, so its users are not run again
    mm_value = first_node(graph, aten.mm.default).meta["val"]
    full = refresh_fake_values(graph)  # every node
    assert full is not None and not full.structure_differs(graph)
    assert first_node(graph, aten.mm.default).meta["val"] is mm_value


def test_refresh_runs_users_of_changed_values_in_turn() -> None:
    graph = traced(with_kwargs).graph
    before = graph_state(graph)
    mm, relu = first_node(graph, aten.mm.default), first_node(graph, aten.relu.default)
    with graph.inserting_after(mm):
        rows = graph.call_function(aten.slice.Tensor, (mm, 0, 0, 3))
    relu.args = (rows,)
    refresh_fake_values(graph, since=before)
    # relu, then mul / exp / sum / var_mean, then add: every value downstream of the change now has 3 rows
    assert tuple(first_node(graph, aten.add.Tensor).meta["val"].shape) == (3, 6)
    assert tuple(first_node(graph, aten.sum.dim_IntList).meta["val"].shape) == (3, 1)
    verify_graph(graph)


def test_restore_keeps_kwargs_users_and_outputs_and_the_graph_computes_the_same() -> None:
    module = traced(with_kwargs)
    graph = module.graph
    x, w = torch.randn(5, 4), torch.randn(4, 6)
    expected = with_kwargs(x, w)
    program, placeholders = node_program(graph), [n for n in graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in graph.nodes]
    metas = [dict(n.meta) for n in graph.nodes]
    state = graph_state(graph)
    # A pass that drops kwargs, changes the multi-output op's, rewires a node with several users, erases one
    first_node(graph, aten.sum.dim_IntList).kwargs = {}
    first_node(graph, aten.var_mean.correction).kwargs = {"correction": 1}
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        neg = graph.call_function(aten.neg.default, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    relu.meta["extra"] = "changed"
    output = graph.output_node()
    dropped = output.args[0][1]
    output.args = ((output.args[0][0], neg, output.args[0][2]),)
    graph.erase_node(dropped)
    assert node_program(graph) != program
    restore_graph(graph, state)
    graph.lint()
    assert node_program(graph) == program  # names may take a suffix: compared by position
    assert [n for n in graph.nodes if n.op == "placeholder"] == placeholders  # the very same input nodes
    assert all(n.meta.get("val") is v for n, v in zip(graph.nodes, values, strict=True))
    assert [n.meta.keys() for n in graph.nodes] == [m.keys() for m in metas]
    assert first_node(graph, aten.sum.dim_IntList).kwargs == {"dtype": torch.float64}
    assert len(first_node(graph, aten.relu.default).users) == 4  # sum, var_mean, mul, exp again
    module.recompile()
    got = module(x, w)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_restore_refuses_a_graph_whose_input_was_removed() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    x, w = (n for n in graph.nodes if n.op == "placeholder")
    w.replace_all_uses_with(x)
    graph.erase_node(w)
    with pytest.raises(RuntimeError, match=r"cannot roll back: graph inputs \['w_1'\] were removed by the pass"):
        restore_graph(graph, state)


def stale_elsewhere(graph: fx.Graph) -> fx.Node:
    """Give the ``add`` of ``y * 2 + y.exp()`` a wrong record: a node no pass touched, which incremental checks
    must not run again."""
    add = next(n for n in graph.nodes if n.target == aten.add.Tensor)
    add.meta["val"] = add.meta["val"][:1]
    return add


def test_verification_since_a_state_runs_only_what_changed() -> None:
    """A stale record on a node no pass touched is not checked again (a full run would fail on it): the check
    costs the touched nodes, not the graph. A rewired node whose value stays the same does not pull in its users."""
    graph = traced(with_kwargs).graph
    stale_elsewhere(graph)
    with pytest.raises(GraphVerificationError):
        verify_graph(graph)  # the whole graph: the stale record fails
    state = graph_state(graph)
    mm, exp = first_node(graph, aten.mm.default), first_node(graph, aten.exp.default)
    with graph.inserting_after(mm):
        same_rows = graph.call_function(aten.relu.default, (mm,))
    exp.replace_input_with(first_node(graph, aten.relu.default), same_rows)
    verify_graph(graph, since=state)  # runs the new relu and exp; exp's value stands, so not its user (the stale add)
    assert tuple(same_rows.meta["val"].shape) == (5, 6)


def test_refresh_since_a_state_leaves_untouched_records_alone() -> None:
    graph = traced(with_kwargs).graph
    add = stale_elsewhere(graph)
    stale = add.meta["val"]
    state = graph_state(graph)
    mm = first_node(graph, aten.mm.default)
    with graph.inserting_after(mm):
        neg = graph.call_function(aten.neg.default, (mm,))
    assert refresh_fake_values(graph, since=state) is not None
    assert add.meta["val"] is stale and tuple(neg.meta["val"].shape) == (5, 6)
    refresh_fake_values(graph)  # every node: the stale record is replaced by what its inputs give
    assert tuple(add.meta["val"].shape) == (5, 6)


def test_a_placeholder_given_a_new_record_is_read_not_run() -> None:
    graph = traced(with_kwargs).graph
    state = graph_state(graph)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    x.meta["val"] = x.meta["val"].clone()  # a new object, same metadata: x and its users are touched
    assert x in state.touched(graph)
    verify_graph(graph, since=state)
    assert refresh_fake_values(graph, since=state) is not None


def test_refresh_records_a_value_of_another_kind_or_size() -> None:
    """A tuple's elements changing size, an int changing, one output becoming two, two becoming one."""
    graph = traced(with_kwargs).graph
    relu, var_mean = first_node(graph, aten.relu.default), first_node(graph, aten.var_mean.correction)
    mm = first_node(graph, aten.mm.default)
    with graph.inserting_after(mm):
        columns = graph.call_function(aten.slice.Tensor, (mm, 1, 0, 3))
    relu.args = (columns,)
    with graph.inserting_before(graph.output_node()):
        number = graph.call_function(operator.add, (2, 3))
    number.meta["val"] = 99
    refresh_fake_values(graph)
    assert tuple(var_mean.meta["val"][0].shape) == (3,) and number.meta["val"] == 5
    assert tuple(relu.meta["val"].shape) == (5, 3)
    kept = var_mean.meta["val"]
    refresh_fake_values(graph)
    assert var_mean.meta["val"] is kept  # the same metadata again: the record stays
    graph = traced(lambda x, w: (x @ w).neg()).graph
    neg = first_node(graph, aten.neg.default)
    neg.target = aten.var_mean.correction  # a tensor recorded, a tuple comes
    refresh_fake_values(graph)
    assert isinstance(neg.meta["val"], tuple) and len(neg.meta["val"]) == 2
    graph = traced(lambda x: x.neg(), (2, 3)).graph
    neg = first_node(graph, aten.neg.default)
    neg.meta["val"] = tuple(neg.meta["val"])  # two [3] rows recorded where one [2, 3] tensor comes
    refresh_fake_values(graph)
    assert isinstance(neg.meta["val"], torch.Tensor) and tuple(neg.meta["val"].shape) == (2, 3)


def test_verification_of_a_tuple_names_the_node_and_checks_each_element() -> None:
    graph = traced(with_kwargs).graph
    var_mean = first_node(graph, aten.var_mean.correction)
    var, mean = var_mean.meta["val"]
    var_mean.meta["val"] = (var, mean[:2])
    with pytest.raises(
        GraphVerificationError, match=r"node var_mean \(aten.var_mean.correction\): meta records \(2,\)"
    ):
        verify_graph(graph)


def test_symbolic_sizes_verify_and_a_static_record_of_one_does_not() -> None:
    module = make_fx(with_kwargs, tracing_mode="symbolic")(torch.randn(5, 4), torch.randn(4, 6))
    graph = module.graph
    verify_graph(graph)
    state = graph_state(graph)
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        graph.call_function(aten.neg.default, (relu,))
    verify_graph(graph, since=state)
    exp = first_node(graph, aten.exp.default)
    exp.meta["val"] = torch.empty(5, 6, device="meta")  # static sizes where the inputs give symbolic ones
    with pytest.raises(GraphVerificationError, match="node exp"):
        verify_graph(graph)


def test_a_graph_without_a_module_is_linted_only() -> None:
    owned = traced(with_kwargs).graph
    loose = fx.Graph()
    loose.graph_copy(owned, {})  # fake values copied, no owning module to run them with
    assert loose.owning_module is None
    verify_graph(loose)
    verify_graph(loose, since=graph_state(loose))
    assert refresh_fake_values(loose) is None
    assert refresh_fake_values(loose, since=graph_state(loose)) is None


def test_restore_keeps_custom_names_and_type_annotations() -> None:
    graph = traced(with_kwargs).graph
    relu = first_node(graph, aten.relu.default)
    relu.name = "custom_activation"
    relu.type = torch.Tensor
    graph.output_node().type = tuple
    state = graph_state(graph)
    relu.target = aten.abs.default
    restore_graph(graph, state)
    restored = first_node(graph, aten.relu.default)
    assert restored.name.startswith("custom_activation") and restored.type is torch.Tensor
    assert graph.output_node().type is tuple

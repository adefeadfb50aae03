"""The side-effect audit of ``harness.side_effects`` can fail: each way a pass could change a graph's side effects
is caught, and what the SP record accounts for is accepted."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from harness.side_effects import check_side_effects, side_effects

from hcpasses.report import GraphReport, PassRecord

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def graph_with_effects() -> tuple[fx.Graph, dict[str, fx.Node]]:
    graph = fx.Graph()
    x, cache, buf = (graph.placeholder(name) for name in ("x", "cache", "buf"))
    reduced = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
    write = graph.call_function(aten.copy_.default, (cache, waited))
    bump = graph.call_function(aten.add_.Tensor, (buf, 1))
    noise = graph.call_function(aten.rand_like.default, (x,))
    graph.output((graph.call_function(aten.add.Tensor, (waited, noise)),))
    return graph, {"reduced": reduced, "waited": waited, "write": write, "bump": bump, "noise": noise, "x": x}


def report(sp: PassRecord | None = None) -> GraphReport:
    return GraphReport(index=0, passes=[sp] if sp else [])


def sp_record(reduces: int, gathers: int) -> PassRecord:
    note = f"collectives: {reduces} all-reduce -> reduce-scatter; {gathers} all-gathers added"
    return PassRecord("sp_rewrite", "applied", 1, notes=("HC blocks found: 1", note))


def test_side_effects_are_mutations_rng_in_order_and_collectives_by_op() -> None:
    graph, _ = graph_with_effects()
    effects = side_effects(graph)
    assert effects.ordered == ("aten.copy_.default", "aten.add_.Tensor", "aten.rand_like.default")
    assert effects.collectives == {"_c10d_functional::all_reduce": 1, "_c10d_functional::wait_tensor": 1}
    check_side_effects(effects, side_effects(graph), report())


@pytest.mark.parametrize("change", ["drop a mutation", "reorder mutations", "drop rng", "add a collective"])
def test_each_change_of_a_side_effect_is_caught(change: str) -> None:
    graph, nodes = graph_with_effects()
    before = side_effects(graph)
    if change == "drop a mutation":
        graph.erase_node(nodes["bump"])
    elif change == "reorder mutations":
        nodes["write"].prepend(nodes["bump"])
    elif change == "drop rng":
        nodes["noise"].replace_all_uses_with(nodes["x"])
        graph.erase_node(nodes["noise"])
    else:
        with graph.inserting_after(nodes["waited"]):
            graph.call_function(c10d.all_gather_into_tensor.default, (nodes["x"], 2, "0"))
    with pytest.raises(AssertionError):
        check_side_effects(before, side_effects(graph), report())


def add_sp_collectives(graph: fx.Graph, nodes: dict[str, fx.Node], gathers: int) -> None:
    nodes["reduced"].target = c10d.reduce_scatter_tensor.default
    nodes["reduced"].args = (nodes["x"], "sum", 2, "0")
    for _ in range(gathers):
        with graph.inserting_after(nodes["waited"]):
            gathered = graph.call_function(c10d.all_gather_into_tensor.default, (nodes["x"], 2, "0"))
        with graph.inserting_after(gathered):
            graph.call_function(c10d.wait_tensor.default, (gathered,))


def test_what_the_sp_record_accounts_for_is_accepted_and_nothing_else() -> None:
    graph, nodes = graph_with_effects()
    before = side_effects(graph)
    add_sp_collectives(graph, nodes, gathers=2)
    after = side_effects(graph)
    check_side_effects(before, after, report(sp_record(1, 2)))
    for wrong in (sp_record(1, 1), sp_record(0, 2), sp_record(2, 2)):
        with pytest.raises(AssertionError, match="collectives"):
            check_side_effects(before, after, report(wrong))
    with pytest.raises(AssertionError, match="collectives"):  # SP not applied: no collective may change
        check_side_effects(before, after, report(PassRecord("sp_rewrite", "rolled_back")))
    silent = PassRecord("sp_rewrite", "applied", 1, notes=("HC blocks found: 1",))
    with pytest.raises(AssertionError, match="names no collective counts"):
        check_side_effects(before, after, report(silent))

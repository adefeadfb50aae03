"""The pass manager inside real Inductor compiles: order, reports, verification, rollback, dumps, cache key.

The passes here are test doubles registered under the real pass names, so the manager treats them
exactly as it will treat the real ones.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from harness import passes_run_every_compile
from harness.graphs import first_node, node_program
from torch.fx.experimental.proxy_tensor import make_fx

import hcpasses
from hcpasses.backend import HCPassesBackend
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.manager import PassManager
from hcpasses.passes.cleanup import DeadCodeCleanup
from hcpasses.verify import GraphVerificationError, graph_state, restore_graph, verify_graph

aten = torch.ops.aten


def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) * 2.0 + x


def fresh_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # A fresh width per call gives a graph no earlier test (or run) put in Inductor's cache.
    width = random.randint(3, 10_000)
    return torch.randn(5, width), torch.randn(width, width)


class AddUnusedNode(GraphPass):
    """Leaves an unused ``mul`` behind, as a real rewrite can; the cleanup pass must erase it."""

    name = "gated_mean_quant"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        relu = first_node(graph, aten.relu.default)
        with graph.inserting_after(relu):
            dead = graph.call_function(aten.mul.Tensor, (relu, 3.0))
        dead.meta["val"] = relu.meta["val"] * 3.0
        return PassResult(applied=1, notes=("left one unused mul",))


class SwapReluForAbsThenRaise(GraphPass):
    """Changes the graph, then fails: the change must be undone."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        relu = first_node(graph, aten.relu.default)
        relu.target = aten.abs.default
        raise RuntimeError("no HC block here to shard")


class BreakShapes(GraphPass):
    """Feeds half the rows into the add: the fake re-propagation must catch it."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        relu = first_node(graph, aten.relu.default)
        with graph.inserting_after(relu):
            half = graph.call_function(aten.slice.Tensor, (relu, 0, 0, 2))
        for user in list(relu.users):
            if user is not half:
                user.replace_input_with(relu, half)
        return PassResult(applied=1)


class SilentChange(GraphPass):
    """Changes the graph but reports no rewrite: a broken contract, rolled back."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        first_node(graph, aten.relu.default).target = aten.abs.default
        return PassResult(applied=0, reason="nothing to do")


class StaleValue(GraphPass):
    """Changes no node, only the relu's recorded value (half the rows): the re-propagation must catch it."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        relu = first_node(graph, aten.relu.default)
        relu.meta["val"] = relu.meta["val"][:2]
        return PassResult(applied=0, reason="nothing to do")


class ResizeBeyondRepair(BreakShapes):
    """A pass that resizes values (so the manager re-propagates them instead of checking the old records), but
    to half the rows beside the full rows of x in the add: no propagation can give that a value."""

    resizes_values = True


class CountWithoutChange(GraphPass):
    """Reports rewrites but leaves the graph as it was: a report that lies, rolled back."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        return PassResult(applied=3)


class CountCalls(GraphPass):
    name = "gated_mean_quant"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        self.calls += 1
        return PassResult(applied=0, reason="no HC block")


def compile_and_run(be: HCPassesBackend, dynamic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Compile with Inductor's graph caches off, so the passes run (with dynamic=True fresh sizes don't help)."""
    torch._dynamo.reset()
    x, w = fresh_inputs()
    with passes_run_every_compile():
        compiled = torch.compile(model, backend=be, dynamic=dynamic)
        return compiled(x, w), model(x, w)


def make_backend(*passes: GraphPass, **flags: object) -> HCPassesBackend:
    return HCPassesBackend(HCPassesConfig.resolve(env={}, **flags), passes=passes)


def test_passes_run_in_pipeline_order_and_report_counts() -> None:
    be = make_backend(AddUnusedNode(), DeadCodeCleanup())
    out, expected = compile_and_run(be)
    torch.testing.assert_close(out, expected)
    (report,) = be.reports
    names = ["canonical_forms", "gated_mean_quant", "sp_rewrite", "blocked_scans", "cleanup"]
    assert [r.name for r in report.passes] == names
    assert report.applied == {
        "canonical_forms": 0,
        "gated_mean_quant": 1,
        "sp_rewrite": 0,
        "blocked_scans": 0,
        "cleanup": 1,
    }
    assert report.record("sp_rewrite").status == "unavailable"
    assert report.record("blocked_scans").status == "unavailable"
    assert report.record("canonical_forms").status == "unavailable"
    assert report.record("gated_mean_quant").notes == ("left one unused mul",)
    assert report.num_nodes_after == report.num_nodes_before
    text = str(report)
    assert "gated_mean_quant" in text and "applied=1" in text and "left one unused mul" in text


def test_disabled_pass_does_not_run_and_says_so() -> None:
    counter = CountCalls()
    be = make_backend(counter, gated_mean_quant=False)
    compile_and_run(be)
    assert counter.calls == 0
    record = be.reports[0].record("gated_mean_quant")
    assert record.status == "disabled"
    assert "gated_mean_quant=False" in record.reason


def test_env_disable_turns_a_pass_off_in_a_compile(monkeypatch) -> None:
    monkeypatch.setenv("HCPASSES_DISABLE", "gated_mean_quant")
    counter = CountCalls()
    be = HCPassesBackend(HCPassesConfig.resolve(), passes=[counter])
    compile_and_run(be)
    assert counter.calls == 0
    assert be.reports[0].record("gated_mean_quant").status == "disabled"


def test_unchanged_pass_reports_its_reason() -> None:
    be = make_backend(CountCalls())
    compile_and_run(be)
    assert be.reports[0].reasons["gated_mean_quant"] == "no HC block"
    assert be.reports[0].record("gated_mean_quant").status == "unchanged"


@pytest.mark.parametrize(
    ("bad_pass", "reason"),
    [
        (SwapReluForAbsThenRaise(), "RuntimeError: no HC block here to shard"),
        (BreakShapes(), "node"),
        (StaleValue(), "node relu"),
        (ResizeBeyondRepair(), "node add"),
        (SilentChange(), "changed the graph but reported 0 rewrites"),
        (CountWithoutChange(), "reported 3 rewrite(s) but left the graph unchanged"),
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_failing_pass_is_rolled_back(bad_pass: GraphPass, reason: str, dynamic: bool, caplog) -> None:
    be = make_backend(AddUnusedNode(), bad_pass, DeadCodeCleanup())
    out, expected = compile_and_run(be, dynamic=dynamic)
    # abs instead of relu, or half the rows, would make these differ: the rollback restored the graph
    torch.testing.assert_close(out, expected)
    record = be.reports[0].record("sp_rewrite")
    assert record.status == "rolled_back"
    assert record.applied == 0
    assert reason in record.reason
    # the passes around it still ran on the restored graph
    assert be.reports[0].applied["gated_mean_quant"] == 1
    assert be.reports[0].applied["cleanup"] == 1
    assert any("rolled back" in r.getMessage() for r in caplog.records if r.name == "hcpasses")


def test_verification_accepts_a_correct_rewrite_with_symbolic_shapes() -> None:
    """statically_known_true on symbolic sizes (an internal helper) must not flag equal shapes."""
    be = make_backend(AddUnusedNode(), DeadCodeCleanup())
    out, expected = compile_and_run(be, dynamic=True)
    torch.testing.assert_close(out, expected)
    assert be.reports[0].record("gated_mean_quant").status == "applied"
    assert be.reports[0].record("cleanup").status == "applied"


def test_verification_reruns_only_what_a_pass_touched() -> None:
    """Nodes a pass added or re-wired, and the users of a node with a new value; nothing for an unchanged graph."""
    graph = make_fx(model, tracing_mode="fake")(*fresh_inputs()).graph
    state = graph_state(graph)
    assert state.touched(graph) == [] and not state.structure_differs(graph)
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        dead = graph.call_function(aten.mul.Tensor, (relu, 3.0))
    assert state.structure_differs(graph) and state.touched(graph) == [dead]
    verify_graph(graph, since=state)  # runs the new node, so records its value
    assert dead.meta["val"].shape == relu.meta["val"].shape
    state = graph_state(graph)
    relu.meta["val"] = relu.meta["val"][:2]  # a record that its inputs no longer give
    assert not state.structure_differs(graph)
    touched = state.touched(graph)  # in graph order
    assert touched[0] is relu and set(touched) == {relu, *relu.users} and len(touched) == 3
    with pytest.raises(GraphVerificationError, match="node relu"):
        verify_graph(graph, since=state)
    relu.meta["val"] = state.nodes[relu][4]
    state = graph_state(graph)
    dead.next.append(dead)  # the same nodes in another order: a change of the program
    assert state.structure_differs(graph) and state.touched(graph) == []


def test_restore_graph_undoes_erased_rewired_new_and_retargeted_nodes() -> None:
    graph = make_fx(model, tracing_mode="fake")(*fresh_inputs()).graph
    program, placeholders = node_program(graph), [n for n in graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in graph.nodes]
    state = graph_state(graph)
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        neg = graph.call_function(aten.neg.default, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    first_node(graph, aten.mm.default).target = aten.bmm.default
    relu.meta["val"] = None
    mul = first_node(graph, aten.mul.Tensor)
    first_node(graph, aten.add.Tensor).replace_input_with(mul, neg)
    graph.erase_node(mul)
    assert node_program(graph) != program
    restore_graph(graph, state)
    graph.lint()
    assert node_program(graph) == program  # restored nodes are new objects, their names may take a suffix
    assert [n for n in graph.nodes if n.op == "placeholder"] == placeholders  # the very same input nodes
    assert all(n.meta.get("val") is value for n, value in zip(graph.nodes, values, strict=True))


def test_dumps_only_for_passes_that_changed_the_graph(tmp_path) -> None:
    be = make_backend(AddUnusedNode(), SwapReluForAbsThenRaise(), DeadCodeCleanup(), dump_dir=str(tmp_path))
    compile_and_run(be)
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["graph_000"]
    files = sorted(p.name for p in (tmp_path / "graph_000").iterdir())
    assert files == [
        "2_gated_mean_quant.after.py",
        "2_gated_mean_quant.before.py",
        "2_gated_mean_quant.diff",
        "5_cleanup.after.py",
        "5_cleanup.before.py",
        "5_cleanup.diff",
    ]
    diff = (tmp_path / "graph_000" / "2_gated_mean_quant.diff").read_text()
    added = [line for line in diff.splitlines() if line.startswith("+") and "torch.ops." in line]
    assert len(added) == 1 and "aten.mul.Tensor" in added[0]
    cleanup_diff = (tmp_path / "graph_000" / "5_cleanup.diff").read_text()
    assert any(line.startswith("-") and "aten.mul.Tensor" in line for line in cleanup_diff.splitlines())
    index = (tmp_path / "index.md").read_text()
    assert "graph_000" in index and "[diff](graph_000/2_gated_mean_quant.diff)" in index
    assert "rolled_back" in index
    entries = json.loads((tmp_path / "index.json").read_text())
    records = {record["name"]: record for record in entries[0]["report"]["passes"]}
    assert records["gated_mean_quant"]["applied"] == 1


def test_dumps_bypass_the_cache_and_number_graphs(tmp_path) -> None:
    x, w = fresh_inputs()
    for _ in range(2):
        be = make_backend(AddUnusedNode(), DeadCodeCleanup(), dump_dir=str(tmp_path))
        torch._dynamo.reset()
        torch.compile(model, backend=be)(x, w)
        assert not be.reports[0].cached
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["graph_000", "graph_001"]
    assert (tmp_path / "graph_001" / "2_gated_mean_quant.diff").exists()


def test_dumps_go_to_a_rank_folder_when_distributed(tmp_path) -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        be = make_backend(AddUnusedNode(), dump_dir=str(tmp_path))
        compile_and_run(be)
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "rank0" / "index.md").exists()
    assert (tmp_path / "rank0" / "graph_000" / "2_gated_mean_quant.diff").exists()


def test_uuid_changes_with_every_flag() -> None:
    base = PassManager(HCPassesConfig.resolve(env={}), on_report=lambda r: None)
    assert base.uuid() == PassManager(HCPassesConfig.resolve(env={}), on_report=lambda r: None).uuid()
    variants = [
        {"canonical_forms": False},
        {"sp_rewrite": False},
        {"gated_mean_quant": False},
        {"blocked_scans": False},
        {"cleanup": False},
        {"sp_min_tokens": 2048},
        {"dump_dir": "d"},
    ]
    uuids = {PassManager(HCPassesConfig.resolve(env={}, **v), on_report=lambda r: None).uuid() for v in variants}
    assert len(uuids) == len(variants)
    assert base.uuid() not in uuids


def test_uuid_changes_with_the_sources(monkeypatch) -> None:
    before = PassManager(HCPassesConfig.resolve(env={}), on_report=lambda r: None).uuid()
    monkeypatch.setattr("hcpasses.manager.source_hash", lambda: "edited")
    after = PassManager(HCPassesConfig.resolve(env={}), on_report=lambda r: None).uuid()
    assert before != after


def test_cache_hit_only_for_the_same_flags() -> None:
    x, w = fresh_inputs()
    expected = model(x, w)

    def compile_with(**flags: object) -> HCPassesBackend:
        torch._dynamo.reset()
        be = make_backend(AddUnusedNode(), DeadCodeCleanup(), **flags)
        torch.testing.assert_close(torch.compile(model, backend=be)(x, w), expected)
        return be

    first = compile_with()
    assert not first.reports[0].cached
    again = compile_with()
    assert again.reports[0].cached  # Inductor's FX graph cache served it
    assert again.reports[0].applied == first.reports[0].applied  # and the stored report came back
    other = compile_with(sp_min_tokens=4096)
    assert not other.reports[0].cached  # a changed flag is a changed cache key


def test_string_backend_and_default_backend() -> None:
    torch._dynamo.reset()
    x, w = fresh_inputs()
    before = len(hcpasses.default_backend().reports)
    out = torch.compile(model, backend="hcpasses")(x, w)
    torch.testing.assert_close(out, model(x, w))
    assert len(hcpasses.default_backend().reports) == before + 1


def test_pass_without_a_flag_is_refused() -> None:
    class Nameless(GraphPass):
        name = "mystery"

        def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
            return PassResult(0)

    with pytest.raises(ValueError, match="mystery"):
        make_backend(Nameless())

"""``PassManager`` called directly on traced graphs (no Inductor): order, statuses and reasons, rollback, dumps,
the cache key. Each promise of ``manager.py``'s docstring and the README's flag table has a test here; these
are the fast tests the mutation run (docs/TESTING.md) uses for ``manager.py``.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from harness.graphs import add_unused_neg, first_node, node_program, traced

import hcpasses.passes as registry
from hcpasses import manager as manager_module
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.manager import AUTOGRAD_REASON, PassManager, pass_fingerprint, source_hash
from hcpasses.passes import PassSpec, pipeline
from hcpasses.passes.cleanup import DeadCodeCleanup
from hcpasses.report import GraphReport

aten = torch.ops.aten
PASS_NAMES = ("canonical_forms", "gated_mean_quant", "sp_rewrite", "blocked_scans", "cleanup")


def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) * 2.0 + 1.0


class Spy(GraphPass):
    """Counts its calls; optionally does something to the graph first."""

    def __init__(
        self, name: str, action=None, applied: int = 0, reason: str | None = "nothing here", resizes: bool = False
    ) -> None:
        self.name = name
        self.action = action
        self.applied, self.reason = applied, reason
        self.resizes_values = resizes
        self.calls = 0

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        self.calls += 1
        if self.action:
            self.action(graph)
        return PassResult(self.applied, self.reason, ("a note",), {"fact": 1})


def swap_relu_for_abs(graph: fx.Graph) -> None:
    first_node(graph, aten.relu.default).target = aten.abs.default


def half_rows_into_the_mul(graph: fx.Graph) -> None:
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        half = graph.call_function(aten.slice.Tensor, (relu, 0, 0, 2))
    first_node(graph, aten.mul.Tensor).replace_input_with(relu, half)


def run(
    passes, graph: fx.Graph | None = None, autograd: bool = False, env=None, **flags
) -> tuple[GraphReport, fx.Graph]:
    graph = graph if graph is not None else traced(model).graph
    reports: list[GraphReport] = []
    config = HCPassesConfig.resolve(env=env or {}, **flags)
    PassManager(config, reports.append, passes=passes, autograd=autograd)(graph)
    assert len(reports) == 1
    return reports[0], graph


def test_records_every_pass_in_pipeline_order_with_status_count_reason_notes_facts() -> None:
    passes = [Spy("cleanup"), Spy("gated_mean_quant", add_unused_neg, applied=1, reason=None)]
    report, graph = run(passes)
    assert [r.name for r in report.passes] == list(PASS_NAMES)
    canonical, fusion, sp, scans, cleanup = report.passes
    assert (canonical.status, canonical.reason) == ("unavailable", "no pass of this name is registered in this version")
    assert (sp.status, sp.applied) == ("unavailable", 0)
    assert (scans.status, scans.applied) == ("unavailable", 0)
    assert (fusion.status, fusion.applied, fusion.reason) == ("applied", 1, None)
    assert fusion.notes == ("a note",) and fusion.facts == {"fact": 1} and fusion.seconds > 0
    assert (cleanup.status, cleanup.applied, cleanup.reason) == ("unchanged", 0, "nothing here")
    assert report.num_nodes_after == report.num_nodes_before + 1 == len(graph.nodes)
    assert report.index == -1 and report.variant == "only" and not report.cached
    assert all(p.calls == 1 for p in passes)


def test_passes_run_in_order_each_on_the_graph_the_one_before_left() -> None:
    seen: list[tuple[str, int]] = []
    passes = [
        Spy(name, lambda g, name=name: seen.append((name, len(g.nodes))) or add_unused_neg(g), applied=1)
        for name in reversed(PASS_NAMES)
    ]
    report, _ = run(passes)
    assert [name for name, _ in seen] == list(PASS_NAMES)
    assert [count for _, count in seen] == [seen[0][1] + i for i in range(5)]
    assert report.applied == dict.fromkeys(PASS_NAMES, 1)


@pytest.mark.parametrize("name", PASS_NAMES)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_disabled_pass_does_not_run_and_says_why(name: str, how: str) -> None:
    spies = [Spy(n, add_unused_neg, applied=1) for n in PASS_NAMES]
    flags = {name: False} if how == "flag" else {}
    env = {"HCPASSES_DISABLE": name} if how == "env" else {}
    report, graph = run(spies, env=env, **flags)
    record = report.record(name)
    assert record.status == "disabled" and record.applied == 0 and record.seconds == 0
    assert record.reason == (f"flag {name}=False" if how == "flag" else f"HCPASSES_DISABLE names {name}")
    assert [s.calls for s in spies] == [int(s.name != name) for s in spies]
    assert len(graph.nodes) == report.num_nodes_before + 4


def test_every_pass_disabled_leaves_the_graph_as_it_was() -> None:
    graph = traced(model).graph
    program = node_program(graph)
    spies = [Spy(n, add_unused_neg, applied=1) for n in PASS_NAMES]
    report, _ = run(spies, graph, env={"HCPASSES_DISABLE": ",".join(PASS_NAMES)})
    assert node_program(graph) == program
    assert {r.status for r in report.passes} == {"disabled"} and not any(s.calls for s in spies)


def test_autograd_graphs_run_no_pass_and_say_why() -> None:
    spies = [Spy(n, add_unused_neg, applied=1) for n in PASS_NAMES]
    report, _ = run(spies, autograd=True, cleanup=False)
    assert report.variant == "autograd"
    assert [(r.status, r.reason) for r in report.passes] == [
        ("skipped", AUTOGRAD_REASON),
        ("skipped", AUTOGRAD_REASON),
        ("skipped", AUTOGRAD_REASON),
        ("skipped", AUTOGRAD_REASON),
        ("disabled", "flag cleanup=False"),
    ]
    assert not any(s.calls for s in spies) and report.num_nodes_after == report.num_nodes_before


@pytest.mark.parametrize(
    ("action", "applied", "reason"),
    [
        (lambda g: (swap_relu_for_abs(g), 1 / 0), 1, "rolled back: ZeroDivisionError: division by zero"),
        (
            swap_relu_for_abs,
            0,
            "rolled back: GraphVerificationError: the pass changed the graph but reported 0 rewrites",
        ),
        (None, 3, "rolled back: GraphVerificationError: the pass reported 3 rewrite(s) but left the graph unchanged"),
        (half_rows_into_the_mul, 1, "rolled back: GraphVerificationError: node mul"),
    ],
    ids=["raises", "silent change", "count without change", "bad shapes"],
)
def test_a_failing_pass_is_rolled_back_and_the_next_pass_runs(action, applied: int, reason: str, caplog) -> None:
    graph = traced(model).graph
    expected = traced(model).graph
    add_unused_neg(expected)  # what the pass after it does to the restored graph
    after = Spy("cleanup", add_unused_neg, applied=1)
    with caplog.at_level(logging.WARNING, logger="hcpasses"):
        report, _ = run([Spy("sp_rewrite", action, applied=applied), after], graph)
    record = report.record("sp_rewrite")
    assert record.status == "rolled_back" and record.applied == 0 and record.seconds > 0
    assert record.reason.startswith(reason), record.reason
    assert after.calls == 1 and report.record("cleanup").status == "applied"
    assert node_program(graph) == node_program(expected)
    warnings = [r for r in caplog.records if r.name == "hcpasses" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].getMessage() == f"hcpasses pass sp_rewrite {record.reason}"


def half_rows_beside_all_rows(graph: fx.Graph) -> None:
    """Half the relu's rows added to all of them: no sizes make that propagate."""
    relu = first_node(graph, aten.relu.default)
    with graph.inserting_after(relu):
        half = graph.call_function(aten.slice.Tensor, (relu, 0, 0, 2))
    with graph.inserting_after(half):
        both = graph.call_function(aten.add.Tensor, (half, relu))
    first_node(graph, aten.mul.Tensor).replace_input_with(relu, both)


def test_a_resizing_pass_has_its_new_sizes_recorded_by_the_manager() -> None:
    """A pass that resizes values (the SP rewrite) gets them re-propagated, not checked against the old records;
    values that cannot propagate still roll it back, with the node named."""
    graph = traced(model).graph
    report, _ = run([Spy("sp_rewrite", half_rows_into_the_mul, applied=1, resizes=True)], graph)
    assert report.record("sp_rewrite").status == "applied"
    assert [tuple(n.meta["val"].shape) for n in graph.nodes if n.target in (aten.mul.Tensor, aten.add.Tensor)] == [
        (2, 6),
        (2, 6),
    ]
    graph = traced(model).graph
    expected = node_program(traced(model).graph)
    report, _ = run([Spy("sp_rewrite", half_rows_beside_all_rows, applied=1, resizes=True)], graph)
    record = report.record("sp_rewrite")
    assert record.status == "rolled_back", record
    assert record.reason.startswith("rolled back: GraphVerificationError: node add")
    assert "(aten.add.Tensor): its inputs do not propagate: " in record.reason
    assert node_program(graph) == expected


def test_a_rolled_back_graph_computes_what_it_did_before() -> None:
    module = traced(model)
    x, w = torch.randn(5, 4), torch.randn(4, 6)
    report, _ = run([Spy("sp_rewrite", lambda g: (swap_relu_for_abs(g), 1 / 0), applied=1)], module.graph)
    assert report.record("sp_rewrite").status == "rolled_back"
    module.recompile()
    torch.testing.assert_close(module(x, w), model(x, w))


def test_the_real_pipeline_has_one_pass_per_flag() -> None:
    assert [p.name for p in pipeline()] == list(PASS_NAMES)
    assert [type(p) for p in pipeline()] == [spec.graph_pass for spec in registry.PASSES]
    assert all(a is b for a, b in zip(pipeline(), pipeline(), strict=True))  # one object per pass in a process
    report, _ = run(pipeline())
    assert [r.status for r in report.passes] == ["unchanged"] * 5


def test_by_default_the_manager_runs_the_registrys_passes() -> None:
    manager = PassManager(HCPassesConfig(), print)
    assert list(manager.passes) == list(PASS_NAMES)
    assert all(a is b for a, b in zip(manager.passes.values(), pipeline(), strict=True))
    report, _ = run(None)
    assert [r.status for r in report.passes] == ["unchanged"] * 5


class Extra(GraphPass):
    name = "extra"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        add_unused_neg(graph)
        return PassResult(1)


def test_a_pass_added_to_the_registry_runs_in_its_place(monkeypatch) -> None:
    specs = list(registry.PASSES)
    specs.insert(1, PassSpec(Extra, True, "adds a node"))
    monkeypatch.setattr(registry, "PASSES", tuple(specs))
    report, graph = run(None, cleanup=False)
    assert [(r.name, r.status) for r in report.passes] == [
        ("canonical_forms", "unchanged"),
        ("extra", "applied"),
        ("gated_mean_quant", "unchanged"),
        ("sp_rewrite", "unchanged"),
        ("blocked_scans", "unchanged"),
        ("cleanup", "disabled"),
    ]
    assert any(n.target is aten.neg.default for n in graph.nodes)
    report, _ = run(None, extra=False)
    assert report.record("extra").reason == "flag extra=False"


def test_a_pass_without_a_flag_is_refused() -> None:
    with pytest.raises(ValueError, match=r"passes \['mystery'\] have no flag; flags are: canonical_forms, "):
        PassManager(HCPassesConfig(), print, passes=[Spy("mystery")])


def test_dumps_only_for_passes_that_changed_the_graph(tmp_path: Path) -> None:
    passes = [
        Spy("canonical_forms"),  # runs, unchanged
        Spy("gated_mean_quant", add_unused_neg, applied=1),  # applied
        Spy("sp_rewrite", lambda g: (swap_relu_for_abs(g), 1 / 0), applied=1),  # rolled back
    ]
    report, _ = run(passes, dump_dir=str(tmp_path), cleanup=False)  # cleanup disabled
    folder = tmp_path / "graph_000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph_000", "index.json", "index.md"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "2_gated_mean_quant.after.py",
        "2_gated_mean_quant.before.py",
        "2_gated_mean_quant.diff",
    ]
    assert report.record("gated_mean_quant").dump == "graph_000/2_gated_mean_quant.diff"
    assert [r.dump for r in report.passes if r.name != "gated_mean_quant"] == [None, None, None, None]
    before = (folder / "2_gated_mean_quant.before.py").read_text()
    after = (folder / "2_gated_mean_quant.after.py").read_text()
    assert "aten.neg" not in before and "aten.neg" in after and "aten.relu" in before
    index = (tmp_path / "index.md").read_text()
    for status in ("unchanged", "applied", "rolled_back", "disabled"):
        assert f"| {status} |" in index


def test_no_dump_dir_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run([Spy("gated_mean_quant", add_unused_neg, applied=1)])
    assert list(tmp_path.iterdir()) == []


def test_uuid_is_stable_and_changes_with_flags_mode_passes_and_rank() -> None:
    def uuid(passes=None, autograd: bool = False, env=None, **flags) -> str:
        config = HCPassesConfig.resolve(env=env or {}, **flags)
        return PassManager(config, print, passes=passes, autograd=autograd).uuid()

    base = uuid()
    assert base == uuid() == uuid(passes=pipeline()) and len(base) == 64
    variants = [uuid(**{name: False}) for name in PASS_NAMES]
    variants += [uuid(sp_min_tokens=2048), uuid(dump_dir="d"), uuid(cudagraphs=True), uuid(autograd=True)]
    variants += [uuid(passes=pipeline()[:4]), uuid(passes=(*pipeline()[:4], Spy("cleanup")))]
    variants += [uuid(env={"HCPASSES_DISABLE": "cleanup"})]
    assert len({base, *variants}) == len(variants) + 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert uuid() != base
    finally:
        dist.destroy_process_group()


def test_source_hash_covers_every_file_of_the_package(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(manager_module, "_PACKAGE_DIR", tmp_path)
    first = source_hash()
    assert first == source_hash() and len(first) == 64
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    second = source_hash()
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")  # same bytes, another file
    third = source_hash()
    (tmp_path / "notes.txt").write_text("not source")
    assert len({first, second, third}) == 3 and source_hash() == third


def test_pass_fingerprint_names_the_class_and_hashes_its_file() -> None:
    fingerprint = pass_fingerprint(DeadCodeCleanup())
    module, digest = fingerprint.split(":")
    assert module == "hcpasses.passes.cleanup.DeadCodeCleanup"
    source = (Path(manager_module.__file__).parent / "passes" / "cleanup.py").read_bytes()
    assert digest == hashlib.sha256(source).hexdigest()
    assert pass_fingerprint(Spy("cleanup")).startswith(f"{__name__}.Spy:")


class ReadsConfig(GraphPass):
    name = "sp_rewrite"

    def __init__(self) -> None:
        self.seen: list[HCPassesConfig] = []

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        self.seen.append(config)
        return PassResult(0, "nothing")


def test_a_pass_reads_the_managers_config_and_its_time_is_its_own() -> None:
    reader = ReadsConfig()
    config = HCPassesConfig(sp_min_tokens=77)
    reports: list[GraphReport] = []
    PassManager(config, reports.append, passes=[reader])(traced(model).graph)
    assert reader.seen == [config]
    report, _ = run([Spy("sp_rewrite", lambda g: (swap_relu_for_abs(g), 1 / 0), applied=1), Spy("cleanup")])
    assert all(0 <= r.seconds < 60 for r in report.passes)


def test_the_graph_text_is_made_only_for_a_dump(monkeypatch) -> None:
    def no_text(graph: fx.Graph) -> str:
        raise AssertionError("graph_code called without a dump dir")

    monkeypatch.setattr(manager_module, "graph_code", no_text)
    report, _ = run([Spy("gated_mean_quant", add_unused_neg, applied=1)])
    assert report.record("gated_mean_quant").status == "applied"


def refuses_to_run_again(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("a node the pass did not touch was run again")


def test_a_resizing_pass_has_only_what_it_touched_re_propagated() -> None:
    """The manager refreshes the fake values of the nodes a resizing pass touched and of what they feed, from the
    state before the pass (README: it re-runs what the pass touched), never the whole graph: a node before the
    rewrite that would fail if run again (here by raising; in a real graph, say, an op whose fake kernel is slow or
    missing) does not make the pass roll back."""
    graph = traced(model).graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_after(x):
        opaque = graph.call_function(refuses_to_run_again, (x,))
    opaque.meta["val"] = x.meta["val"]
    report, _ = run([Spy("sp_rewrite", half_rows_into_the_mul, applied=1, resizes=True)], graph)
    assert report.record("sp_rewrite").status == "applied", report.record("sp_rewrite").reason
    assert tuple(first_node(graph, aten.add.Tensor).meta["val"].shape) == (2, 6)  # what the rewrite fed was


def test_verification_starts_from_the_state_before_the_pass_or_its_own_propagation(monkeypatch) -> None:
    seen: list[object] = []
    real = manager_module.verify_graph

    def spy(graph: fx.Graph, since=None) -> None:
        seen.append(since)
        real(graph, since=since)

    monkeypatch.setattr(manager_module, "verify_graph", spy)
    run([Spy("gated_mean_quant", add_unused_neg, applied=1)])
    assert len(seen) == 1 and seen[0] is not None and len(seen[0].nodes) == 7  # the graph before the new node
    seen.clear()
    run([Spy("gated_mean_quant", add_unused_neg, applied=1, resizes=True)])
    assert len(seen) == 1 and len(seen[0].nodes) == 8  # the manager's propagation for a resizing pass, after it


def test_a_pass_whose_source_file_is_gone_is_fingerprinted_by_its_name(monkeypatch) -> None:
    gone = types.ModuleType("gone_passes")
    gone.__file__ = "/nonexistent/gone_passes.py"
    monkeypatch.setitem(sys.modules, "gone_passes", gone)
    vanished = type("Vanished", (Spy,), {"__module__": "gone_passes"})
    assert pass_fingerprint(vanished("cleanup")) == f"gone_passes.Vanished:{hashlib.sha256(b'').hexdigest()}"

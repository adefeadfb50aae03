"""``hcpasses.dumps`` and ``hcpasses.report`` alone: the dump layout, file contents and index; the report's
properties, text and JSON round trip. Fast tests for the mutation run (docs/TESTING.md)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.graphs import traced

from hcpasses.dumps import GraphDump, graph_code, rank_dir
from hcpasses.report import GraphReport, PassRecord


def sample_report() -> GraphReport:
    return GraphReport(
        index=3,
        num_nodes_before=10,
        num_nodes_after=12,
        passes=[
            PassRecord("gated_mean_quant", "applied", 2, 0.0015, None, ("found 2",), "graph_000/2_x.diff", {"k": "v"}),
            PassRecord("sp_rewrite", "unchanged", 0, 0.25, "T=7 < sp_min_tokens=8"),
            PassRecord("cleanup", "disabled", reason="flag cleanup=False"),
        ],
    )


def test_graph_code_is_readable_python_with_shapes() -> None:
    code = graph_code(traced(lambda x, w: torch.relu(x @ w)).graph)
    assert "torch.ops.aten.relu.default" in code and "f32[5, 6]" in code


def test_folders_are_numbered_by_the_next_free_number(tmp_path: Path) -> None:
    (tmp_path / "graph_001").mkdir()
    folders = [GraphDump(str(tmp_path)).folder.name for _ in range(3)]
    assert folders == ["graph_000", "graph_002", "graph_003"]


def test_concurrent_dumps_never_share_a_folder(tmp_path: Path) -> None:
    folders: list[str] = []
    threads = [threading.Thread(target=lambda: folders.append(GraphDump(str(tmp_path)).folder.name)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(folders) == [f"graph_{i:03d}" for i in range(8)]


def test_write_pass_writes_before_after_and_a_unified_diff(tmp_path: Path) -> None:
    dump = GraphDump(str(tmp_path / "new" / "dir"))  # made if missing
    path = dump.write_pass(2, "gated_mean_quant", "a\nb\n", "a\nc\n")
    assert path == "graph_000/2_gated_mean_quant.diff"
    folder = tmp_path / "new" / "dir" / "graph_000"
    assert (folder / "2_gated_mean_quant.before.py").read_text() == "a\nb\n"
    assert (folder / "2_gated_mean_quant.after.py").read_text() == "a\nc\n"
    assert (folder / "2_gated_mean_quant.diff").read_text().splitlines() == [
        "--- graph_000/2_gated_mean_quant.before.py",
        "+++ graph_000/2_gated_mean_quant.after.py",
        "@@ -1,2 +1,2 @@",
        " a",
        "-b",
        "+c",
    ]


def test_index_accumulates_reports_as_json_and_markdown(tmp_path: Path) -> None:
    first, second = GraphDump(str(tmp_path)), GraphDump(str(tmp_path))
    first.write_index(sample_report())
    second.write_index(GraphReport(index=4, num_nodes_before=1, num_nodes_after=1))
    entries = json.loads((tmp_path / "index.json").read_text())
    assert [e["folder"] for e in entries] == ["graph_000", "graph_001"]
    assert GraphReport.from_json(json.dumps(entries[0]["report"])) == sample_report()
    assert (tmp_path / "index.md").read_text().splitlines() == [
        "# hcpasses graph dumps",
        "",
        "| graph | nodes before → after | pass | status | rewrites | ms | diff | reason |",
        "|---|---|---|---|---|---|---|---|",
        "| graph_000 | 10 → 12 | gated_mean_quant | applied | 2 | 1.50 | [diff](graph_000/2_x.diff) |  |",
        "| graph_000 | 10 → 12 | sp_rewrite | unchanged | 0 | 250.00 |  | T=7 < sp_min_tokens=8 |",
        "| graph_000 | 10 → 12 | cleanup | disabled | 0 | 0.00 |  | flag cleanup=False |",
    ]


def test_rank_dir_only_when_distributed(tmp_path: Path) -> None:
    assert rank_dir(str(tmp_path)) == tmp_path
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert rank_dir(str(tmp_path)) == tmp_path / "rank0"
        assert GraphDump(str(tmp_path)).folder == tmp_path / "rank0" / "graph_000"
    finally:
        dist.destroy_process_group()


def test_report_properties() -> None:
    report = sample_report()
    assert report.applied == {"gated_mean_quant": 2, "sp_rewrite": 0, "cleanup": 0}
    assert report.reasons == {"sp_rewrite": "T=7 < sp_min_tokens=8", "cleanup": "flag cleanup=False"}
    assert report.record("sp_rewrite") is report.passes[1]
    with pytest.raises(KeyError, match=r"no pass 'fusion' in this report; passes: \['gated_mean_quant', 'sp_rewrite'"):
        report.record("fusion")


def test_report_text() -> None:
    report = sample_report()
    assert str(report).splitlines() == [
        "graph 3: 10 -> 12 nodes",
        "  gated_mean_quant   applied      applied=2       1.50 ms",
        "      found 2",
        "  sp_rewrite         unchanged    applied=0     250.00 ms  -- T=7 < sp_min_tokens=8",
        "  cleanup            disabled     applied=0       0.00 ms  -- flag cleanup=False",
    ]
    report.cached, report.variant = True, "sharded"
    assert str(report).splitlines()[0] == (
        "graph 3 [sharded variant]: 10 -> 12 nodes (served from Inductor's cache: passes did not run in this process)"
    )


def test_report_json_round_trip_keeps_every_field() -> None:
    report = sample_report()
    report.cached, report.variant = True, "unsharded"
    again = GraphReport.from_json(report.to_json())
    assert again == report
    assert isinstance(again.passes[0].notes, tuple) and isinstance(again.passes[0], PassRecord)


def test_graph_code_names_the_module_self() -> None:
    module = torch.nn.Linear(3, 2)
    gm = torch.fx.symbolic_trace(module)
    code = graph_code(gm.graph)
    assert "self.weight" in code and "self.bias" in code

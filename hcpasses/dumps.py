"""Graph diff dumps: what each pass changed, as readable code and unified diffs.

Layout under the dump dir (``rankN/`` added when torch.distributed is initialised)::

    index.md                      one row per (graph, pass): status, rewrites, ms, files
    index.json                    the same, as the GraphReports, for tools
    graph_000/
        2_gated_mean_quant.before.py
        2_gated_mean_quant.after.py
        2_gated_mean_quant.diff
        ...

Files are written only for passes that changed the graph (like LLVM's ``-print-changed``). Graph
folders are numbered by the next free number, so several backends or runs share a dump dir without
overwriting each other. Only the standard library is used (difflib), by design.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

from hcpasses.report import GraphReport


def graph_code(graph: fx.Graph) -> str:
    """The graph as readable Python, with shapes and dtypes as annotations."""
    return graph.python_code(root_module="self", verbose=True).src


def rank_dir(root: str) -> Path:
    path = Path(root)
    if dist.is_available() and dist.is_initialized():
        path = path / f"rank{dist.get_rank()}"
    return path


class GraphDump:
    """The dump folder of one compiled graph."""

    def __init__(self, root: str) -> None:
        self.base = rank_dir(root)
        self.base.mkdir(parents=True, exist_ok=True)
        self.folder = self._claim_folder()

    def _claim_folder(self) -> Path:
        number = 0
        while True:
            folder = self.base / f"graph_{number:03d}"
            try:
                folder.mkdir()  # atomic: two processes never claim the same number
                return folder
            except FileExistsError:
                number += 1

    def write_pass(self, order: int, name: str, before: str, after: str) -> str:
        """Write before/after/diff for one pass; return the diff's path relative to the dump dir."""
        stem = f"{order}_{name}"
        (self.folder / f"{stem}.before.py").write_text(before)
        (self.folder / f"{stem}.after.py").write_text(after)
        diff = difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"{self.folder.name}/{stem}.before.py",
            tofile=f"{self.folder.name}/{stem}.after.py",
        )
        (self.folder / f"{stem}.diff").write_text("".join(diff))
        return f"{self.folder.name}/{stem}.diff"

    def write_index(self, report: GraphReport) -> None:
        """Add this graph's report to ``index.json`` and rewrite ``index.md`` from it."""
        index_json = self.base / "index.json"
        entries = json.loads(index_json.read_text()) if index_json.exists() else []
        entries.append({"folder": self.folder.name, "report": json.loads(report.to_json())})
        index_json.write_text(json.dumps(entries, indent=1))
        (self.base / "index.md").write_text(_index_markdown(entries))


def _index_markdown(entries: list[dict]) -> str:
    lines = [
        "# hcpasses graph dumps",
        "",
        "| graph | nodes before → after | pass | status | rewrites | ms | diff | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        report = entry["report"]
        nodes = f"{report['num_nodes_before']} → {report['num_nodes_after']}"
        for record in report["passes"]:
            diff = f"[diff]({record['dump']})" if record["dump"] else ""
            lines.append(
                f"| {entry['folder']} | {nodes} | {record['name']} | {record['status']} | {record['applied']} "
                f"| {record['seconds'] * 1e3:.2f} | {diff} | {record['reason'] or ''} |"
            )
    return "\n".join(lines) + "\n"

"""What the passes did to one compiled graph: ``backend.reports`` holds one ``GraphReport`` per graph."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from hcpasses.graph_pass import ShardedTokens

PassStatus = Literal["applied", "unchanged", "disabled", "skipped", "unavailable", "rolled_back"]


@dataclasses.dataclass
class PassRecord:
    """One pass on one graph.

    ``status``: ``applied`` (rewrites were made), ``unchanged`` (ran, found nothing to do),
    ``disabled`` (its flag is off), ``skipped`` (not run on this graph: an autograd graph, see
    ``hcpasses.manager.AUTOGRAD_REASON``), ``unavailable`` (no pass of that name is registered in this
    version), ``rolled_back`` (it raised or left a graph that failed verification; the graph was
    restored). ``reason`` says why whenever the status is not ``applied``. ``sharded``: the pass sharded the
    graph's token rows (``hcpasses.graph_pass.ShardedTokens``), which the backend acts on.
    """

    name: str
    status: PassStatus
    applied: int = 0
    seconds: float = 0.0
    reason: str | None = None
    notes: tuple[str, ...] = ()
    dump: str | None = None
    facts: dict[str, int] = dataclasses.field(default_factory=dict)
    sharded: ShardedTokens | None = None


@dataclasses.dataclass
class GraphReport:
    """The passes' results on one graph Inductor compiled, in pipeline order.

    ``variant`` names which compile of the graph this is: ``only``, or with symbolic T and SP applied,
    ``sharded`` (used for T >= sp_min_tokens) and ``unsharded`` (T below it); ``autograd`` for the
    forward and backward graphs of a grad-mode compile, on which no pass runs.
    ``cached`` is true when Inductor served the graph from its cache, so no pass ran in this process;
    the records then come from the compile that filled the cache (or are empty if that record is gone).
    """

    index: int
    num_nodes_before: int = 0
    num_nodes_after: int = 0
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    cached: bool = False
    variant: str = "only"

    @property
    def applied(self) -> dict[str, int]:
        """Rewrites applied by each pass, keyed by pass name (0 for passes that did nothing)."""
        return {record.name: record.applied for record in self.passes}

    @property
    def reasons(self) -> dict[str, str]:
        """Why each pass that applied nothing (or was rolled back) did not apply."""
        return {record.name: record.reason for record in self.passes if record.reason}

    def record(self, name: str) -> PassRecord:
        for record in self.passes:
            if record.name == name:
                return record
        raise KeyError(f"no pass {name!r} in this report; passes: {[r.name for r in self.passes]}")

    def __str__(self) -> str:
        origin = " (served from Inductor's cache: passes did not run in this process)" if self.cached else ""
        variant = "" if self.variant == "only" else f" [{self.variant} variant]"
        lines = [f"graph {self.index}{variant}: {self.num_nodes_before} -> {self.num_nodes_after} nodes{origin}"]
        for record in self.passes:
            line = f"  {record.name:<18} {record.status:<12} applied={record.applied:<4} {record.seconds * 1e3:7.2f} ms"
            if record.reason:
                line += f"  -- {record.reason}"
            lines.append(line)
            lines.extend(f"      {note}" for note in record.notes)
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GraphReport:
        data: dict[str, Any] = json.loads(text)
        records = [
            PassRecord(**{**r, "notes": tuple(r["notes"]), "sharded": r["sharded"] and ShardedTokens(**r["sharded"])})
            for r in data.pop("passes")
        ]
        return cls(**data, passes=records)

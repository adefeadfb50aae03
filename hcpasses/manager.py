"""The pass pipeline: the one place that shows which passes run, in which order, under which checks.

Installed as Inductor's ``post_grad_custom_pre_pass`` (not the post pass: on CUDA Inductor has
already rewritten softmax to ``prepare_softmax_online`` there and HC patterns stop matching). For
every graph Inductor compiles it runs each pass whose flag is on, in the order of the registry
(``hcpasses.passes.PASSES``, which the config's pass flags follow):

    state -> pass.run -> [refresh fake values] -> verify (lint + fake shapes of what it touched) -> [dump]
                \\ raises or fails verification: restore the state, record why

A pass that resizes values (``GraphPass.resizes_values``: the SP rewrite) has the fake values of what it
touched recomputed here, once, before the verification; the others' are checked against their records.

A pass that fails is rolled back and recorded, never a crash and never a half-rewritten graph. The
report of each graph goes to ``on_report`` (the backend's ``reports`` list).

Autograd graphs (the model compiled in grad mode with parameters or inputs that require grad): the
backend hands them to a manager built with ``autograd=True``, which runs no pass and records each
enabled pass as ``skipped`` with ``AUTOGRAD_REASON``. The forward of such a graph saves intermediates
for the backward (the quant's fp32 values, the full-row streams), so neither rewrite is valid there.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import hcpasses.passes as registry
from hcpasses.config import HCPassesConfig
from hcpasses.dumps import GraphDump, graph_code
from hcpasses.graph_pass import GraphPass
from hcpasses.report import GraphReport, PassRecord
from hcpasses.verify import GraphVerificationError, graph_state, refresh_fake_values, restore_graph, verify_graph

log = logging.getLogger("hcpasses")

_PACKAGE_DIR = Path(__file__).resolve().parent

AUTOGRAD_REASON = (
    "an autograd graph (compiled in grad mode with parameters or inputs that require grad): its forward saves "
    "intermediates for the backward, which the passes do not rewrite; for inference, compile and call the model "
    "under torch.no_grad() or torch.inference_mode()"
)


def source_hash() -> str:
    """sha256 over every source file of the package, so any code change invalidates cached graphs."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def process_group_layout() -> str:
    """This process's rank and size in every process group it belongs to, by group name: ``-`` when not distributed.

    Part of the cache key: each rank's graph bakes in its rank in the group an SP region shards over (shard_rows),
    ranks share one on-disk cache, and a group name alone does not say which rank this process is in it (two jobs
    may give the name to groups of other ranks). Internal API: ``distributed_c10d._world.pg_names`` (every group
    this process is a member of, with its name; 2.11 and 2.13), pinned in ``tests/test_sp_groups.py``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return "-"
    groups = sorted(dist.distributed_c10d._world.pg_names.items(), key=lambda item: item[1])
    return ",".join(f"{name}:{dist.get_rank(group)}/{dist.get_world_size(group)}" for group, name in groups)


def pass_fingerprint(graph_pass: GraphPass) -> str:
    """A pass's class and the source of the file defining it (passes may live outside the package)."""
    source = inspect.getsourcefile(type(graph_pass))
    content = Path(source).read_bytes() if source else b""
    return f"{type(graph_pass).__module__}.{type(graph_pass).__qualname__}:{hashlib.sha256(content).hexdigest()}"


class PassManager(CustomGraphPass):
    """Runs the enabled passes on one post-grad graph at a time and reports what they did.

    ``passes``: the pass objects, by default the registry's (``hcpasses.passes.pipeline()``); tests hand in their
    own. Each must be named as one of the config's pass flags; the order is the config's (the registry's), and a
    flag with no pass object is reported ``unavailable``.
    """

    def __init__(
        self,
        config: HCPassesConfig,
        on_report: Callable[[GraphReport], None],
        passes: Sequence[GraphPass] | None = None,
        autograd: bool = False,
    ) -> None:
        passes = registry.pipeline() if passes is None else tuple(passes)
        unknown = [p.name for p in passes if p.name not in config.pass_names]
        if unknown:
            raise ValueError(f"passes {unknown} have no flag; flags are: {', '.join(config.pass_names)}")
        self.config = config
        self.passes = {p.name: p for p in passes}
        self.on_report = on_report
        self.autograd = autograd
        # The grad mode is in the key: the backend's stored reports must not serve an autograd compile the
        # record of an inference one (or the reverse).
        parts = [source_hash(), config.describe(), f"autograd={autograd}", *map(pass_fingerprint, passes)]
        self._uuid = hashlib.sha256("|".join(parts).encode()).hexdigest()

    def uuid(self) -> str:
        return hashlib.sha256(f"{self._uuid}|{process_group_layout()}".encode()).hexdigest()

    def __call__(self, graph: fx.Graph) -> None:
        report = GraphReport(index=-1, num_nodes_before=len(graph.nodes))  # the backend numbers it
        if self.autograd:  # also the backward, which AOTAutograd compiles later, outside the backend's call
            report.variant = "autograd"
        dump = GraphDump(self.config.dump_dir) if self.config.dump_dir else None
        for order, name in enumerate(self.config.pass_names, start=1):
            record = self._run_one(graph, name, order, dump)
            report.passes.append(record)
        report.num_nodes_after = len(graph.nodes)
        self.on_report(report)
        if dump is not None:
            dump.write_index(report)

    def _run_one(self, graph: fx.Graph, name: str, order: int, dump: GraphDump | None) -> PassRecord:
        if not self.config.pass_enabled(name):
            return PassRecord(name, "disabled", reason=self.config.why_disabled(name))
        if self.autograd:
            return PassRecord(name, "skipped", reason=AUTOGRAD_REASON)
        graph_pass = self.passes.get(name)
        if graph_pass is None:
            return PassRecord(name, "unavailable", reason="no pass of this name is registered in this version")
        before = graph_state(graph)
        code_before = graph_code(graph) if dump is not None else ""  # the text only for a dump: it is not cheap
        start = time.perf_counter()
        try:
            result = graph_pass.run(graph, self.config)
            seconds = time.perf_counter() - start  # the pass alone, not the checks
            changed = before.structure_differs(graph)
            # The report must be the graph's truth both ways: a count with no change, or a change with no
            # count, is a pass whose report cannot be trusted.
            if changed and not result.applied:
                raise GraphVerificationError("the pass changed the graph but reported 0 rewrites")
            if not changed and result.applied:
                count = result.applied
                raise GraphVerificationError(f"the pass reported {count} rewrite(s) but left the graph unchanged")
            since = before
            if changed and graph_pass.resizes_values:  # new sizes are the point of the pass: record them
                since = refresh_fake_values(graph, since=before) or before
            verify_graph(graph, since=since)  # runs again only the nodes touched since
        except Exception as err:  # a failing pass must never fail the compile: roll it back
            restore_graph(graph, before)
            reason = f"rolled back: {type(err).__name__}: {err}"
            log.warning("hcpasses pass %s %s", name, reason)
            return PassRecord(name, "rolled_back", seconds=time.perf_counter() - start, reason=reason)
        status = "applied" if result.applied else "unchanged"
        record = PassRecord(
            name,
            status,
            result.applied,
            seconds,
            result.reason,
            result.notes,
            facts=dict(result.facts),
            sharded=result.sharded,
        )
        if changed and dump is not None:
            record.dump = dump.write_pass(order, name, code_before, graph_code(graph))
        return record

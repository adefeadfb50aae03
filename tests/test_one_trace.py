"""The one-trace capture (``capture_with_passes(..., one_trace=True)``) that the property tests use: rank 0's
model is traced once and the passes run on a copy of its graph under each rank's fake group. It must give
every rank exactly what capturing that rank on its own gives, and refuse (falling back to per-rank captures)
where rank 0's trace does not hold for another rank."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from corpus.mhc_spelled import MHCSpelling, SpelledMHC
from harness import simulate
from harness.capture import RankDependentTrace, capture_ranks_from_one_trace
from harness.reference import RankGraphs, capture_with_passes
from torch._dynamo.utils import counters

from hcpasses.config import HCPassesConfig
from hcpasses.report import GraphReport
from hcpasses.testing.models import HCConfig, HCDecoder

CONFIG = HCPassesConfig(sp_min_tokens=1)


def without_timings(report: GraphReport) -> list[str]:
    """A report's records, less the seconds each pass took (and the milliseconds a note gives: the fusion's
    evaluation time) and the names of shape symbols (which depend on the traced function's argument names)."""
    records = [dataclasses.astuple(dataclasses.replace(record, seconds=0.0)) for record in report.passes]
    return [re.sub(r"\d+\.\d+ ms\b", "? ms", re.sub(r"\bs\d+\b", "s?", str(record))) for record in records]


def structure(gm: torch.fx.GraphModule) -> list[tuple]:
    """Each node's op, target, arguments (nodes by position) and value shape and dtype; shape symbols and node
    names are numbered in order of appearance (they depend on the traced function's argument names and on
    the names the compile used before)."""
    position: dict[torch.fx.Node, int] = {}
    symbols: dict[str, str] = {}

    def renamed(text: str) -> str:
        return re.sub(r"\bs\d+\b", lambda m: symbols.setdefault(m.group(), f"s{len(symbols)}"), text)

    def arg(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("node", position[value])
        if isinstance(value, (list, tuple)):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, arg(v)) for k, v in value.items())
        return renamed(str(value))

    rows = []
    for index, node in enumerate(gm.graph.nodes):
        position[node] = index
        val = node.meta.get("val")
        value = renamed(f"{tuple(val.shape)} {val.dtype}") if isinstance(val, torch.Tensor) else renamed(str(val))
        rows.append((node.op, str(node.target), arg(node.args), arg(node.kwargs), value))
    return rows


def assert_same_capture(shared: RankGraphs, per_rank: RankGraphs, tp: int) -> None:
    assert len(shared.graphs) == len(per_rank.graphs) == tp
    for rank in range(tp):
        assert structure(shared.graphs[rank]) == structure(per_rank.graphs[rank]), rank
        assert structure(shared.before_sp[rank]) == structure(per_rank.before_sp[rank]), rank
    assert [without_timings(r) for r in shared.reports] == [without_timings(r) for r in per_rank.reports]
    outputs = simulate(shared.graphs, shared.inputs)
    for got, want in zip(outputs, simulate(per_rank.graphs, per_rank.inputs), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def traced_graphs(capture: Callable[[], RankGraphs]) -> tuple[RankGraphs, int]:
    """The capture and how many graphs Dynamo traced for it."""
    counters.clear()
    graphs = capture()
    return graphs, counters["stats"]["unique_graphs"]


HC_DECODER = HCConfig.tiny(n_layers=2, fp8=True, ple_layer=1, n_heads=12, n_kv_heads=12, intermediate=96, seed=2)
MHC_BLOCKS = [MHCSpelling("batched_matmul", "reference"), MHCSpelling("deepseek_reference", None)]
MODELS: dict[str, tuple[Callable[[int, int], torch.nn.Module], int]] = {  # the builder and its HC blocks
    "hc_decoder": (lambda rank, size: HCDecoder(HC_DECODER), 2 * HC_DECODER.n_layers + 1),
    "mhc_spelled": (lambda rank, size: SpelledMHC(MHC_BLOCKS, "einsum", torch.bfloat16, size, rank), 3),
}


@pytest.mark.parametrize(("model", "tp", "dynamic"), [("hc_decoder", 3, True), ("mhc_spelled", 2, False)])
def test_one_trace_gives_each_rank_the_graph_of_its_own_capture(model: str, tp: int, dynamic: bool) -> None:
    build, blocks = MODELS[model]
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(0))

    def capture(one_trace: bool) -> RankGraphs:
        return capture_with_passes(
            build, lambda rank, size: (ids,), tp, CONFIG, dynamic=dynamic, codegen=False, one_trace=one_trace
        )

    shared, shared_traces = traced_graphs(lambda: capture(True))
    per_rank, per_rank_traces = traced_graphs(lambda: capture(False))
    assert (shared_traces, per_rank_traces) == (1, tp)
    assert shared.report.applied["sp_rewrite"] == blocks  # the passes did run on the copies
    assert_same_capture(shared, per_rank, tp)


def test_uneven_shards_are_refused_then_captured_per_rank() -> None:
    """SwiGLU's 64 columns split 22 / 22 / 20 over 3 ranks: rank 2's weights do not fit rank 0's trace."""
    blocks = [MHCSpelling("einsum", "reference"), MHCSpelling("transformers", None)]
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(1))

    def build(rank: int, size: int) -> SpelledMHC:
        return SpelledMHC(blocks, "transformers", torch.bfloat16, size, rank)

    rewritten = []
    with pytest.raises(RankDependentTrace, match="rank 2's model did not reuse rank 0's trace"):
        capture_ranks_from_one_trace(build, lambda rank, size: (ids,), 3, rewritten.append)
    assert rewritten == []  # refused before any graph was rewritten

    shared = capture_with_passes(build, lambda rank, size: (ids,), 3, CONFIG, one_trace=True)
    assert shared.report.applied["sp_rewrite"] == len(blocks) + 1
    assert_same_capture(shared, capture_with_passes(build, lambda rank, size: (ids,), 3, CONFIG, codegen=False), 3)

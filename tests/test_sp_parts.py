"""The SP pass's two parts alone: the region analysis (``hcpasses.sp.region``) reads a graph and says what
is shardable and why not, changing nothing; the emission (``hcpasses.sp.emit``) rewrites exactly the region
it is given. Graphs: rank 0 of a TP 2 decoder, captured without any pass (fake process group)."""

from __future__ import annotations

import pytest
import torch
from harness import capture_post_grad, fake_process_group
from harness.reference import collective_counts

from hcpasses.patterns.collapse import CollapseFinder
from hcpasses.sp.emit import RegionRewriter
from hcpasses.sp.region import NotRowLocal, all_reduces, find_region, stream_value
from hcpasses.verify import verify_graph
from models import HCConfig, HCDecoder

LAYERS, TOKENS = 2, 9


def check_parts(ple_layer: int | None) -> None:
    """Analyse, check the analysis left the graph alone, then emit and count the collectives (rank 0 of 2,
    under the fake group the analysis reads the group name from)."""
    cfg = HCConfig.tiny(n_layers=LAYERS, ple_layer=ple_layer, n_heads=12, n_kv_heads=12, intermediate=96, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(1))
    with fake_process_group(0, 2):
        [captured] = capture_post_grad(HCDecoder(cfg), (ids,), tp=2, rank=0, codegen=False)
        graph = captured.gm.graph
        collapses = CollapseFinder().find(graph)
        reduces, why_not = all_reduces(graph)
        assert why_not is None and len(reduces) == 2 * LAYERS
        assert len(collapses) == 2 * LAYERS + 1  # attention and MLP HC per layer, the final mixer
        before = graph.python_code("self").src
        region, tokens = find_region(graph, collapses, reduces)
        assert graph.python_code("self").src == before, "the analysis changed the graph"
        assert tokens == TOKENS
        unsharded = ple_layer or 0  # layers before and at the PLE layer keep their all-reduces
        assert len(region.reduces) == 2 * (LAYERS - unsharded)
        assert region.collapses == collapses[2 * unsharded :]
        assert region.start is stream_value(region.collapses[0])
        if ple_layer is None:
            assert region.why_start == "first HC block of the graph"
        else:
            assert region.why_start.startswith("first HC block after ") and "not" in region.why_start
        RegionRewriter(graph, region, tokens, rank=0, tp=2).apply()
        verify_graph(graph)
    gathers = 2 * (LAYERS - unsharded) + 1  # each sub-layer input, the final mixer output
    want = {"all_reduce": 2 * unsharded, "reduce_scatter": 2 * (LAYERS - unsharded), "all_gather": gathers}
    assert collective_counts(captured.gm) == want


@pytest.mark.parametrize("ple_layer", [None, 1], ids=["no_ple", "ple_in_layer_1"])
def test_analysis_reads_and_emission_rewrites_the_region(ple_layer: int | None) -> None:
    check_parts(ple_layer)


def test_analysis_names_the_node_that_stops_every_start() -> None:
    """Told that the final mixer is the only HC block, the analysis cannot place a region (the layers'
    GEMMs sit between its start and the all-reduces): it raises, naming a node of the graph, and the graph
    is unchanged."""
    cfg = HCConfig.tiny(n_layers=1, n_heads=12, n_kv_heads=12, intermediate=96, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(1))
    with fake_process_group(0, 2):
        [captured] = capture_post_grad(HCDecoder(cfg), (ids,), tp=2, rank=0, codegen=False)
        graph = captured.gm.graph
        collapses = CollapseFinder().find(graph)
        reduces, _ = all_reduces(graph)
        before = graph.python_code("self").src
        with pytest.raises(NotRowLocal) as err:
            find_region(graph, collapses[-1:], reduces)
        assert err.value.node in graph.nodes and str(err.value).startswith(f"{err.value.node.name} (")
        assert graph.python_code("self").src == before

"""The SP pass's two parts alone: the region analysis (``sp_rewrite.region``) reads a graph and says what
is shardable and why not, changing nothing; the emission (``sp_rewrite.emit``) rewrites exactly the region
it is given. Graphs: rank 0 of a TP 2 decoder, captured without any pass (fake process group)."""

from __future__ import annotations

import pytest
import torch
from corpus.collapses import GatedMeanHC
from harness import capture_post_grad, fake_process_group
from harness.reference import collective_counts

from hcpasses.passes.sp_rewrite.collectives import find_all_reduces
from hcpasses.passes.sp_rewrite.emit import rewrite_region
from hcpasses.passes.sp_rewrite.graph import ancestors
from hcpasses.passes.sp_rewrite.region import find_regions
from hcpasses.passes.sp_rewrite.tokens import stream_value
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.collapse import CollapseFinder
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.verify import refresh_fake_values, verify_graph

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
        reduces = find_all_reduces(graph)
        assert isinstance(reduces, tuple) and len(reduces) == 2 * LAYERS
        assert len(collapses) == 2 * LAYERS + 1  # attention and MLP HC per layer, the final mixer
        before = graph.python_code("self").src
        plan = find_regions(graph, collapses, reduces, 1)
        assert graph.python_code("self").src == before, "the analysis changed the graph"
        assert plan.tokens == TOKENS
        # Every block is sharded in one region; the PLE conv (over tokens) runs on the rows of this rank and the
        # 9 before them, which its front zero pad held: that pad is the region's one halo.
        assert plan.cuts == ()
        [region] = plan.regions
        assert list(region.collapses) == collapses and region.why_start == "first HC block of the graph"
        if ple_layer is not None:
            conv = next(node for node in graph.nodes if node.target is torch.ops.aten.convolution.default)
            [halo] = region.halos
            assert halo.pad in ancestors([conv]) and halo.rows == 9 and conv in region.nodes, halo
        else:
            assert region.halos == ()
        assert [r.start for r in plan.regions] == [stream_value(r.collapses[0]) for r in plan.regions]
        assert sum(len(r.reduces) for r in plan.regions) == 2 * LAYERS
        for region in plan.regions:
            rewrite_region(graph, region)
        refresh_fake_values(graph)  # the manager's part after a resizing pass
        verify_graph(graph)
    # Each sub-layer input and the final mixer output are gathered; for the PLE conv, every rank's last rows.
    gathers = 2 * LAYERS + 1 + (ple_layer is not None)
    want = {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": gathers}
    assert collective_counts(captured.gm) == want


@pytest.mark.parametrize("ple_layer", [None, 1], ids=["no_ple", "ple_in_layer_1"])
def test_analysis_reads_and_emission_rewrites_the_region(ple_layer: int | None) -> None:
    check_parts(ple_layer)


def test_analysis_without_a_region_names_the_node_that_stops_it() -> None:
    """With no all-reduce to turn into a reduce-scatter there is nothing to shard: an empty plan whose cuts
    name the node where each attempt stopped, and the graph is unchanged."""
    cfg = HCConfig.tiny(n_layers=1, n_heads=12, n_kv_heads=12, intermediate=96, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(1))
    with fake_process_group(0, 2):
        [captured] = capture_post_grad(HCDecoder(cfg), (ids,), tp=2, rank=0, codegen=False)
        graph = captured.gm.graph
        collapses = CollapseFinder().find(graph)
        before = graph.python_code("self").src
        plan = find_regions(graph, collapses, [], 1)
        assert plan.regions == () and plan.cuts
        first = plan.cuts[0]
        assert first.node is stream_value(collapses[0])
        why = "no all-reduce feeds an HC block after this point"
        assert str(first) == f"{first.node.name} ({first.node.target}): {why}"
        assert graph.python_code("self").src == before


def test_final_norm_reading_the_last_write_back_alone_finds_it_as_the_stream_value() -> None:
    """The final mixer's grouped norm is the only reader of the last write-back ``h + y`` (no view between them,
    as ``tests/corpus`` writes it): walking back from the norm passes that add and meets h and the sub-layer's
    pieces; the stream value is the add, where they join. With it a region can start at the final mixer."""
    ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(1))
    with fake_process_group(0, 2):
        model = GatedMeanHC("einsum", None, 1, torch.float32, 2, 0)
        [captured] = capture_post_grad(model, (ids,), tp=2, rank=0, codegen=False)
        *blocks, final = CollapseFinder().find(captured.gm.graph)
        [last_reduce, *_] = reversed(find_all_reduces(captured.gm.graph))
        write_back = stream_value(final)
        assert write_back.target is torch.ops.aten.add.Tensor, write_back
        assert last_reduce.wait in ancestors([write_back])
        assert all(user in ancestors([final.root]) for user in write_back.users)  # the norm reads it alone
        assert all(not isinstance(stream_value(block), NotShardable) for block in blocks)

"""The SP region analysis (``sp_rewrite.region.find_regions``) read directly off captured graphs, without the rest of
the pass: where a region ends and why (a change of TP group, an unrecognised block's partial sums, a token window a
symbolic count cannot feed), what it takes on top of the HC blocks (the PLE's id features and their entries, a
final norm before kept rows, a sub-layer's narrowing prologue), what it gathers (exits: kept rows, stream-wide
values), and the retries that leave out an optional node the checks refuse (``_left_out``). The end-to-end tests
(``test_sp_groups``, ``test_sp_kept_rows``, ``test_sp_prologue``, ``test_sp_windows``, ``test_spellings``) check the
same behaviour through the whole pass and against eager; these are fast enough to judge mutants of ``region.py``
(``mutmut_score.py --scope region``). Graphs: rank 0 of TP 2, captured without any pass (fake process group)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from corpus.gated_residual import UserHC
from corpus.spelled import BlockSpelling, SpelledHC
from harness import capture_post_grad, fake_process_group
from test_sp_groups import TwoGroupDecoder
from test_spellings import fixed_weight_mean

from hcpasses.passes.sp_rewrite.collectives import AllReduceMatch, find_all_reduces
from hcpasses.passes.sp_rewrite.graph import ancestors
from hcpasses.passes.sp_rewrite.region import Plan, _left_out, find_regions
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.collapse import CollapseFinder
from hcpasses.testing.models import HCConfig, HCDecoder

aten = torch.ops.aten
TP = 2
LAYERS = 2
DECODER = HCConfig.tiny(n_layers=LAYERS, n_heads=12, n_kv_heads=12, intermediate=96, seed=2)


def ids_of(tokens: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))


@dataclasses.dataclass(frozen=True)
class Analysed:
    graph: fx.Graph
    reduces: tuple[AllReduceMatch, ...]  # every all-reduce of the graph, in graph order
    plan: Plan


def analysed(
    build: Callable[[], torch.nn.Module], args: tuple[Any, ...], dynamic: bool = False, min_tokens: int = 1
) -> Analysed:
    """Rank 0 of TP 2: the model built under the fake group, its post-grad graph, its all-reduces (found while the
    group exists) and the analysis's plan."""
    with fake_process_group(0, TP):
        [captured] = capture_post_grad(build(), args, tp=TP, rank=0, codegen=False, dynamic=dynamic)
        graph = captured.gm.graph
        reduces = find_all_reduces(graph)
        assert isinstance(reduces, tuple), reduces
        return Analysed(graph, reduces, find_regions(graph, CollapseFinder().find(graph), reduces, min_tokens))


@functools.cache
def two_groups() -> Analysed:
    return analysed(lambda: TwoGroupDecoder(dist.new_group([0, 1])), (ids_of(11),))


@functools.cache
def user_hc(tokens: int = 16, **options: Any) -> Plan:
    return analysed(lambda: UserHC("rsqrt", LAYERS, None, torch.float32, TP, 0, **options), (ids_of(tokens),)).plan


def test_a_region_ends_where_its_all_reduces_change_group_and_the_next_one_shards_over_the_other() -> None:
    found = two_groups()
    plan = found.plan
    [cut] = plan.cuts
    first, second = plan.regions
    assert (first.group.name, second.group.name) == ("0", "1")
    # layer 0's two sums over the default group, then layer 1's MLP sum over the other; layer 1's attention sum,
    # read where the first region ends, is in neither
    assert [len(region.reduces) for region in plan.regions] == [2, 1]
    assert all(match.group.name == region.group.name for region in plan.regions for match in region.reduces)
    attention_sum = next(m for m in found.reduces if m.group.name == "1")
    assert attention_sum.wait in cut.node.all_input_nodes, cut  # the cut is the first node reading that sum
    assert attention_sum not in first.reduces + second.reduces
    assert cut.why == (
        f"reads {attention_sum.all_reduce.name}, a sum over group '1' (rank 0 of 2), while the region's "
        "all-reduces sum over group '0' (rank 0 of 2): a region shards over one group"
    )
    assert first.why_start == "first HC block of the graph"
    assert second.why_start == f"first HC block after {cut}"
    assert not first.nodes & second.nodes


def test_a_region_is_refused_all_reduces_over_two_groups() -> None:
    first, second = two_groups().plan.regions
    with pytest.raises(ValueError, match=r"^a region reduces over exactly one group, got \[\"group '0'"):
        dataclasses.replace(first, reduces=first.reduces + second.reduces)
    with pytest.raises(ValueError, match=r"got \[\]$"):
        dataclasses.replace(first, reduces=())
    assert dataclasses.replace(first, reduces=first.reduces[:1]).group == first.group


def test_an_unrecognised_blocks_partial_sums_end_the_region_where_the_streams_branch_into_it() -> None:
    plain = BlockSpelling("rsqrt", "unflatten_mean", "reference")
    blocks = [plain, plain, plain, BlockSpelling("gemma", "unflatten_mean", None)]

    def build() -> SpelledHC:
        spelled = SpelledHC(blocks, BlockSpelling("rsqrt", "unflatten_mean", None), None, torch.float32, TP, 0, n=3)
        spelled.blocks[1].collapse = fixed_weight_mean
        return spelled

    found = analysed(build, (ids_of(9),))
    plan, reduces = found.plan, found.reduces
    [cut] = plan.cuts
    second = reduces[1]  # the sub-layer of the block with the fixed-weight mean
    assert cut.why == (
        f"feeds the TP partial sum {second.partial.name} of {second.all_reduce.name} through no recognised HC "
        "collapse (an unrecognised block's sub-layer must read all rows)"
    )
    # the streams after the first write-back branch into the unrecognised block: the cut is at that branch, and
    # the region holds the first block and its sum alone
    first = plan.regions[0]
    assert [m.all_reduce for m in first.reduces] == [reduces[0].all_reduce]
    assert cut.node not in first.nodes and any(arg in first.nodes for arg in cut.node.all_input_nodes), cut
    assert reduces[0].wait in ancestors([cut.node])
    assert second not in [m for region in plan.regions for m in region.reduces]


def test_the_ple_id_features_run_on_the_shards_read_by_rows_and_its_conv_on_a_halo() -> None:
    cfg = dataclasses.replace(DECODER, ple_layer=1)
    plan = analysed(lambda: HCDecoder(cfg), (ids_of(20, cfg.vocab_size),)).plan
    assert plan.cuts == ()
    [region] = plan.regions
    # the PLE's embedding of the ids is hoisted onto the shards; the ids it reads are sharded where it reads them
    assert region.hoisted == 1
    [entry] = region.entries
    assert entry.user.target is aten.embedding.default and entry.user in region.nodes
    assert entry.operand.op == "placeholder" and not entry.operand.meta["val"].is_floating_point()
    [halo] = region.halos
    assert halo.pad.target is aten.constant_pad_nd.default and (halo.dim, halo.rows) == (2, 9)
    assert any(node.target is aten.convolution.default for node in region.nodes)


@pytest.mark.parametrize(("min_tokens", "cut"), [(16, True), (17, False)])
def test_a_symbolic_count_feeds_a_token_window_only_where_every_rank_holds_as_many_rows(
    min_tokens: int, cut: bool
) -> None:
    """ceil(sp_min_tokens / tp) rows per rank must reach 9 rows back: 16 tokens leave 8 at tp 2, 17 leave 9."""
    cfg = dataclasses.replace(DECODER, ple_layer=1)
    plan = analysed(lambda: HCDecoder(cfg), (ids_of(20, cfg.vocab_size),), dynamic=True, min_tokens=min_tokens).plan
    assert not isinstance(plan.tokens, int)
    window = (
        "constant_pad_nd (aten.constant_pad_nd.default): a token window 9 rows back needs as many rows per rank; "
        f"with a symbolic token count, sharded graphs run from sp_min_tokens={min_tokens} tokens: 8 rows at tp 2"
    )
    if cut:
        [refused] = plan.cuts
        assert str(refused).endswith(window), refused
        assert all(region.halos == () for region in plan.regions)
    else:
        assert plan.cuts == ()
        [region] = plan.regions
        assert [(h.dim, h.rows) for h in region.halos] == [(2, 9)]


def test_exits_are_the_sub_layer_inputs_and_the_mixer_output_and_a_returned_state_is_stream_wide() -> None:
    ids = ids_of(9, DECODER.vocab_size)
    for returned in (False, True):
        plan = analysed(lambda: HCDecoder(DECODER), (ids, returned)).plan
        [region] = plan.regions
        # an all-reduce's result holds its tokens where its partial sum does (the emission shards both the same way)
        assert [region.dims[m.wait] for m in region.reduces] == [region.dims[m.partial] for m in region.reduces]
        assert {region.dims[m.partial] for m in region.reduces} == {1}
        wide = [exit for exit in region.exits if exit.stream_wide]
        assert len(region.exits) == 2 * LAYERS + 1 + returned
        assert len(wide) == returned
        for exit in region.exits:
            assert exit.users and all(user not in region.nodes for user in exit.users)
            assert region.dims[exit.value] == 1 and len(exit.sizes) == 1 and not exit.as_bytes and exit.kept == ()
        if returned:  # the streams after the last write-back, which the model returns as its HC state
            [state] = wide
            assert state.value.meta["val"].shape == (9, DECODER.streams_width)


def test_a_final_norm_before_kept_rows_runs_on_the_shards_and_only_those_rows_leave() -> None:
    plan = user_hc(keep=1, tail="norm")
    [region] = plan.regions
    assert plan.cuts == () and region.tail >= 5 and region.unkept == ()
    [kept] = [exit for exit in region.exits if exit.kept]
    assert len(kept.kept) == 1 and len(kept.users) == 1
    assert [exit for exit in region.exits if exit.stream_wide] == []


def test_a_final_step_across_the_tokens_stays_outside_and_a_slice_of_every_row_says_why() -> None:
    centred = user_hc(keep=1, tail="centred")
    [region] = centred.regions
    assert centred.cuts == () and region.tail == 0 and not any(exit.kept for exit in region.exits)
    both = user_hc(keep=1, tail="both")  # the norm's last row beside the centred output's
    [region] = both.regions
    assert both.cuts == () and region.tail >= 5 and sum(bool(exit.kept) for exit in region.exits) == 1
    too_many = user_hc(tokens=9, keep=5, tail="norm")  # tp copies of 5 rows are no fewer than 9
    [region] = too_many.regions
    assert too_many.cuts == () and region.tail == 0 and not any(exit.kept for exit in region.exits)
    [why] = region.unkept
    assert why.endswith("keeps 5 of 9 rows: 2 copies of them are no fewer than all rows"), why


def test_a_tensor_index_of_a_few_rows_reads_every_row_and_says_why() -> None:
    indexed = user_hc(keep=1, tail="index")  # hidden[arange(T - 1, T)]: which rows is a run-time value
    [region] = indexed.regions
    assert indexed.cuts == () and region.tail == 0 and not any(exit.kept for exit in region.exits)
    [why] = region.unkept
    assert why == "index_1 a tensor index keeping 1 of 16 rows: only slices and selects by static bounds are narrowed"


@pytest.mark.parametrize(("min_tokens", "kept"), [(4, False), (8, True)])
def test_with_a_symbolic_count_kept_rows_pay_only_from_sp_min_tokens(min_tokens: int, kept: bool) -> None:
    """3 kept rows, gathered from 2 ranks, are fewer than N only where every sharded call has N > 6 tokens."""
    build = functools.partial(UserHC, "rsqrt", LAYERS, None, torch.float32, TP, 0, keep=3, tail="norm")
    plan = analysed(build, (ids_of(16),), dynamic=True, min_tokens=min_tokens).plan
    [region] = plan.regions
    assert plan.cuts == () and not isinstance(plan.tokens, int)
    if kept:
        [exit] = [exit for exit in region.exits if exit.kept]
        [rows] = exit.kept
        assert (rows.count, rows.from_end, rows.dim) == (3, True, 0) and region.unkept == () and region.tail > 0
    else:
        assert not any(exit.kept for exit in region.exits) and region.tail == 0
        [why] = region.unkept
        assert why == "slice_1 keeps 3 of as few as 4 rows: 2 copies of them are no fewer than all rows"


def test_a_sub_layers_norm_joins_the_region_only_where_it_leaves_no_more_bytes_to_gather() -> None:
    narrowed = user_hc(prologue="norm_bf16")
    [region] = narrowed.regions
    assert narrowed.cuts == ()
    assert len(region.prologue) == 2 * LAYERS and all("(torch.bfloat16 [32])" in name for name in region.prologue)
    gathered = [exit for exit in region.exits if exit.value.meta["val"].dtype == torch.bfloat16]
    assert len(gathered) == 2 * LAYERS
    for prologue in ("none", "branch", "centred_bf16"):  # no norm, a gate beside it, a centring across the tokens
        plan = user_hc(prologue=prologue)
        [region] = plan.regions
        assert plan.cuts == () and region.prologue == (), prologue
    # an fp32 norm leaves as many bytes as x: it joins too (on the shards it runs on 1/tp of the rows)
    [region] = user_hc(prologue="norm").regions
    assert len(region.prologue) == 2 * LAYERS and all("(torch.float32 [32])" in name for name in region.prologue)


def chain() -> tuple[fx.Graph, list[fx.Node]]:
    """x -> a -> b -> c -> d -> output, and e beside them reading x: nodes to leave out of."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.neg, (x,))
    b = graph.call_function(torch.abs, (a,))
    c = graph.call_function(torch.exp, (b,))
    d = graph.call_function(torch.sin, (c,))
    e = graph.call_function(torch.cos, (x,))
    graph.output((d, e))
    return graph, [x, a, b, c, d, e]


def test_left_out_takes_a_refused_optional_node_and_the_optional_nodes_feeding_it() -> None:
    _, (_, a, b, c, _, _) = chain()
    optional = {a, b, c}
    assert _left_out(NotShardable("refused", c), optional) == {a, b, c}
    assert _left_out(NotShardable("refused", a), optional) == {a}


def test_left_out_takes_the_optional_neighbours_of_a_refused_region_node_and_what_feeds_them() -> None:
    _, (x, a, b, c, d, e) = chain()
    assert _left_out(NotShardable("refused", d), {a, b, c}) == {a, b, c}  # its operand c, and c's optional inputs
    assert _left_out(NotShardable("refused", x), {a, e}) == {a, e}  # a refused source: its optional readers
    assert _left_out(NotShardable("refused", d), {a, e}) == set()  # nothing optional next to it
    assert _left_out(NotShardable("the graph"), {a, b}) == set()  # a refusal of no node

"""SP through causal token windows: a depthwise conv over the tokens of the streams (a PLE's short conv) runs on each
rank's rows and the rows before them (``Layout.halo``), fetched by one small all-gather, instead of cutting the
region. Spellings it cannot shard (the conv's own padding, a centred window) cut the region with their reason and
stay exact; with a symbolic token count the window is sharded only where ``sp_min_tokens`` leaves every rank as
many rows as the window reaches back, and the graph asserts it. A front pad of seq in a ``[batch, seq]`` batch is
no window of the flattened rows: it cuts the region."""

from __future__ import annotations

import pytest
import torch
from corpus.gated_residual import UserHC
from harness import simulate
from harness.reference import RankGraphs, assert_same_as_sp_off, capture_with_passes, collective_counts
from test_sp_rewrite import assert_exact_at, with_tokens  # with_tokens: the captured inputs with other ids

from hcpasses.config import HCPassesConfig

LAYERS, CONV_LAYER = 2, 1  # the conv starts layer 1, after two sharded HC blocks
ALL_GATHERS = 2 * LAYERS + 1  # each sub-layer's x and the final mixer's


def ids_of(tokens: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))


def capture(window: str, tokens: int, tp: int, min_tokens: int = 1, dynamic: bool = False) -> RankGraphs:
    """Each rank's graph after the passes; a dynamic one also through Inductor's codegen (its runtime assert)."""
    ids = ids_of(tokens)
    return capture_with_passes(
        lambda rank, size: UserHC("rsqrt", LAYERS, CONV_LAYER, torch.float32, size, rank, window=window),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=min_tokens),
        dynamic=dynamic,
        codegen=dynamic,
    )


def assert_exact(sharded: RankGraphs, tokens: int, window: str) -> None:
    """Every rank's logits at ``tokens`` equal the SP-off graph's and eager's."""
    ids = ids_of(tokens)
    with torch.no_grad():
        expected = UserHC("rsqrt", LAYERS, CONV_LAYER, torch.float32, window=window)(ids)
    assert_exact_at(sharded, ids, expected)


# tokens, tp: R >= the reach of 2 rows (9 at tp 2), R < it (7 at tp 4: R = 2, then 2 at tp 4: R = 1, two ranks with
# padding only), T = 1 (the first rank alone holds a token)
@pytest.mark.parametrize(("tokens", "tp"), [(9, 2), (7, 4), (2, 4), (1, 3)])
def test_a_causal_conv_over_the_tokens_runs_on_each_ranks_rows_and_the_rows_before(tokens: int, tp: int) -> None:
    sharded = capture("front_pad", tokens, tp)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == 2 * LAYERS + 1 and (sp.facts["cuts"], sp.facts["halos"]) == (0, 1), sp.notes
    assert sp.facts["streams_gathered"] == 0, sp.notes  # the streams never leave their shards
    assert "token windows fed by the rows of the ranks before (a causal conv's halo): constant_pad_nd (2 rows)" in (
        sp.notes
    )
    # one all-gather of every rank's last min(R, 2) rows replaces the zero pad; no collective is left as it was
    want = {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": ALL_GATHERS + 1}
    assert all(collective_counts(gm) == want for gm in sharded.graphs)
    pads = [n for n in sharded.graphs[0].graph.nodes if n.target is torch.ops.aten.constant_pad_nd.default]
    assert all(list(n.args[1]) != [2, 0] for n in pads), "the conv's front zero pad is still there"
    assert_exact(sharded, tokens, "front_pad")


@pytest.mark.parametrize(
    ("window", "reason"),
    [
        ("own_padding", "a convolution along the tokens with a stride, a padding of its own or transposed"),
        ("centred", "pads a token dim (other than with zero rows in front of its one token dim)"),
    ],
)
def test_a_window_it_cannot_shard_cuts_the_region_with_its_reason(window: str, reason: str) -> None:
    sharded = capture(window, 9, 2)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == 2 * LAYERS + 1 and (sp.facts["cuts"], sp.facts["halos"]) == (1, 0), sp.notes
    [cut] = [note for note in sp.notes if note.startswith("region cut at")]
    assert reason in cut, cut
    assert_exact(sharded, 9, window)


def test_a_symbolic_token_count_shards_the_window_where_sp_min_tokens_leaves_enough_rows() -> None:
    # tp 2, reach 2: from T = 3 every rank holds >= 2 rows
    sharded = capture("front_pad", 9, 2, min_tokens=3, dynamic=True)
    sp = sharded.report.record("sp_rewrite")
    assert sp.facts["halos"] == 1 and sp.facts["cuts"] == 0, sp.notes
    for tokens in (3, 4, 9, 16):
        assert_exact(sharded, tokens, "front_pad")
    # Called directly with fewer tokens than sp_min_tokens (the backend runs those unsharded) the graph says so.
    ids = ids_of(2)
    inputs = [with_tokens(list(sharded.inputs[r]), gm, ids) for r, gm in enumerate(sharded.graphs)]
    with pytest.raises(RuntimeError, match="a token window reaches 2 rows back"):
        simulate(sharded.graphs, inputs)


def test_a_symbolic_token_count_below_the_reach_cuts_the_region_at_the_window() -> None:
    sharded = capture("front_pad", 9, 2, min_tokens=2, dynamic=True)  # T = 2: one row per rank
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["cuts"], sp.facts["halos"]) == (1, 0), sp.notes
    [cut] = [note for note in sp.notes if note.startswith("region cut at")]
    assert "sp_min_tokens=2 tokens: 1 rows at tp 2" in cut, cut
    for tokens in (2, 5):
        assert_exact(sharded, tokens, "front_pad")


def test_a_front_pad_of_seq_in_a_batch_is_no_window_and_cuts_the_region() -> None:
    """``[batch, seq]`` tokens: padding seq in front (``h + 0.5 * pad(h)[:, :-1]``, each token plus its
    predecessor) starts every sequence with zeros, so it is no window of the flattened token rows: the region is
    cut there with the pad's reason (not an error: a [batch, seq] pad once raised and rolled SP back), the blocks
    on both sides stay sharded, and the values are SP off's."""
    from test_sp_batched import captured_at, run

    sharded = captured_at((2, 1, False, False, False), (2, 7))  # tp 2, the shift starts layer 1, static
    sp = sharded.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 2 * LAYERS + 1 and sp.facts["halos"] == 0, sp.notes
    [cut] = [note for note in sp.notes if note.startswith("region cut at")]
    assert "pads a token dim (other than with zero rows in front of its one token dim)" in cut, cut
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    for got, want in zip(run(sharded, ids), run(sharded.sp_off(), ids), strict=True):
        assert_same_as_sp_off(got, want)

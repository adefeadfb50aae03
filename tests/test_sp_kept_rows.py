"""SP exits that keep a few token rows: where every reader of a region value is a slice keeping a few of its token
rows (serving's ``logits_to_keep=1``: ``hidden[-1:]`` before the LM head), only those rows are gathered, one
all-gather of tp * K rows instead of N, each kept row taken from the rank that holds it; a final step on every row
before the slice (an RMS norm) runs on the shards. Checked at static, ragged and symbolic token counts and with
rows held by two ranks, against SP off and eager; slices that would not gather fewer rows, and a final step that
is not row-local, keep the full gather and say why, without cutting the region."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from corpus.gated_residual import UserHC
from harness import simulate
from harness.reference import RankGraphs, capture_with_passes, collective_counts
from test_sp_rewrite import assert_exact_at, with_tokens  # with_tokens: the captured inputs with other ids

from hcpasses.config import HCPassesConfig

LAYERS = 2
ALL_GATHERS = 2 * LAYERS + 1  # each sub-layer's x, and the final mixer's (its kept rows, or all)
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
aten = torch.ops.aten


def ids_of(tokens: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens + 7))


def model(keep: int, tail: str, tp: int = 1, rank: int = 0) -> UserHC:
    return UserHC("rsqrt", LAYERS, None, torch.float32, tp, rank, keep=keep, tail=tail)


def capture(
    keep: int, tail: str, tokens: int, tp: int, min_tokens: int = 1, dynamic: bool = False, codegen: bool = False
) -> RankGraphs:
    """Each rank's graph after the passes; a dynamic one also through Inductor's codegen (its runtime assert), a
    static one where asked (the emitted index ops must be ones Inductor lowers)."""
    ids = ids_of(tokens)
    return capture_with_passes(
        lambda rank, size: model(keep, tail, size, rank),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=min_tokens),
        dynamic=dynamic,
        codegen=dynamic or codegen,
    )


def assert_exact(sharded: RankGraphs, tokens: int, keep: int, tail: str) -> None:
    """Every rank's logits at ``tokens`` equal the SP-off graph's and eager's (fp32: GEMM blocking only)."""
    ids = ids_of(tokens)
    with torch.no_grad():
        expected = model(keep, tail)(ids)
    # select: [vocab] logits; sequences: [B, keep, vocab]
    rows = {
        "select": 64,
        "select_before_last": 64,
        "both": 2 * min(keep, tokens),
        "two_sequences": 2,
        "one_sequence": 1,
    }.get(tail, min(keep, tokens))
    assert expected.shape[0] == rows
    assert_exact_at(sharded, ids, expected)


def gathered_rows(gm: torch.fx.GraphModule) -> list[int]:
    """The rows each all-gather of the graph sends from this rank."""
    return [node.args[0].meta["val"].shape[0] for node in gm.graph.nodes if node.target is GATHER]


def kept_row_ops(gm: torch.fx.GraphModule) -> tuple[Any, Any]:
    """What sends this rank's kept rows to the last all-gather, and what picks them out of its result."""
    *_, gather = (node for node in gm.graph.nodes if node.target is GATHER)
    [wait] = gather.users
    [pick] = wait.users
    return gather.args[0].target, pick.target


# tokens, tp, keep: the last row on the last rank (even), on a rank before padding-only ones (7 at tp 4: R = 2,
# row 6 on rank 3; 9 at tp 4: R = 3, row 8 on rank 2, rank 3 pads), and kept rows held by two ranks (14 at tp 4:
# R = 4, rows 11..13 on ranks 2 and 3)
@pytest.mark.parametrize(("tokens", "tp", "keep"), [(16, 2, 1), (7, 4, 1), (9, 4, 1), (9, 3, 2), (14, 4, 3)])
def test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards(tokens: int, tp: int, keep: int) -> None:
    sharded = capture(keep, "norm", tokens, tp, codegen=tokens == 14)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == 2 * LAYERS + 1 and sp.facts["cuts"] == 0, sp.notes
    assert (sp.facts["kept_rows_gathers"], sp.facts["streams_gathered"]) == (1, 0), sp.notes
    assert sp.facts["tail"] >= 5, sp.notes  # the norm: pow, mean, add, rsqrt, mul, mul (and dtype casts)
    kept = [note for note in sp.notes if note.startswith("values gathered only in the rows a token slice keeps")]
    assert kept and f"({keep} of {tokens} rows)" in kept[0], sp.notes
    rows = -(-tokens // tp)
    for gm in sharded.graphs:
        assert collective_counts(gm) == {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": ALL_GATHERS}
        # the sub-layers' x as before (R rows each), then the kept rows alone
        assert gathered_rows(gm) == [rows] * (2 * LAYERS) + [keep], gathered_rows(gm)
        # one row of a static N: sent and picked by slices (views), several by an index (a copy after the gather)
        expected = (aten.slice.Tensor,) * 2 if keep == 1 else (aten.index.Tensor,) * 2
        assert kept_row_ops(gm) == expected, kept_row_ops(gm)
    assert_exact(sharded, tokens, keep, "norm")


def test_a_symbolic_token_count_gathers_the_kept_rows_where_sp_min_tokens_leaves_enough() -> None:
    # tp 2, keep 3: 2 * 3 rows gathered are fewer than N for every N >= sp_min_tokens = 7
    sharded = capture(3, "norm", 12, 2, min_tokens=7, dynamic=True)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["kept_rows_gathers"], sp.facts["cuts"]) == (1, 0) and sp.facts["tail"] > 0, sp.notes
    for tokens in (7, 8, 11, 16):
        assert_exact(sharded, tokens, 3, "norm")
    # Called directly with fewer tokens than the slice keeps (the backend runs those unsharded) the graph says so.
    ids = ids_of(2)
    inputs = [with_tokens(list(sharded.inputs[r]), gm, ids) for r, gm in enumerate(sharded.graphs)]
    with pytest.raises(RuntimeError, match="a slice keeps rows up to 3 of a token dim"):
        simulate(sharded.graphs, inputs)


@pytest.mark.parametrize(
    ("tokens", "min_tokens", "dynamic", "reason"),
    [
        (9, 1, False, "keeps 5 of 9 rows: 2 copies of them are no fewer than all rows"),
        (12, 8, True, "keeps 5 of as few as 8 rows: 2 copies of them are no fewer than all rows"),
        (12, 4, True, "keeps rows up to 5 along dim 0; with a symbolic token count, sharded graphs run from "),
    ],
)
def test_a_slice_that_would_not_gather_fewer_rows_keeps_the_full_gather_and_says_why(
    tokens: int, min_tokens: int, dynamic: bool, reason: str
) -> None:
    sharded = capture(5, "norm", tokens, 2, min_tokens=min_tokens, dynamic=dynamic)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["kept_rows_gathers"], sp.facts["tail"], sp.facts["cuts"]) == (0, 0, 0), sp.notes
    [full] = [note for note in sp.notes if note.startswith("slices along the tokens that read every row all the")]
    assert reason in full, full
    rows = -(-tokens // 2)
    assert all(gathered_rows(gm) == [rows] * ALL_GATHERS for gm in sharded.graphs)
    for count in (tokens, min_tokens) if dynamic else (tokens,):
        assert_exact(sharded, count, 5, "norm")


def test_a_tensor_index_of_a_few_rows_is_gathered_in_full_and_the_report_says_why() -> None:
    """``hidden[arange(T - 2, T)]``, a tensor index (a ragged batch's last tokens, vLLM's ``logits_indices``): which
    rows it keeps is a run-time value, so the rows it reads are gathered in full, and the report names the index
    and why, instead of staying silent."""
    sharded = capture(2, "index", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["kept_rows_gathers"], sp.facts["cuts"]) == (0, 0), sp.notes
    [full] = [note for note in sp.notes if note.startswith("slices along the tokens that read every row all the")]
    assert "a tensor index keeping 2 of 10 rows: only slices and selects by static bounds are narrowed" in full, full
    assert all(gathered_rows(gm) == [5] * ALL_GATHERS for gm in sharded.graphs)
    assert_exact(sharded, 10, 2, "index")


def test_a_final_step_across_the_tokens_stays_outside_and_costs_no_block() -> None:
    """Centring over the tokens before the kept row is not row-local: it is left out of the region again (not a
    cut: every HC block stays sharded), the final mixer's output is gathered in full for it, the logits are exact."""
    sharded = capture(1, "centred", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == 2 * LAYERS + 1, sp.notes
    assert (sp.facts["cuts"], sp.facts["tail"], sp.facts["kept_rows_gathers"]) == (0, 0, 0), sp.notes
    assert all(gathered_rows(gm) == [5] * ALL_GATHERS for gm in sharded.graphs)
    assert_exact(sharded, 10, 1, "centred")


def test_a_refused_step_beside_a_final_norm_costs_only_itself() -> None:
    """Both: the norm's last row and the centred output's. The centring is left out of the tail (with what it
    feeds), the norm stays on the shards and is gathered in its kept row; the mixer's output is gathered in full for
    the centring. The refusal of one node costs only that node's branch."""
    sharded = capture(1, "both", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["cuts"], sp.facts["kept_rows_gathers"]) == (0, 1) and sp.facts["tail"] >= 5, sp.notes
    assert all(sorted(gathered_rows(gm)) == [1] + [5] * ALL_GATHERS for gm in sharded.graphs)
    assert_exact(sharded, 10, 1, "both")


def test_a_region_its_tail_breaks_is_built_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the tail make the region fail where the node-by-node checks cannot tell (here: the analysis refuses
    every region holding the final norm's rsqrt), the region is built again without its tail: no cut, no retry
    loop, every HC block sharded, the exit gathered in full."""
    from hcpasses.passes.sp_rewrite import region as region_module
    from hcpasses.passes.sp_rewrite.verdict import NotShardable

    resolve = region_module._RegionBuilder._resolve

    def refuse_the_final_norm(self: Any, start: torch.fx.Node, why_start: str, nodes: Any, *args: Any) -> Any:
        final_rsqrt = [node for node in start.graph.nodes if node.target is torch.ops.aten.rsqrt.default][-1]
        if final_rsqrt in nodes:
            return NotShardable("refused by the test", final_rsqrt)
        return resolve(self, start, why_start, nodes, *args)

    monkeypatch.setattr(region_module._RegionBuilder, "_resolve", refuse_the_final_norm)
    sharded = capture(1, "norm", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == 2 * LAYERS + 1, sp.notes
    assert (sp.facts["cuts"], sp.facts["tail"], sp.facts["kept_rows_gathers"]) == (0, 0, 0), sp.notes
    assert_exact(sharded, 10, 1, "norm")


def test_fp8_codes_and_scales_are_gathered_in_their_kept_rows_as_bytes() -> None:
    """The norm quantised per token before the kept row: the codes (as bytes: gloo has no FP8) and the scales are
    each gathered in their kept row, exactly (codes and scales are the same bytes whichever rank made them)."""
    sharded = capture(1, "fp8", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["cuts"], sp.facts["kept_rows_gathers"]) == (0, 2), sp.notes
    bytes_gathered = [
        node.args[0].meta["val"].dtype
        for node in sharded.graphs[0].graph.nodes
        if node.target is GATHER and node.args[0].meta["val"].shape[0] == 1
    ]
    assert sorted(map(str, bytes_gathered)) == ["torch.float32", "torch.uint8"], bytes_gathered
    assert_exact(sharded, 10, 1, "fp8")


@pytest.mark.parametrize(("tail", "keep"), [("select", 1), ("select_before_last", 1), ("before_last", 2)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_select_of_the_last_row_or_rows_before_it_are_gathered_alone(tail: str, keep: int, dynamic: bool) -> None:
    """``hidden[-1]`` and ``hidden[-2]`` (selects, not slices) keep one row, ``hidden[-3:-1]`` two counted from the
    end: each is gathered alone, at a static and a symbolic token count."""
    sharded = capture(keep, tail, 11, 2, min_tokens=5, dynamic=dynamic)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["cuts"], sp.facts["kept_rows_gathers"]) == (0, 1) and sp.facts["tail"] > 0, sp.notes
    assert all(gathered_rows(gm)[-1] == keep for gm in sharded.graphs)
    for tokens in (11, 5, 8) if dynamic else (11,):
        assert_exact(sharded, tokens, keep, tail)


# tail, keep, tokens, tp: [1, T, S] (transformers' layout) with row 8 on rank 2 of 4 (R = 3; rank 3 holds padding),
# the last row of each of two sequences (rows 7 and 15: one per rank), and the last two of each (rows 4, 5, 10, 11)
@pytest.mark.parametrize(
    ("tail", "keep", "tokens", "tp"),
    [("one_sequence", 1, 9, 4), ("two_sequences", 1, 16, 2), ("two_sequences", 2, 12, 2)],
)
def test_the_last_rows_of_each_sequence_are_gathered_alone(tail: str, keep: int, tokens: int, tp: int) -> None:
    """Two token dims (the rows viewed as sequences, ``[B, T/B, S]``), the slice along the second: the kept rows are
    B * keep rows of the flattened tokens, gathered alone; one row by slices, several by an index."""
    sharded = capture(keep, tail, tokens, tp)
    sp = sharded.report.record("sp_rewrite")
    assert (sp.facts["cuts"], sp.facts["kept_rows_gathers"]) == (0, 1) and sp.facts["tail"] > 0, sp.notes
    sequences = 2 if tail == "two_sequences" else 1
    for gm in sharded.graphs:
        assert gathered_rows(gm)[-1] == sequences * keep, gathered_rows(gm)
        expected = (aten.slice.Tensor,) * 2 if sequences * keep == 1 else (aten.index.Tensor,) * 2
        assert kept_row_ops(gm) == expected, kept_row_ops(gm)
    assert_exact(sharded, tokens, keep, tail)

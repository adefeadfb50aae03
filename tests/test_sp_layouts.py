"""Where a value holds its token rows (``sp_rewrite.tokens.Layout``) and how a reshape regroups them: the
promises of ``Layout``, ``normalized``, ``reshaped_layout``, ``leading_layout``, ``resolve_size`` and
``first_tensor``, with static and symbolic token counts (``mutmut_score.py --scope tokens`` judges them)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from hcpasses.passes.sp_rewrite.tokens import (
    Layout,
    SizeOf,
    first_tensor,
    leading_layout,
    normalized,
    reshaped_layout,
    resolve_size,
)

T = 9


def symbolic_tokens() -> torch.SymInt:
    return ShapeEnv().create_unbacked_symint()  # a size symbol with no value: only algebra can decide


@pytest.mark.parametrize(
    ("layout", "source", "out", "want"),
    [
        # tokens merged with the hidden dim: an einsum's per-token products as bmm operands
        (Layout(0, 1), [T, 32, 4], [T * 32, 1, 4], Layout(0, 1, inner=32)),
        # and back
        (Layout(0, 1, inner=32), [T * 32, 1, 4], [T, 32, 1], Layout(0, 1)),
        # stacked streams: n per-stream [T, S] values concatenated, then viewed [n, T, S]
        (Layout(0, 1, outer=4), [4 * T, 32], [4, T, 32], Layout(1, 2)),
        # the stream axis split over two dims in front, part of it left in the token dim
        (Layout(0, 1, outer=4), [4 * T, 32], [2, 2 * T, 32], Layout(1, 2, outer=2)),
        # [batch, seq] tokens flattened and split again
        (Layout(0, 2), [3, 3, 8], [T, 8], Layout(0, 1)),
        (Layout(0, 1), [T, 8], [3, 3, 2, 4], Layout(0, 2)),
        # size-1 dims at the ends of the token dims are not token dims
        (Layout(0, 1), [T, 8], [1, T, 8], Layout(1, 2)),
    ],
)
def test_reshape_regroups_the_token_rows(layout: Layout, source: list, out: list, want: Layout) -> None:
    assert reshaped_layout(layout, source, out, T) == want
    assert want.matches(out, T)


@pytest.mark.parametrize(
    ("layout", "source", "out"),
    [
        (Layout(0, 1), [T, 32], [3, 96]),  # three tokens per row: rows mix tokens
        (Layout(0, 1, outer=4), [4 * T, 32], [T, 4, 32]),  # the stream axis moved under the tokens by a view
    ],
)
def test_reshape_that_mixes_tokens_has_no_layout(layout: Layout, source: list, out: list) -> None:
    got = reshaped_layout(layout, source, out, T)
    # [T, 4, 32] from stream-major rows: row-major it is still (4, T, 32) grouped, never T leading
    assert got is None or got.outer * got.inner > 1, got


def test_reshape_factors_are_ints() -> None:
    # the emission multiplies sizes by them, and a float factor would turn every size it scales into a float
    for got in (
        reshaped_layout(Layout(0, 1), [T, 32, 4], [T * 32, 1, 4], T),
        reshaped_layout(Layout(0, 1, outer=4), [4 * T, 32], [2, 2 * T, 32], T),
    ):
        assert got is not None
        assert type(got.outer) is int and type(got.inner) is int, got


def test_reshape_of_one_token_keeps_its_dim() -> None:
    assert reshaped_layout(Layout(0, 1), [1, 8], [1, 8], 1) == Layout(0, 1)


def test_symbolic_token_count_keeps_static_factors() -> None:
    tokens = symbolic_tokens()
    merged = reshaped_layout(Layout(0, 1), [tokens, 32, 4], [tokens * 32, 1, 4], tokens)
    assert merged == Layout(0, 1, inner=32)
    stacked = reshaped_layout(Layout(0, 1, outer=4), [4 * tokens, 32], [4, tokens, 32], tokens)
    assert stacked == Layout(1, 2)
    # a size-1 dim in front: its prefix (1, an int) against a symbolic count is compared by algebra, no guard
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [1, tokens, 8], tokens) == Layout(1, 2)
    # a factor that is not static (the token count itself) is not a layout
    assert reshaped_layout(Layout(0, 1), [tokens, tokens], [tokens * tokens], tokens) is None


def test_normalized_drops_size_one_dims_at_the_ends_only() -> None:
    assert normalized(Layout(0, 3), [1, T, 1, 8]) == Layout(1, 2)
    assert normalized(Layout(0, 3), [3, 1, 3, 8]) == Layout(0, 3)  # a 1 between token dims stays
    assert normalized(Layout(0, 1), [1, 8]) == Layout(0, 1)  # one token: the dim stays
    assert normalized(Layout(0, 4), [1, 1, T, 1, 8]) == Layout(2, 3)  # several at each end
    assert normalized(Layout(1, 2), [4, 1, 8]) == Layout(1, 2)  # one token behind the streams: the dim stays


def test_layout_matches_only_dims_the_shape_has() -> None:
    assert Layout(0, 1).matches([T, 8], T)
    assert not Layout(0, 2).matches([T], T)  # the product of the dims it has is T, but dim 1 is missing
    assert not Layout(1, 1).matches([1, 8], 1)  # no token dim at all, though the empty product is 1 token
    assert Layout(0, 1, outer=4, inner=2).matches([8 * T, 8], T)
    assert not Layout(0, 1, outer=4).matches([T, 8], T)


def test_leading_dims_only_for_plain_leading_tokens() -> None:
    assert Layout(1, 2).leading_dims([1, T, 8]) == 2
    assert Layout(1, 2).leading_dims([4, T, 8]) is None  # streams in front
    assert Layout(0, 1, inner=32).leading_dims([T * 32, 4]) is None
    assert Layout(0, 1, outer=4).leading_dims([4 * T, 4]) is None
    assert Layout(0, 2).leading_dims([3, 3, 8]) == 2


def test_sharded_sizes_give_each_rank_its_rows_with_the_same_factors() -> None:
    rows = 5  # ceil(9 / 2)
    assert Layout(0, 1, inner=32).sharded_sizes([T * 32, 1, 4], rows) == [rows * 32, 1, 4]
    assert Layout(1, 2).sharded_sizes([4, T, 32], rows) == [4, rows, 32]
    assert Layout(0, 2).sharded_sizes([3, 3, -1], rows) == [1, rows, -1]
    assert Layout(0, 1, outer=2, inner=3).sharded_sizes([6 * T, 8], rows) == [6 * rows, 8]


def backed_size(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    """A size symbol with an example value, as Dynamo makes for a dynamic dim: comparing it adds guards."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    symbol = env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint)


def test_rows_split_into_sequences_and_merged_again_are_the_tokens_where_a_guard_says_so() -> None:
    # x.unflatten(0, (seqs, T // seqs)).flatten(0, 1) has seqs*(T//seqs) rows: sympy alone cannot cancel that with
    # T, but Dynamo guarded Eq(T, seqs*(T//seqs)) when it traced the unflatten, and the shape env knows it
    unguarded = ShapeEnv()  # its own env: the shape env caches what it could not prove
    tokens, seqs = backed_size(unguarded, "T", 15), backed_size(unguarded, "seqs", 3)
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [seqs * (tokens // seqs), 8], tokens) is None  # not proven
    env = ShapeEnv()
    tokens, seqs = backed_size(env, "T", 15), backed_size(env, "seqs", 3)
    rows = seqs * (tokens // seqs)
    assert bool(rows == tokens)  # what Dynamo's trace of the unflatten records
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [rows, 8], tokens) == Layout(0, 1)
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [rows * 4, 2], tokens) == Layout(0, 1, inner=4)
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [tokens // seqs, 8 * seqs], tokens) == Layout(0, 2, inner=8)
    # read as exact, other floor divisions give the same candidate, 1; no guard proves it, so it is refused
    heads = backed_size(env, "heads", 5)
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [heads * (tokens // heads), 8], tokens) is None


def test_floor_divided_rows_without_a_guard_are_not_the_tokens() -> None:
    env = ShapeEnv()
    tokens, seqs = env.create_unbacked_symint(), env.create_unbacked_symint()
    assert reshaped_layout(Layout(0, 1), [tokens, 8], [seqs * (tokens // seqs), 8], tokens) is None


def test_sharded_sizes_scale_the_rows_by_every_factor() -> None:
    assert Layout(0, 1, outer=2).sharded_sizes([2 * T, 8], 5) == [10, 8]
    assert Layout(0, 1).sharded_sizes([T, 8], 5) == [5, 8]


def test_leading_layout_skips_size_one_dims_in_front() -> None:
    assert leading_layout(torch.empty(1, T, 8, device="meta"), T) == Layout(1, 2)
    assert leading_layout(torch.empty(3, 3, 8, device="meta"), T) == Layout(0, 2)
    assert leading_layout(torch.empty(4, 8, device="meta"), T) is None
    assert leading_layout((1, 2), T) is None  # not a tensor


def test_first_tensor_of_a_multi_output_value() -> None:
    first = torch.empty(2, device="meta")
    assert first_tensor((None, 3, first, torch.empty(4, device="meta"))) is first
    assert first_tensor(first) is first


def test_resolve_size_names_the_start_dim_or_the_token_count() -> None:
    env = ShapeEnv()
    batch, seq, other = env.create_unbacked_symint(), env.create_unbacked_symint(), env.create_unbacked_symint()
    start = [batch, seq]
    assert resolve_size(5, start, batch * seq) == 5  # static sizes stay ints
    assert resolve_size(seq, start, batch * seq) == SizeOf(1)
    assert resolve_size(batch, start, batch * seq) == SizeOf(0)
    assert resolve_size(batch * seq, start, batch * seq) == SizeOf()  # N itself
    assert resolve_size(other, start, batch * seq) is None

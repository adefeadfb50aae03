"""The cleanup pass keeps every side effect; the row arithmetic of ``hcpasses.rows``; the pass result's defaults.
Fast tests for the mutation run (docs/TESTING.md)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from harness.graphs import traced

from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.passes.cleanup import DeadCodeCleanup
from hcpasses.rows import pad_rows, rows_per_rank, shard_rows, shard_shape, shard_token_sizes

aten = torch.ops.aten


def with_side_effects(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    _ = x * 3  # unused and pure: erased
    _ = torch.sin(x).cos()  # an unused chain: both erased
    buf.add_(1)  # an input mutation: kept
    torch.ops.aten.index_copy_(buf, 0, torch.tensor([1]), x[:1])  # a cache write: kept
    return x + 1


def test_cleanup_erases_unused_pure_nodes_and_keeps_mutations() -> None:
    graph = traced(with_side_effects, (3, 4), (3, 4)).graph
    mutations = [n for n in graph.nodes if n.op == "call_function" and n.is_impure()]
    assert len(mutations) == 2
    result = DeadCodeCleanup().run(graph, HCPassesConfig())
    targets = [n.target for n in graph.nodes]
    assert result == PassResult(applied=3)
    assert aten.cos.default not in targets and aten.sin.default not in targets
    assert all(m in graph.nodes for m in mutations)
    assert DeadCodeCleanup().run(graph, HCPassesConfig()) == PassResult(0, "no unused pure nodes")


def test_cleanup_keeps_an_unused_collective_and_rng_of_a_post_grad_graph() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    graph.call_function(aten.bernoulli_.float, (x, 0.5))
    graph.call_function(aten.neg.default, (x,))
    graph.output((x,))
    result = DeadCodeCleanup().run(graph, HCPassesConfig())
    assert result.applied == 1
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [
        torch.ops._c10d_functional.all_reduce.default,
        torch.ops._c10d_functional.wait_tensor.default,
        aten.bernoulli_.float,
    ]


def test_pass_result_defaults() -> None:
    result = PassResult(2)
    assert (result.applied, result.reason, result.notes, result.facts, result.sharded) == (2, None, (), {}, None)
    assert PassResult(1).facts is not PassResult(1).facts
    with pytest.raises(TypeError):
        GraphPass()  # abstract: a pass must define run


@pytest.mark.parametrize(
    ("tokens", "world", "rows"), [(1, 1, 1), (1, 2, 1), (7, 2, 4), (8, 2, 4), (9, 4, 3), (0, 3, 0), (16, 8, 2)]
)
def test_rows_per_rank_is_the_ceiling(tokens: int, world: int, rows: int) -> None:
    assert rows_per_rank(tokens, world) == rows


@pytest.mark.parametrize(("tokens", "world", "pad"), [(8, 2, 0), (9, 2, 1), (1, 8, 7), (10, 4, 2), (5, 1, 0)])
def test_pad_rows_make_the_rows_split_evenly(tokens: int, world: int, pad: int) -> None:
    assert pad_rows(tokens, world) == pad and (tokens + pad) % world == 0


def test_row_arithmetic_on_proxies_writes_it_into_the_graph() -> None:
    """The SP emission applies rows.py to fx proxies of a symbolic N: the graph then computes what ints give."""
    graph = torch.fx.Graph()
    tokens = torch.fx.Proxy(graph.placeholder("tokens"))
    graph.output((rows_per_rank(tokens, 4).node, pad_rows(tokens, 4).node))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert [module(n) for n in (1, 8, 10)] == [(1, 3), (2, 0), (3, 2)]


def test_shard_token_sizes_are_ones_then_the_rows() -> None:
    assert shard_token_sizes(5, 1) == [5]
    assert shard_token_sizes("R", 3) == [1, 1, "R"]


def test_shard_shape_keeps_rank_and_trailing_dims() -> None:
    assert shard_shape(torch.Size([9, 5]), 1, 2) == [5, 5]
    assert shard_shape(torch.Size([2, 7, 5, 3]), 2, 4) == [1, 4, 5, 3]
    assert shard_shape(torch.Size([2, 3, 7, 5]), 3, 2) == [1, 1, 21, 5]


@pytest.mark.parametrize(
    ("rank", "world", "token_dims", "match"),
    [
        (2, 2, 1, r"need 0 <= rank < world_size, got rank=2, world_size=2"),
        (-1, 2, 1, r"need 0 <= rank < world_size, got rank=-1, world_size=2"),
        (0, 0, 1, r"need 0 <= rank < world_size, got rank=0, world_size=0"),
        (0, 2, 0, r"token_dims must be in \[1, 2\] for a 2-D tensor, got 0"),
        (0, 2, 3, r"token_dims must be in \[1, 2\] for a 2-D tensor, got 3"),
    ],
)
def test_shard_rows_rejects_bad_arguments_naming_what_is_valid(
    rank: int, world: int, token_dims: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        shard_rows(torch.ones(5, 3), rank, world, token_dims)


def test_shard_rows_last_rank_of_a_ragged_split_is_zero_padded() -> None:
    x = torch.arange(1.0, 16.0).view(5, 3)
    assert torch.equal(shard_rows(x, 1, 2), torch.cat([x[3:], torch.zeros(1, 3)]))
    assert torch.equal(shard_rows(x, 0, 1), x)
    fake = torch.empty(5, 3, device="meta")
    assert torch.ops.hcpasses.shard_rows(fake, 1, 4).shape == (2, 3)

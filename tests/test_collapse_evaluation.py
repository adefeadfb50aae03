"""The stream collapse found by evaluation (``hcpasses.patterns.collapse_evaluation``), on ATen graphs traced from
plain functions: every spelling of the gated mean and of the mHC weighted sum is found, with the graph's own gate
and streams as its inputs; functions that differ from the collapse by a gate, a divisor or a stream pairing are
near misses named by their probe and never found; sizes: static small, symbolic, and static too large to probe."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from corpus.collapses import GATED_MEANS, GatedMeanHC
from harness import passes_run_every_compile
from torch.fx.experimental.proxy_tensor import make_fx

import hcpasses
from hcpasses.patterns.collapse_evaluation import find_by_evaluation

N, S = 4, 32


def traced(fn: Callable[..., torch.Tensor], *args: torch.Tensor, mode: str = "fake") -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode=mode)(*args)


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "placeholder"]


def output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    [out] = [node for node in gm.graph.nodes if node.op == "output"]
    return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


@pytest.mark.parametrize("spelling", sorted(GATED_MEANS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gated_mean_spelling_is_found_with_the_graphs_gate_and_streams(spelling: str, dtype: torch.dtype) -> None:
    u, xn = torch.randn(7, N * S, dtype=dtype), torch.randn(7, N * S, dtype=dtype)
    gm = traced(lambda u, xn: GATED_MEANS[spelling](u, xn, N, S), u, xn)
    found, misses = find_by_evaluation(gm.graph, set())
    [match] = found
    gate, streams = placeholders(gm)
    assert (match.gate, match.streams, match.n, match.normed) == (gate, streams, N, True)
    assert match.root is output_node(gm) and match.refusal is None
    assert misses == []


def weighted_sum_einsum(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tn,tnd->td", w, h.float()).to(h.dtype)


def weighted_sum_matmul(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return (w.to(h.dtype).unsqueeze(-2) @ h).squeeze(-2)


@pytest.mark.parametrize("fn", [weighted_sum_einsum, weighted_sum_matmul])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sums_are_found_with_fp32_gates(fn: Callable, dtype: torch.dtype) -> None:
    w, h = torch.randn(7, N), torch.randn(7, N, S, dtype=dtype)
    gm = traced(fn, w, h)
    [match], _ = find_by_evaluation(gm.graph, set())
    assert (match.gate, match.streams, match.n, match.normed) == (*placeholders(gm), N, False)
    assert match.root is output_node(gm)


def tanh_gate(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(u) * xn).view(-1, N, S).sum(-2) / N


def divided_by_three(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(u) * xn).view(-1, N, S).sum(-2) / 3


def gates_of_the_next_stream(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    gates = torch.sigmoid(u).view(-1, N, S).roll(1, dims=-2)
    return (gates * xn.view(-1, N, S)).mean(-2)


def first_stream_only(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(u) * xn)[:, :S] / N


@pytest.mark.parametrize("fn", [tanh_gate, divided_by_three, gates_of_the_next_stream, first_stream_only])
def test_near_misses_are_not_found_and_name_their_probe(fn: Callable) -> None:
    gm = traced(fn, torch.randn(7, N * S), torch.randn(7, N * S))
    found, misses = find_by_evaluation(gm.graph, set())
    assert found == []
    assert misses and misses[-1].root is output_node(gm), misses
    assert "differs from the collapse on the probe '" in str(misses[-1])


def test_an_fp32_sum_over_bf16_streams_is_found_with_its_rounding_outermost() -> None:
    """Rounded back to bf16 (ATOM's form), the collapse's x is the rounded value (fusable); left fp32, it is found
    for SP with a refusal: the fused op would round it."""
    u, xn = torch.randn(5, N * S, dtype=torch.bfloat16), torch.randn(5, N * S, dtype=torch.bfloat16)

    def unrounded(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(u.float()) * xn.float()).view(-1, N, S).sum(-2) / N

    rounded = traced(lambda u, xn: unrounded(u, xn).to(torch.bfloat16), u, xn)
    [match], _ = find_by_evaluation(rounded.graph, set())
    assert match.root is output_node(rounded) and match.refusal is None
    left_fp32 = traced(unrounded, u, xn)
    [match], _ = find_by_evaluation(left_fp32.graph, set())
    assert match.root is output_node(left_fp32)
    assert match.refusal is not None and "x stays torch.float32 over torch.bfloat16 streams" in match.refusal


def test_symbolic_token_sizes_are_probed_with_small_values() -> None:
    """Under dynamic shapes the collapse's reshapes read the token count from a graph input: every HC block of the
    corpus model (2 layers and the final mixer) is still found, and the graph still matches eager."""
    model, ids = GatedMeanHC("gate_then_split", None, 2, torch.float32), torch.randint(0, 64, (11,))
    torch._dynamo.reset()
    be = hcpasses.backend()
    with torch.no_grad(), passes_run_every_compile():
        compiled = torch.compile(model, backend=be, dynamic=True)
        out = compiled(ids)
        expected = model(ids)
        compiled(torch.randint(0, 64, (13,)))  # evaluation guards on no symbolic size: no recompile
    assert len(be.reports) == 1, [str(report) for report in be.reports]
    notes = be.reports[0].record("gated_mean_quant").notes
    assert notes[:2] == ("HC stream collapses found: 5", "of them found by evaluation (no pattern matched): 5"), notes
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def tokens_mixed_with_features(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    """The gated mean over ``[T*S, n]`` rows: the token count is spelled into another dim."""
    tokens = u.shape[0]
    gates = torch.sigmoid(u).view(tokens, N, S).transpose(1, 2).reshape(-1, N)
    streams = xn.view(tokens, N, S).transpose(1, 2).reshape(-1, N)
    return (gates * streams).mean(-1).view(tokens, S)


def test_static_sizes_too_large_to_probe_take_probe_rows_only_through_token_keeping_reshapes() -> None:
    """16384 tokens (above the probe limit): the reshape to [T, n, S] is respelled for the probe rows; a collapse that
    spells the token count into another dim cannot be probed, so it is neither found nor a near miss."""
    u, xn = torch.randn(16384, N * S), torch.randn(16384, N * S)
    split = traced(lambda u, xn: GATED_MEANS["gate_then_split"](u, xn, N, S), u, xn)
    assert len(find_by_evaluation(split.graph, set())[0]) == 1
    small = traced(tokens_mixed_with_features, u[:16], xn[:16])
    assert len(find_by_evaluation(small.graph, set())[0]) == 1  # at its own sizes, it is the collapse
    assert find_by_evaluation(traced(tokens_mixed_with_features, u, xn).graph, set()) == ([], [])


def test_nodes_of_collapses_found_otherwise_are_not_tried() -> None:
    gm = traced(
        lambda u, xn: GATED_MEANS["gate_then_split"](u, xn, N, S) * 2, torch.randn(3, N * S), torch.randn(3, N * S)
    )
    [match], _ = find_by_evaluation(gm.graph, set())
    assert find_by_evaluation(gm.graph, set(match.nodes) | {match.root}) == ([], [])


def test_a_graph_with_no_collapse_reports_its_near_misses() -> None:
    """A model whose collapse nothing takes: the fusion's report names the near miss and its probe."""
    torch._dynamo.reset()
    be = hcpasses.backend()
    with torch.no_grad(), passes_run_every_compile():
        torch.compile(divided_by_three, backend=be)(torch.randn(7, N * S), torch.randn(7, N * S))
    record = be.reports[0].record("gated_mean_quant")
    assert record.applied == 0 and record.reason.startswith("no HC stream collapse"), record
    [note] = [note for note in record.notes if note.startswith("collapse-shaped values that evaluate otherwise")]
    # the sum and the sum divided by 3: each evaluated, neither the collapse
    assert "left out: 2 (" in note and "div differs from the collapse on the probe 'mixed magnitudes'" in note, note

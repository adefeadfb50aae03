"""The canonical-forms pass alone: each rewrite fires on its spelling, leaves the values bit-identical, and
leaves near misses (forms that would change numerics) alone. Graphs are traced with ``make_fx`` (fake
values in ``meta["val"]``, as in a post-grad graph)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from hcpasses.config import HCPassesConfig
from hcpasses.passes.canonical_forms import CanonicalForms
from hcpasses.passes.gated_mean_quant import GatedMeanQuantFusion
from hcpasses.patterns.gated_mean import atom_gated_mean, per_token_quant

CONVERT = torch.ops.prims.convert_element_type.default


def post_grad_like(fn: Callable[..., object], *args: torch.Tensor) -> torch.fx.GraphModule:
    gm = fwd_only(fn, list(args))
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default:  # Inductor hands its post-grad passes reshapes
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    return gm


def insert_noop_convert(gm: torch.fx.GraphModule, after: Callable[[torch.fx.Node], bool]) -> None:
    """Put ``convert(t, t.dtype)`` after the first node ``after`` accepts, as torch 2.11's joint-graph passes
    leave one."""
    node = next(n for n in gm.graph.nodes if after(n))
    with gm.graph.inserting_after(node):
        convert = gm.graph.call_function(CONVERT, (node, node.meta["val"].dtype))
    convert.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(convert, delete_user_cb=lambda user: user is not convert)
    gm.recompile()


def max_values(x: torch.Tensor) -> torch.Tensor:
    return torch.max(x.abs(), dim=-1, keepdim=True).values


def amax_then_upcast(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().abs().amax(-1, keepdim=True).float() + x.bfloat16().float()


def sum_times_quarter(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (4, 8)).sum(-2) * 0.25


def sum_times_third(x: torch.Tensor) -> torch.Tensor:  # 1/3 is inexact: left alone
    return x[:, :24].unflatten(-1, (3, 8)).sum(-2) * (1.0 / 3.0)


def sigmoid_after_split(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.unflatten(-1, (4, 8))).mean(-2)


def sigmoid_after_one_token_reshape(x: torch.Tensor) -> torch.Tensor:  # [T, S] -> [T, 1, S]: no stream split
    return torch.sigmoid(x.unsqueeze(-2)).sum(-2)


def noop_convert(x: torch.Tensor) -> torch.Tensor:  # tracing drops a same-dtype convert: the test adds it back
    return x * 2 + 1


def gate_indexed_none(x: torch.Tensor) -> torch.Tensor:  # w[..., None]: unsqueeze(w, 1), a positive dim
    return (x[:, :4].sigmoid()[..., None] * x.unflatten(-1, (4, 8))).sum(-2)


def gate_indexed_none_not_summed(x: torch.Tensor) -> torch.Tensor:  # no gated sum behind it: left alone
    return x[:, :4].sigmoid()[..., None] * x.unflatten(-1, (4, 8))


def upcast_streams_into_gated_sum(x: torch.Tensor) -> torch.Tensor:  # DeepSeek's reference: upcast, then view
    streams = x.bfloat16().float().view(5, 4, 8)
    return (x[:, :4].sigmoid().unsqueeze(-1) * streams).sum(-2)


def upcast_into_product_not_summed(x: torch.Tensor) -> torch.Tensor:
    return x[:, :4].sigmoid().unsqueeze(-1) * x.bfloat16().float().view(5, 4, 8)


def upcast_after_the_stream_view(x: torch.Tensor) -> torch.Tensor:  # convert(view(h)): no reshape to redo
    return (x[:, :4].sigmoid().unsqueeze(-1) * x.bfloat16().view(5, 4, 8).float()).sum(-2)


def amax_of_signed_then_upcast(x: torch.Tensor) -> torch.Tensor:  # no abs: not a quant's amax, left alone
    return x.bfloat16().neg().amax(-1, keepdim=True).float()


def abs_read_twice_then_upcast(x: torch.Tensor) -> torch.Tensor:  # the bf16 abs has another reader: left alone
    magnitude = x.bfloat16().abs()
    return magnitude.amax(-1, keepdim=True).float() + magnitude.float()


def amax_then_upcast_beside_a_double(x: torch.Tensor) -> torch.Tensor:  # x's float64 convert is no f32 upcast
    low = x.bfloat16()
    return low.abs().amax(-1, keepdim=True).float() + low.double().sum(-1, keepdim=True).float()


NOTHING_TO_REWRITE = (
    "no equivalent spelling to rewrite (max.dim values, amax before the upcast, sum * (1/2^k), sigmoid after the "
    "stream split, no-op convert, positive unsqueeze dim or upcast into a gated sum, per-token bmm collapse)"
)

# (spelling, rewrites expected)
CASES: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = [
    (max_values, 1),
    (amax_then_upcast, 1),
    (sum_times_quarter, 1),
    (sum_times_third, 0),
    (sigmoid_after_split, 1),
    (sigmoid_after_one_token_reshape, 0),
    (noop_convert, 1),
    (gate_indexed_none, 1),
    (gate_indexed_none_not_summed, 0),
    (upcast_streams_into_gated_sum, 1),
    (upcast_into_product_not_summed, 0),
    (upcast_after_the_stream_view, 1),
    (amax_of_signed_then_upcast, 0),
    (abs_read_twice_then_upcast, 0),
    (amax_then_upcast_beside_a_double, 1),
]


def assert_fake_values_hold_and_nothing_is_dead(gm: torch.fx.GraphModule, *args: torch.Tensor) -> None:
    """Every node's ``meta["val"]`` (which later passes read, as Inductor does) has the shape and dtype that
    propagating the inputs through the rewritten graph gives it, and no node is left that nothing reads."""
    recorded = {node: node.meta.get("val") for node in gm.graph.nodes if node.op == "call_function"}
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    for node, val in recorded.items():
        want = node.meta["val"]
        assert isinstance(val, torch.Tensor), f"{node.name} ({node.target}) has no fake value"
        assert (tuple(val.shape), val.dtype) == (tuple(want.shape), want.dtype), (node.name, val, want)
    dead = [node.name for node in gm.graph.nodes if not node.users and node.op == "call_function"]
    assert not dead, f"the rewrite left nodes nothing reads: {dead}"


@pytest.mark.parametrize(("spelling", "rewrites"), CASES, ids=[f.__name__ for f, _ in CASES])
def test_each_rewrite_fires_on_its_spelling_and_keeps_every_bit(spelling: Callable, rewrites: int) -> None:
    gm = post_grad_like(spelling, torch.randn(5, 32))
    if spelling is noop_convert:
        insert_noop_convert(gm, lambda node: node.target is torch.ops.aten.mul.Tensor)
    inputs = [torch.randn(5, 32, generator=torch.Generator().manual_seed(seed)) * 100 for seed in range(4)]
    before = [gm(x) for x in inputs]
    result = CanonicalForms().run(gm.graph, HCPassesConfig())
    gm.recompile()
    gm.graph.lint()
    assert result.applied == rewrites == len(result.notes), result
    assert_fake_values_hold_and_nothing_is_dead(gm, inputs[0])
    if not rewrites:  # the report names every spelling the pass looked for
        assert result.reason == NOTHING_TO_REWRITE, result.reason
    for x, want in zip(inputs, before, strict=True):
        got = gm(x)
        assert torch.equal(got, want) and got.dtype == want.dtype


def keepdim_by_name(gm: torch.fx.GraphModule, target: object) -> None:
    """Pass ``keepdim`` to the first ``target`` node by name, as a graph built by hand (or another pass) may."""
    node = next(n for n in gm.graph.nodes if n.target is target)
    *args, keepdim = node.args
    node.args, node.kwargs = tuple(args), {"keepdim": keepdim}
    gm.recompile()


@pytest.mark.parametrize(
    ("spelling", "target"),
    [(max_values, torch.ops.aten.max.dim), (amax_then_upcast, torch.ops.aten.amax.default)],
    ids=["max_values", "amax_then_upcast"],
)
def test_a_keepdim_passed_by_name_is_kept(spelling: Callable, target: object) -> None:
    x = torch.randn(5, 32) * 100
    gm = post_grad_like(spelling, x)
    keepdim_by_name(gm, target)
    want = gm(x)
    assert CanonicalForms().run(gm.graph, HCPassesConfig()).applied == 1
    gm.recompile()
    assert_fake_values_hold_and_nothing_is_dead(gm, x)
    got = gm(x)
    assert got.shape == want.shape and torch.equal(got, want)


def test_collapse_left_in_fp32_by_torch_211_still_fuses() -> None:
    """torch 2.11's ``pointless_convert`` leaves ``convert(x, f32)`` of an fp32 x between an fp32 collapse and its
    quant (it drops the model's bf16 rounding). The no-op hides the quant from the traced patterns, not from
    evaluation, which fuses it as it is; with the no-op gone the pattern matches, as on the GPU machine."""

    def collapse_then_quant(u: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token_quant(atom_gated_mean(u, xn, 4, 8))

    u, xn = torch.randn(6, 32), torch.randn(6, 32)
    gm = post_grad_like(collapse_then_quant, u, xn)
    want = gm(u, xn)
    insert_noop_convert(gm, lambda node: node.target is torch.ops.aten.div.Tensor and node.args[1] == 4)
    unmatched = copy.deepcopy(gm)
    by_evaluation = GatedMeanQuantFusion().run(unmatched.graph, HCPassesConfig())
    assert by_evaluation.applied == 1 and "of them matched by evaluation (7 probes): 1" in by_evaluation.notes
    assert CanonicalForms().run(gm.graph, HCPassesConfig()).applied == 1
    by_pattern = GatedMeanQuantFusion().run(gm.graph, HCPassesConfig())
    assert by_pattern.applied == 1 and not any("evaluation" in note for note in by_pattern.notes)
    gm.recompile()
    got = gm(u, xn)
    assert any(node.target is torch.ops.hcpasses.gated_mean_quant.default for node in gm.graph.nodes)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def matmul_collapse(x: torch.Tensor) -> torch.Tensor:  # an Ascend port: one [1, n] @ [n, S] GEMM per token
    return torch.matmul(x[:, :4].softmax(-1).view(5, 1, 4), x.view(5, 4, 8)).view(5, 8)


def einsum_collapse(x: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tn,tnd->td", x[:, :4].softmax(-1), x.view(5, 4, 8))


def matmul_collapse_of_two_streams(x: torch.Tensor) -> torch.Tensor:  # n = 2, the fewest streams an HC has
    return torch.matmul(x[:, :2].softmax(-1).view(5, 1, 2), x[:, :16].view(5, 2, 8)).view(5, 8)


def matmul_collapse_at_one_token_each(x: torch.Tensor) -> torch.Tensor:  # [B, 1, S] used as it is (decode)
    return torch.matmul(x[:, :4].softmax(-1).view(5, 1, 4), x.view(5, 4, 8))


def attention_at_one_query(x: torch.Tensor) -> torch.Tensor:  # q @ k^T: k^T is a transpose, not streams
    return torch.matmul(x[:, None, :4], x.view(5, 8, 4).transpose(-1, -2)).view(5, 8)


def sixteen_row_product(x: torch.Tensor) -> torch.Tensor:  # n = 16 > MAX_STREAMS: an expert GEMM, say
    return torch.matmul(x[:, :16].view(5, 1, 16), x.repeat(1, 4).view(5, 16, 8)).view(5, 8)


# (spelling, rewrites expected): the one rewrite that may change the order of the n terms of a sum
BMM_CASES = [
    (matmul_collapse, 1),
    (einsum_collapse, 1),
    (matmul_collapse_of_two_streams, 1),
    (matmul_collapse_at_one_token_each, 1),
    (attention_at_one_query, 0),
    (sixteen_row_product, 0),
]


@pytest.mark.parametrize(("spelling", "rewrites"), BMM_CASES, ids=[f.__name__ for f, _ in BMM_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_per_token_bmm_becomes_the_gated_sum_within_its_rounding(
    spelling: Callable, rewrites: int, dtype: torch.dtype
) -> None:
    """The bmm's products summed in fp32 and rounded once, as the GEMM does: bf16 results may differ by the
    order of the n fp32 terms before their one rounding (one bf16 step at most), fp32 ones by fp32 rounding."""
    gm = post_grad_like(spelling, torch.randn(5, 32, dtype=dtype))
    inputs = [torch.randn(5, 32, generator=torch.Generator().manual_seed(seed)).to(dtype) for seed in range(4)]
    before = [gm(x) for x in inputs]
    result = CanonicalForms().run(gm.graph, HCPassesConfig())
    gm.recompile()
    gm.graph.lint()
    assert result.applied == rewrites == len(result.notes), result
    assert any(n.target is torch.ops.aten.bmm.default for n in gm.graph.nodes) == (rewrites == 0)
    assert_fake_values_hold_and_nothing_is_dead(gm, inputs[0])
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
    for x, want in zip(inputs, before, strict=True):
        got = gm(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def matmul_collapse_in_batch_layout(x: torch.Tensor) -> torch.Tensor:  # viewed back to [batch, seq, S]
    return torch.matmul(x[:, :4].softmax(-1).view(5, 1, 4), x.view(5, 4, 8)).view(1, 5, 8)


@pytest.mark.parametrize("spelling", [matmul_collapse, matmul_collapse_in_batch_layout], ids=lambda f: f.__name__)
def test_the_gated_sum_is_computed_in_the_layout_the_bmm_is_viewed_back_to(spelling: Callable) -> None:
    """The docstring's promise: the gates and streams are viewed to the result's token layout, so that what
    reads the collapse (a quant, SP's exit) reads the sum itself, not a reshape of a ``[B, 1, S]`` sum."""
    x = torch.randn(5, 32)
    gm = post_grad_like(spelling, x)
    want = gm(x)
    assert CanonicalForms().run(gm.graph, HCPassesConfig()).applied == 1
    gm.recompile()
    result = gm.graph.output_node().args[0]  # the one value the spelling returns
    assert result.target is torch.ops.aten.sum.dim_IntList, gm.graph
    assert tuple(result.meta["val"].shape) == tuple(want.shape)
    torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-6)


def test_mhc_collapse_whose_rounding_torch_211_folds_is_found_not_fused() -> None:
    """On torch 2.11, ``pointless_convert`` folds an mHC collapse's ``.to(bf16)`` and the ``.float()`` of what
    reads it (a norm, a quant): the sum stays fp32. That block is still an HC collapse (found once, so SP shards
    it), but the fused op rounds x to bf16 first, so it is left unfused and the report says why. With the
    rounding kept (torch 2.13), the same block fuses and the fp32 sum inside it is not counted twice."""

    def unrounded(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token_quant((w.unsqueeze(-1) * h).sum(-2))

    def rounded(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token_quant((w.unsqueeze(-1) * h).sum(-2).to(h.dtype))

    w, h = torch.rand(6, 4), torch.randn(6, 4, 16, dtype=torch.bfloat16)
    for spelling, fused in ((unrounded, 0), (rounded, 1)):
        gm = post_grad_like(spelling, w, h)
        want = gm(w, h)
        result = GatedMeanQuantFusion().run(gm.graph, HCPassesConfig())
        gm.recompile()
        assert result.notes[:2] == ("HC stream collapses found: 1", f"fused with a per-token FP8 quant: {fused}")
        assert result.applied == fused
        if not fused:
            assert "x stays float32 over torch.bfloat16 streams" in result.reason, result.reason
            got = gm(w, h)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))

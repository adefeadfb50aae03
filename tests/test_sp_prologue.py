"""SP prologues: a sub-layer's row-local steps before its GEMMs (an RMS norm cast to the GEMMs' bf16, after an fp32
HC collapse, as deepseek_v4's mHC) run on the shards when the value they leave is no wider than the one gathered
today, and the gather moves that value (bf16 instead of fp32; an fp32 norm's fp32 result). Checked at static,
ragged and symbolic token counts against SP off and eager; a norm beside another reader of x and a step across the
tokens keep the gather where it was, without cutting the region."""

from __future__ import annotations

import pytest
import torch
from corpus.gated_residual import UserHC
from harness.reference import RankGraphs, assert_same_as_sp_off, capture_with_passes, collective_counts
from test_sp_rewrite import run

from hcpasses.config import HCPassesConfig

LAYERS = 2
SUBLAYERS = 2 * LAYERS
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
NARROWED = "sub-layer inputs gathered past their row-local prologue"


def ids_of(tokens: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens + 11))


def model(prologue: str, tp: int = 1, rank: int = 0) -> UserHC:
    return UserHC("rsqrt", LAYERS, None, torch.float32, tp, rank, prologue=prologue)


def capture(prologue: str, tokens: int, tp: int, dynamic: bool = False) -> RankGraphs:
    ids = ids_of(tokens)
    return capture_with_passes(
        lambda rank, size: model(prologue, size, rank),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=1),
        dynamic=dynamic,
        codegen=dynamic,
    )


aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
VIEWS = {aten.slice.Tensor, aten.reshape.default, aten.view.default, aten.permute.default, aten.t.default}
VIEWS |= {torch.ops._c10d_functional.wait_tensor.default}


def steps_to_gemms(gather: torch.fx.Node) -> set:
    """The ops on the paths from an all-gather to the GEMMs that read its rows."""
    visited, stack = set(), list(gather.users)
    while stack:
        node = stack.pop()
        if node.target not in GEMMS and node not in visited:
            visited.add(node)
            stack.extend(node.users)
    return {node.target for node in visited}


def gathered_dtypes(gm: torch.fx.GraphModule) -> list[torch.dtype]:
    return [node.args[0].meta["val"].dtype for node in gm.graph.nodes if node.target is GATHER]


def assert_like_sp_off_and_eager(sharded: RankGraphs, tokens: int, prologue: str) -> None:
    """Every rank's logits at ``tokens`` against the SP-off graph's and eager's. The sub-layers read bf16: a
    last-bit difference of an fp32 HC GEMM on R rows instead of T may flip one bf16 rounding, which moves that
    token's row (``assert_same_as_sp_off``'s rule for rounded sub-layer inputs)."""
    ids = ids_of(tokens)
    with torch.no_grad():
        expected = model(prologue)(ids)
    for got, want in zip(run(sharded, ids), run(sharded.sp_off(), ids), strict=True):
        assert_same_as_sp_off(got, want, fp8=True)
        torch.testing.assert_close(got[0], expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(("tokens", "tp"), [(16, 2), (7, 4), (12, 3), (16, 8)])  # tp 8: the GEMM output is narrower
def test_a_norm_before_bf16_gemms_runs_on_the_shards_and_its_bf16_result_is_gathered(tokens: int, tp: int) -> None:
    sharded = capture("norm_bf16", tokens, tp)
    sp = sharded.report.record("sp_rewrite")
    assert sp.applied == SUBLAYERS + 1 and sp.facts["cuts"] == 0, sp.notes
    assert sp.facts["prologue_gathers"] == SUBLAYERS, sp.notes
    narrowed = next(note for note in sp.notes if note.startswith(NARROWED))
    assert narrowed.count("torch.bfloat16 [32]") == SUBLAYERS, narrowed
    for gm in sharded.graphs:
        assert collective_counts(gm) == {"all_reduce": 0, "reduce_scatter": SUBLAYERS, "all_gather": SUBLAYERS + 1}
        # each sub-layer's normed x in bf16 (half the bytes of the fp32 x), then the final mixer's output
        assert gathered_dtypes(gm) == [torch.bfloat16] * SUBLAYERS + [torch.float32], gm.graph
    assert_like_sp_off_and_eager(sharded, tokens, "norm_bf16")


def test_a_symbolic_token_count_gathers_the_narrower_prologue_value() -> None:
    sharded = capture("norm_bf16", 9, 2, dynamic=True)
    sp = sharded.report.record("sp_rewrite")
    assert sp.facts["prologue_gathers"] == SUBLAYERS and sp.facts["cuts"] == 0, sp.notes
    assert gathered_dtypes(sharded.graphs[0])[:SUBLAYERS] == [torch.bfloat16] * SUBLAYERS
    for tokens in (9, 14):  # one graph, compiled through Inductor's codegen, at two token counts
        assert_like_sp_off_and_eager(sharded, tokens, "norm_bf16")


@pytest.mark.parametrize(
    ("prologue", "why"),
    [
        ("branch", "x is gathered for its gate anyway: the bf16 norm would add bytes"),
        ("centred_bf16", "the centring reads every token: the cast after it cannot move"),
    ],
)
def test_a_prologue_that_would_not_gather_fewer_bytes_stays_after_the_gather(prologue: str, why: str) -> None:
    sharded = capture(prologue, 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert sp.facts["prologue_gathers"] == 0, (why, sp.notes)
    assert sp.facts["cuts"] == 0 and sp.applied == SUBLAYERS + 1, (why, sp.notes)
    assert f"{NARROWED}, no wider (a norm and its cast before the GEMMs): none" in sp.notes, sp.notes
    for gm in sharded.graphs:
        assert gathered_dtypes(gm)[:SUBLAYERS] == [torch.float32] * SUBLAYERS, (why, gm.graph)
    assert_like_sp_off_and_eager(sharded, 10, prologue)


def test_a_norm_that_leaves_as_many_bytes_runs_on_the_shards() -> None:
    """An fp32 norm of the fp32 x leaves as many bytes per token to gather as x itself: it runs on the shards (R
    rows, as the hand-written SP's norms; left after the gather it ran on all T rows of every rank: deepseek_v4's
    bf16 input norms), and the gather moves its result."""
    sharded = capture("norm", 10, 2)
    sp = sharded.report.record("sp_rewrite")
    assert sp.facts["prologue_gathers"] == SUBLAYERS and sp.facts["cuts"] == 0, sp.notes
    narrowed = next(note for note in sp.notes if note.startswith(NARROWED))
    assert narrowed.count("torch.float32 [32]") == SUBLAYERS, narrowed
    for gm in sharded.graphs:
        assert gathered_dtypes(gm) == [torch.float32] * (SUBLAYERS + 1), gm.graph
        norms = [node for node in gm.graph.nodes if node.target is torch.ops.aten.rsqrt.default]
        assert len(norms) >= 2 * SUBLAYERS + 1  # the HC blocks' and the sub-layers' norms
        assert {node.meta["val"].shape[0] for node in norms} == {5}, [n.meta["val"].shape for n in norms]  # R rows
        # the whole norm, its weight too, ran before the gather: between a gather and its GEMMs only views
        for gather in [node for node in gm.graph.nodes if node.target is GATHER][:SUBLAYERS]:
            assert steps_to_gemms(gather) <= VIEWS, (steps_to_gemms(gather), gm.graph)
    assert_like_sp_off_and_eager(sharded, 10, "norm")


def test_the_prologue_model_gathers_fp32_without_the_prologue_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model with prologues turned off gathers the fp32 x: what the bf16 gathers above save is real."""
    import hcpasses.passes.sp_rewrite.region as region

    monkeypatch.setattr(region._RegionBuilder, "_prologue", lambda self, nodes, refused: set())
    sharded = capture("norm_bf16", 16, 2)
    assert sharded.report.record("sp_rewrite").facts["prologue_gathers"] == 0
    assert gathered_dtypes(sharded.graphs[0])[:SUBLAYERS] == [torch.float32] * SUBLAYERS
    assert_like_sp_off_and_eager(sharded, 16, "norm_bf16")

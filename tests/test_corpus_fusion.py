"""The fusion on the spelling corpus (``tests/corpus``): quants written independently (``quants.CORPUS``) after the
gated mean of an independently written HC model (``gated_residual.UserHC``), and collapses written independently
(``collapses.GATED_MEANS`` / ``collapses.WEIGHTED_SUMS``) before the reference quant. Every quant labelled identical
(``quants.IDENTICAL``, checked by tests/test_corpus_classification.py) fuses every HC block's quant in fp32 and
bf16; every near miss (``quants.NEAR_MISSES``) is left unfused and the report says it is a near miss of the
per-token quant. Every collapse spelling fuses with the quant behind it: the gated means, which no traced pattern
holds, found as collapses by evaluation (``hcpasses.patterns.collapse_evaluation``), and the report says so. In each
case the compiled model matches eager. (The fused op's numerics against the unfused graph:
tests/test_gated_mean_quant.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corpus.collapses import GATED_MEANS, WEIGHTED_SUMS, GatedMeanHC, WeightedSumMHC
from corpus.gated_residual import UserHC
from corpus.quants import CORPUS, IDENTICAL, NEAR_MISSES, QUANTS
from harness import passes_run_every_compile
from harness.reference import assert_near_eager, fused_op_count

import hcpasses
from hcpasses.report import GraphReport

LAYERS = 1
DTYPES = [torch.float32, torch.bfloat16]
# canonical_forms rewrites per graph, for the pattern-era spellings (QUANTS); amax before the upcast is already
# canonical in fp32 (the upcast is a no-op there)
REWRITTEN = {"reference": 0, "method_chain": 0, "max_values": 2 * LAYERS}
# Representatives of each family run in the quick run (the three misses among them); the rest, ~2-5 s a
# compile each, are left to the thorough one.
QUICK = {"vllm_upcast_first", "maximum_floor", "vllm_native_reciprocal", "einsum", "fp32_einsum"}


def cases(names: list[str]) -> list:
    """``(name, dtype)`` params, all but QUICK's marked thorough."""
    params = []
    for name in names:
        for dtype in DTYPES:
            marks = [] if name in QUICK else [pytest.mark.thorough]
            params.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return params


class QuantisedUserHC(UserHC):
    """Each sub-layer reads its input through a per-token FP8 quant and dequant (PTPC-FP8 linear's input)."""

    def __init__(self, quant: str, dtype: torch.dtype) -> None:
        super().__init__("rsqrt", LAYERS, None, dtype)
        self.quant = CORPUS[quant]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids].repeat(1, self.n)
        for block, sublayer in zip(self.blocks, self.sublayers, strict=True):
            x, inject = block(h)
            q, scale = self.quant(x)
            h = block.combine(h, sublayer((q.float() * scale).to(x.dtype)), inject)
        return F.linear(self.final(h)[0], self.head)


def compiled_graph_and_output(model: torch.nn.Module, ids: torch.Tensor, **flags: bool) -> tuple:
    torch._dynamo.reset()
    be = hcpasses.backend(**flags)
    with torch.no_grad(), passes_run_every_compile():
        graphs = []
        record = lambda graph: graphs.append(torch.fx.GraphModule(torch.nn.Module(), graph))  # noqa: E731
        with torch._inductor.config.patch(post_grad_custom_post_pass=record):
            out = torch.compile(model, backend=be)(ids)
    return be.reports[0], graphs[0], out


def assert_matches_eager(model: torch.nn.Module, ids: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
    with torch.no_grad():
        expected = model(ids)
    # The fused op quantises x as the spelled-out quant does (DESIGN §5); bf16 eager rounds the stream sum
    # and the model's intermediates where the compiled graph keeps fp32, which may flip an FP8 code.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def token_ids() -> torch.Tensor:
    return torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("quant", "dtype"), cases(sorted(IDENTICAL)))
def test_every_identical_quant_spelling_fuses_every_block(quant: str, dtype: torch.dtype) -> None:
    model, ids = QuantisedUserHC(quant, dtype), token_ids()
    report, graph, out = compiled_graph_and_output(model, ids)
    assert report.applied["gated_mean_quant"] == 2 * LAYERS == fused_op_count(graph), report
    if quant in QUANTS:
        rewritten = REWRITTEN.get(quant, 2 * LAYERS if dtype != torch.float32 else 0)
        assert report.applied["canonical_forms"] == rewritten, report
    assert_matches_eager(model, ids, out, dtype)


@pytest.mark.parametrize(("quant", "dtype"), cases(sorted(NEAR_MISSES)))
def test_every_near_miss_is_left_unfused_and_named(quant: str, dtype: torch.dtype) -> None:
    model, ids = QuantisedUserHC(quant, dtype), token_ids()
    report, graph, out = compiled_graph_and_output(model, ids)
    assert report.applied["gated_mean_quant"] == 0 == fused_op_count(graph), report
    reason = report.record("gated_mean_quant").reason
    assert reason.count("near miss of the per-token quant") == 2 * LAYERS, reason  # each block's, by its probe
    assert_matches_eager(model, ids, out, dtype)


def assert_collapses_fused(report: GraphReport, graph: torch.fx.GraphModule) -> None:
    fusion = report.record("gated_mean_quant")
    assert fusion.notes[0] == f"HC stream collapses found: {2 * LAYERS + 1}", fusion.notes  # + the final mixer
    assert fusion.applied == 2 * LAYERS == fused_op_count(graph), report


@pytest.mark.parametrize(("collapse", "dtype"), cases(list(GATED_MEANS)))
def test_every_gated_mean_spelling_fuses_with_its_quant(collapse: str, dtype: torch.dtype) -> None:
    model, ids = GatedMeanHC(collapse, "reference", LAYERS, dtype), token_ids()
    report, graph, out = compiled_graph_and_output(model, ids)
    assert_collapses_fused(report, graph)
    by_evaluation = f"of them found by evaluation (no pattern matched): {2 * LAYERS + 1}"
    assert by_evaluation in report.record("gated_mean_quant").notes, report
    assert_matches_eager(model, ids, out, dtype)


@pytest.mark.parametrize(("collapse", "dtype"), cases(list(WEIGHTED_SUMS)))
def test_every_weighted_sum_spelling_fuses_with_its_quant(collapse: str, dtype: torch.dtype) -> None:
    model, ids = WeightedSumMHC(collapse, "reference", 2 * LAYERS, dtype), token_ids()
    report, graph, out = compiled_graph_and_output(model, ids)
    assert_collapses_fused(report, graph)
    with torch.no_grad():
        expected = model(ids)
    # mHC in bf16: eager rounds the mixing and the Sinkhorn weights where the graph may not, which flips FP8
    # codes with or without the fusion (see assert_near_eager)
    assert_near_eager(out, expected, dtype, fp8=True)


def test_without_canonical_forms_a_respelled_quant_is_fused_by_evaluation() -> None:
    """With the canonical-forms pass off, ``torch.max(...).values`` matches no pattern, and the fusion still takes
    every block's quant: by evaluation, as any spelling with the contract's values."""
    model = QuantisedUserHC("max_values", torch.float32)
    report, graph, _ = compiled_graph_and_output(model, token_ids(), canonical_forms=False)
    assert report.record("canonical_forms").status == "disabled"
    assert report.applied["gated_mean_quant"] == 2 * LAYERS == fused_op_count(graph), report

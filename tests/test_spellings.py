"""Both passes on HC models whose blocks are each spelled another way (``tests/corpus/spelled.py``).

Hypothesis draws, per HC block, the grouped norm, the stream collapse and the sub-layer input quant (or none), and
per model the dtype, tp (1, 2, 4 or 8; 8, the usual TP of one node, most often: one trace gives 8 graphs), the
layer count, where a causal conv over tokens sits (before a layer: a token window with a halo, or none) and T (1,
below tp, ragged, a multiple of tp, up to 300). Each example checks the exact counts of both passes in the graph and
in the report, the SP graph against the same graph with SP off (exact but for last-bit roundings, which move at most
one token row), and the whole model against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corpus.gated_residual import NORMS, GatedResidual
from corpus.quants import QUANTS
from corpus.spelled import COLLAPSES, BlockSpelling, SpelledHC
from harness import simulate
from harness.reference import (
    assert_ranks_near_eager,
    assert_same_as_sp_off,
    capture_with_passes,
    collective_counts,
    fused_op_count,
)
from harness.tally import CheckedGraphs
from hypothesis import given
from hypothesis import strategies as st

from hcpasses.config import HCPassesConfig

SPELLINGS = st.builds(
    BlockSpelling,
    norm=st.sampled_from(list(NORMS)),
    collapse=st.sampled_from(list(COLLAPSES)),
    quant=st.none() | st.sampled_from(list(QUANTS)),
)


@st.composite
def token_counts(draw: st.DrawFn, tp: int) -> int:
    kind = draw(st.sampled_from(("one", "below_tp", "ragged", "multiple", "any")))
    if kind == "one":
        return 1
    if kind == "below_tp":
        return draw(st.integers(1, max(tp - 1, 1)))
    count = draw(st.integers(2, 300))
    if kind == "ragged" and tp > 1:
        return count + (1 if count % tp == 0 else 0)
    if kind == "multiple":
        return max(tp, count - count % tp)
    return count


def canonical_rewrites(spelling: BlockSpelling, dtype: torch.dtype) -> int:
    """How many rewrites canonical_forms makes in one block of this spelling."""
    collapse = 2 * int(spelling.collapse == "fp32_sum_times_reciprocal")  # * (1/4); sigmoid after the split
    quant = {"max_values": 1, "amax_then_upcast": int(dtype != torch.float32)}.get(spelling.quant or "", 0)
    return collapse + quant


# tp per example for both spelling properties: 1 (the single-device graph), 2, 4, and 8, the usual TP of one
# node, most often: one trace gives 8 rank graphs, the most graphs per second the suite checks. Hypothesis does
# not draw uniformly (it favours the first elements), so the share is counted, over 5 runs of 100 examples each:
# sampled_from((8, 1, 8, 2, 8, 4, 8, 8)) gave tp 8 in 52 to 75 % of them (the graph count of a CI run varied with
# it); this one_of gives tp 8 in 74 to 82 %, tp 1, 2 and 4 in about 7 % each.
SPELLING_TPS = st.one_of(st.just(8), st.sampled_from((8, 8, 1, 2, 4)))
# Both spelling properties give the bulk of the rewritten graphs of issue #11's reliability budget (1000 per CI
# run). Up to 8 rank graphs per example run longer than the suite's 600 s per test under the ci profile on 2 busy
# cores: 1200 s.
SPELLING_TIMEOUT_S = 1200


@pytest.mark.timeout(SPELLING_TIMEOUT_S)
@given(data=st.data())
def test_every_block_spelling_is_sharded_and_fused(data: st.DataObject, checked_graphs: CheckedGraphs) -> None:
    layers = data.draw(st.integers(1, 2), label="layers")
    blocks = data.draw(st.lists(SPELLINGS, min_size=2 * layers, max_size=2 * layers), label="blocks")
    final = data.draw(SPELLINGS.map(lambda s: BlockSpelling(s.norm, s.collapse, None)), label="final")
    dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16)), label="dtype")
    tp = data.draw(SPELLING_TPS, label="tp")
    conv_layer = data.draw(st.sampled_from((None, *range(layers))), label="conv_layer")
    tokens = data.draw(token_counts(tp), label="tokens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(seed))

    sharded = capture_with_passes(
        lambda rank, size: SpelledHC(blocks, final, conv_layer, dtype, size, rank),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=1),
        one_trace=True,
    )
    report, graph = sharded.report, sharded.graphs[0]
    fused = sum(block.fuses for block in blocks)
    assert report.applied["gated_mean_quant"] == fused == fused_op_count(graph), report
    rewrites = sum(canonical_rewrites(block, dtype) for block in [*blocks, final])
    assert report.applied["canonical_forms"] == rewrites, report.record("canonical_forms").notes
    sp = report.record("sp_rewrite")
    # a conv after a sharded block runs on the shards and the rows before them (a halo); before the first block it
    # reads unsharded values
    window = conv_layer is not None and conv_layer > 0
    if tp == 1:
        assert sp.status != "applied" and collective_counts(graph) == dict.fromkeys(collective_counts(graph), 0)
    else:
        assert sp.status == "applied" and sp.applied == len(blocks) + 1, report
        assert (sp.facts.get("cuts", 0), sp.facts.get("halos", 0)) == (0, window), sp.notes
        gathers = sum(2 if block.fuses else 1 for block in blocks) + 1 + window  # x or (q, scale); final; halo
        want = {"all_reduce": 0, "reduce_scatter": len(blocks), "all_gather": gathers}
        assert collective_counts(graph) == want, sp.notes

    with torch.no_grad():
        expected = SpelledHC(blocks, final, conv_layer, dtype)(ids)
    outputs = simulate(sharded.graphs, sharded.inputs)
    unsharded = sharded.sp_off()
    any_quant = any(block.quant is not None for block in blocks)
    for got, want_outputs in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want_outputs, fp8=any_quant, eager=[expected])
    assert_ranks_near_eager(sharded, outputs, expected, dtype, any_quant)
    checked_graphs.add(sharded)


# (odd collapse, dtype, collapses found, fused, collectives). Every block is an HC block to SP (no cut).
ODD_AT_THREE_STREAMS = [
    ("activation_sum_div", torch.bfloat16, 5, 2, {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 2 * 2 + 3}),
    ("fp32_sum_times_reciprocal", torch.float32, 5, 3, {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 3 * 2 + 2}),
]


@pytest.mark.parametrize(
    ("odd", "dtype", "found", "fused", "collectives"), ODD_AT_THREE_STREAMS, ids=lambda v: str(v)[:24]
)
def test_odd_forms_at_three_streams_are_sharded_and_fused_only_within_one_rounding(
    odd: str, dtype: torch.dtype, found: int, fused: int, collectives: dict[str, int]
) -> None:
    """n = 3: a bf16 ``sum / 3`` rounds twice, so the fusion leaves it and says so, and SP still shards it. An
    fp32 ``sum * (1/3)`` is not ``/ 3`` (1/3 is inexact) but within one fp32 rounding of it: no pattern takes it,
    evaluation finds it as the collapse, and both passes take it."""
    plain = BlockSpelling("rsqrt", "unflatten_mean", "reference")
    blocks = [plain, BlockSpelling("sqrt_div", odd, "reference"), plain, BlockSpelling("gemma", "unflatten_mean", None)]
    final = BlockSpelling("rsqrt", "unflatten_mean", None)
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3))
    sharded = capture_with_passes(
        lambda rank, size: SpelledHC(blocks, final, None, dtype, size, rank, n=3),
        lambda rank, size: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    report, graph = sharded.report, sharded.graphs[0]
    fusion = report.record("gated_mean_quant")
    assert fusion.notes[0] == f"HC stream collapses found: {found}", fusion.notes
    assert fusion.applied == fused == fused_op_count(graph), report
    if odd == "activation_sum_div":
        assert "rounded to torch.bfloat16 before the division by n = 3" in fusion.reason, fusion.reason
    else:
        assert "of them found by evaluation (no pattern matched): 1" in fusion.notes, fusion.notes
    sp = report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == found and not sp.facts.get("cuts"), sp.notes
    assert collective_counts(graph) == collectives, sp.notes
    with torch.no_grad():
        expected = SpelledHC(blocks, final, None, dtype, n=3)(ids)
    outputs = simulate(sharded.graphs, sharded.inputs)
    unsharded = sharded.sp_off()
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want, fp8=True, eager=[expected])
        tol = 3e-2 if dtype == torch.float32 else 0.1  # one e4m3 step on a flipped code; bf16 adds its rounding
        torch.testing.assert_close(got[0].float(), expected.float(), rtol=tol, atol=tol)


def fixed_weight_mean(u: torch.Tensor, xn: torch.Tensor, n: int, hidden: int) -> torch.Tensor:
    """Gated streams weighed by fixed per-stream constants (0.5, 0.3, 0.2): no HC collapse (evaluation tells it
    from the mean), but a block SP sees the streams branch into."""
    gated = torch.sigmoid(u).unflatten(-1, (n, hidden)) * xn.unflatten(-1, (n, hidden))
    return sum(gated[..., s, :] * w for s, w in enumerate((0.5, 0.3, 0.2)))


def test_an_unrecognised_block_ends_the_region_and_keeps_its_all_reduce() -> None:
    """SP must not compute an unrecognised block's sub-layer TP partial sums on row shards (no collective can
    combine them): the region ends where the streams enter that block, which runs on all rows with its
    all-reduce, and the next recognised block starts another region."""
    plain = BlockSpelling("rsqrt", "unflatten_mean", "reference")
    blocks = [plain, plain, plain, BlockSpelling("gemma", "unflatten_mean", None)]
    final = BlockSpelling("rsqrt", "unflatten_mean", None)
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3))

    def model(rank: int, size: int) -> SpelledHC:
        spelled = SpelledHC(blocks, final, None, torch.float32, size, rank, n=3)
        spelled.blocks[1].collapse = fixed_weight_mean
        return spelled

    sharded = capture_with_passes(model, lambda rank, size: (ids,), 2, HCPassesConfig(sp_min_tokens=1), codegen=False)
    report, graph = sharded.report, sharded.graphs[0]
    fusion = report.record("gated_mean_quant")
    assert fusion.notes[0] == "HC stream collapses found: 4", fusion.notes
    assert fusion.applied == 2 == fused_op_count(graph), report
    sp = report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 4 and sp.facts.get("cuts", 0) == 1, sp.notes
    assert any("feeds the TP partial sum" in note for note in sp.notes), sp.notes
    assert collective_counts(graph) == {"all_reduce": 1, "reduce_scatter": 3, "all_gather": 2 * 2 + 3}, sp.notes
    with torch.no_grad():
        expected = model(0, 1)(ids)
    outputs = simulate(sharded.graphs, sharded.inputs)
    for got in outputs:
        torch.testing.assert_close(got[0].float(), expected.float(), rtol=3e-2, atol=3e-2)  # one e4m3 step


def padded_linear(x: torch.Tensor, w: torch.Tensor, align: int = 16) -> torch.Tensor:
    """``F.linear(x, w)`` as Inductor's ``pad_mm`` writes a GEMM on CUDA: K and N padded with zeros up to
    multiples of ``align``, the output sliced back to N columns (row-local: no token row moves)."""
    n_out, k = w.shape
    pad_k, pad_n = -k % align, -n_out % align
    return F.linear(F.pad(x, (0, pad_k)), F.pad(w, (0, pad_k, 0, pad_n)))[..., :n_out]


class PaddedGemmResidual(GatedResidual):
    """A ``GatedResidual`` whose three GEMMs are padded as ``pad_mm`` pads them; ``row_pad`` pads the token rows
    too: ``"align"`` up to a multiple of 16, sliced back after (what ``pad_mm`` does when M is not aligned),
    ``"shift"`` one row down (a token shift, as RWKV writes it: the row count stays)."""

    row_pad: str | None = None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(h.unflatten(-1, (self.n, self.hidden)), self.norm_weight, 1e-6).flatten(-2)
        rows = normed.shape[0]
        pad = {None: None, "align": (0, 0, 0, -rows % 16), "shift": (0, 0, 1, -1)}[self.row_pad]
        padded = normed if pad is None else F.pad(normed, pad)
        gate_logits = padded_linear(F.silu(padded_linear(padded, self.down) / self.n), self.up)[:rows]
        inject = 2 * torch.sigmoid(padded_linear(padded, self.inject)[:rows] / self.n)
        return self.collapse(gate_logits, normed, self.n, self.hidden), inject


@pytest.mark.parametrize(
    ("row_pad", "cut"),
    [
        (None, None),
        ("align", "pads a token dim"),
        ("shift", "pads a token dim"),
    ],
    ids=["pads_k_and_n", "pads_token_rows", "shifts_token_rows"],
)
def test_gemms_padded_as_pad_mm_pads_them(row_pad: str | None, cut: str | None) -> None:
    """Inductor's ``pad_mm`` (CUDA only, before hcpasses sees the graph) pads the HC GEMMs' K and N with
    ``constant_pad_nd``: SP shards such a block like any other (the real-size DeepSeek-V4 on the H200). A pad of
    the token rows is not row-local, whether it changes the row count or shifts the rows: the region is cut at the
    pad, the block runs on all rows with its all-reduce, and the report names the pad."""
    plain = BlockSpelling("rsqrt", "unflatten_mean", "reference")
    final = BlockSpelling("rsqrt", "unflatten_mean", None)
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3))

    def model(rank: int, size: int) -> SpelledHC:
        spelled = SpelledHC([plain] * 4, final, None, torch.float32, size, rank, n=3)
        spelled.blocks[2].__class__ = PaddedGemmResidual
        spelled.blocks[2].row_pad = row_pad
        return spelled

    sharded = capture_with_passes(model, lambda rank, size: (ids,), 2, HCPassesConfig(sp_min_tokens=1), codegen=False)
    report, graph = sharded.report, sharded.graphs[0]
    assert any(node.target is torch.ops.aten.constant_pad_nd.default for node in graph.graph.nodes)
    sp = report.record("sp_rewrite")
    # 4 fused blocks gather their FP8 codes and scales, the final mixer its x
    if cut is None:
        assert sp.status == "applied" and sp.applied == 5 and not sp.facts.get("cuts"), sp.notes
        assert collective_counts(graph) == {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 4 * 2 + 1}, sp.notes
    else:
        note = f"region cut at constant_pad_nd (aten.constant_pad_nd.default): {cut}"
        assert any(line.startswith(note) for line in sp.notes), sp.notes
        assert sp.applied == 4, sp.notes
        assert collective_counts(graph) == {"all_reduce": 1, "reduce_scatter": 3, "all_gather": 4 * 2 + 1}, sp.notes
    with torch.no_grad():
        expected = model(0, 1)(ids)
    for got in simulate(sharded.graphs, sharded.inputs):
        torch.testing.assert_close(got[0].float(), expected.float(), rtol=3e-2, atol=3e-2)  # one e4m3 step

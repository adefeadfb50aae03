"""SP on HC models written independently of ``models/`` (``tests/corpus``): every grouped-norm spelling and every
collapse spelling of ``corpus.collapses`` shards every HC block at tp 2 on the simulator (the gated means and the
broadcasting ``@`` found as collapses by evaluation, the einsum and the stack whose inner values hold the tokens
merged with the hidden dim or behind the stream axis among them); a
causal conv over tokens in a later layer runs on each rank's rows and the 2 before them (a halo gather, no cut); outputs
equal the SP-off graph (exact but for last-bit roundings, which move at most one token row) and eager."""

from __future__ import annotations

import pytest
import torch
from corpus.collapses import GATED_MEANS, WEIGHTED_SUMS, GatedMeanHC, WeightedSumMHC
from corpus.delta_rule import DeltaRuleHC
from corpus.gated_residual import NORMS, UserHC
from harness import simulate
from harness.reference import (
    RankGraphs,
    assert_ranks_near_eager,
    assert_same_as_sp_off,
    capture_with_passes,
    collective_counts,
)
from test_sp_rewrite import with_tokens  # the captured inputs with other ids and their symbolic T

from hcpasses.config import HCPassesConfig

LAYERS = 2
CASES = [
    (norm, conv_layer, dtype, tokens)
    for norm in NORMS
    for conv_layer, dtype, tokens in ((None, torch.float32, 9), (1, torch.bfloat16, 3), (1, torch.float32, 1))
]


@pytest.mark.parametrize(("norm", "conv_layer", "dtype", "tokens"), CASES, ids=str)
def test_every_norm_spelling_shards_every_block(
    norm: str, conv_layer: int | None, dtype: torch.dtype, tokens: int
) -> None:
    ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))
    sharded = capture_with_passes(
        lambda rank, tp: UserHC(norm, LAYERS, conv_layer, dtype, tp, rank),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    sp = sharded.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 2 * LAYERS + 1, sharded.report  # every block + the final mixer
    # The causal conv over the streams runs on this rank's rows and the 2 before them: no cut, a halo gather.
    assert (sp.facts["cuts"], sp.facts["halos"]) == (0, int(conv_layer is not None)), sp.notes
    # Each sub-layer input and the final mixer's x are gathered; at the conv, the rows before each rank's.
    want = {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": 2 * LAYERS + 1 + (conv_layer is not None)}
    assert collective_counts(sharded.graphs[0]) == want
    with torch.no_grad():
        expected = UserHC(norm, LAYERS, conv_layer, dtype)(ids)
    unsharded = sharded.sp_off()
    outputs = simulate(sharded.graphs, sharded.inputs)
    for got, want_outputs in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want_outputs, eager=[expected])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for rank_outputs in outputs:
        torch.testing.assert_close(rank_outputs[0].float(), expected.float(), rtol=tol, atol=tol)


# Gated means found (by evaluation) whose inner values do not lead with the token dim: the einsum's per-token
# products ([T*S, 1, n] x [T*S, n, 1], tokens merged with the hidden dim) and the stack's [n*T, S] / [n, T, S]
# (streams in front). Their layouts follow each op (sp_rewrite.tokens.Layout), so SP shards them like the rest.
# One representative of each family in the quick run; the rest (~5-10 s a capture at tp 2) in the thorough one.
QUICK = {"einsum", "fp32_einsum"}


def collapse_cases(names: list[str]) -> list:
    params = []
    for name in names:
        for dtype in (torch.float32, torch.bfloat16):
            marks = [] if name in QUICK and dtype == torch.float32 else [pytest.mark.thorough]
            params.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return params


def assert_every_block_sharded(sharded: RankGraphs, blocks: int, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """SP shards ``blocks`` HC blocks and the final collapse, gathers each sub-layer input and the final x, and
    matches the SP-off graph and eager."""
    sp = sharded.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == blocks + 1 and not sp.facts.get("cuts"), sp.notes
    want = {"all_reduce": 0, "reduce_scatter": blocks, "all_gather": blocks + 1}
    assert collective_counts(sharded.graphs[0]) == want, sp.notes
    unsharded = sharded.sp_off()
    outputs = simulate(sharded.graphs, sharded.inputs)
    for got, want_outputs in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want_outputs, eager=[expected])
    assert_ranks_near_eager(sharded, outputs, expected, dtype, fp8=False)


@pytest.mark.parametrize(("collapse", "dtype"), collapse_cases(list(GATED_MEANS)))
def test_every_gated_mean_spelling_shards_every_block(collapse: str, dtype: torch.dtype) -> None:
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(9))
    sharded = capture_with_passes(
        lambda rank, tp: GatedMeanHC(collapse, None, 1, dtype, tp, rank),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    with torch.no_grad():
        expected = GatedMeanHC(collapse, None, 1, dtype)(ids)
    assert_every_block_sharded(sharded, 2, expected, dtype)


@pytest.mark.parametrize("collapse", ["einsum", "stack_mean"])
def test_inner_layouts_shard_with_a_symbolic_token_count(collapse: str) -> None:
    """The einsum's [T*S, 1, n] and the stack's [n*T, S] / [n, T, S] with a symbolic T: the shard's sizes are
    spelled from the symbolic R (R*S, n*R), so one graph runs every T, ragged and even, and matches SP off and
    eager there."""
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(9))
    sharded = capture_with_passes(
        lambda rank, tp: GatedMeanHC(collapse, None, 1, torch.float32, tp, rank),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        dynamic=True,
        one_trace=True,
    )
    sp = sharded.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 3 and isinstance(sp.sharded.tokens, str), sp.notes
    assert collective_counts(sharded.graphs[0]) == {"all_reduce": 0, "reduce_scatter": 2, "all_gather": 3}
    unsharded = sharded.sp_off()
    for tokens in (9, 4, 13):
        ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            expected = GatedMeanHC(collapse, None, 1, torch.float32)(ids)
        ranks = range(2)
        outputs = simulate(sharded.graphs, [with_tokens(sharded.inputs[r], sharded.graphs[r], ids) for r in ranks])
        reference = simulate(
            unsharded.graphs, [with_tokens(unsharded.inputs[r], unsharded.graphs[r], ids) for r in ranks]
        )
        for got, want in zip(outputs, reference, strict=True):
            assert_same_as_sp_off(got, want, eager=[expected])
            torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("collapse", "dtype"), collapse_cases(list(WEIGHTED_SUMS)))
def test_every_weighted_sum_spelling_shards_every_block(collapse: str, dtype: torch.dtype) -> None:
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(10))  # tokens [batch, seq]
    sharded = capture_with_passes(
        lambda rank, tp: WeightedSumMHC(collapse, None, 2, dtype, tp, rank),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    with torch.no_grad():
        expected = WeightedSumMHC(collapse, None, 2, dtype)(ids)
    assert_every_block_sharded(sharded, 2, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_delta_rule_solve_steps_are_not_hc_blocks(dtype: torch.dtype) -> None:
    """A chunked delta-rule mixer's forward substitution is a gated sum over ``[..., n, S]`` (the stacked mHC
    algebra) in fp32: both passes leave every step out and say so, and count exactly the HC blocks. The mixer
    reads all rows (it mixes tokens), so SP gathers its input like any sub-layer's and shards every block."""
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(4))
    sharded = capture_with_passes(
        lambda rank, tp: DeltaRuleHC(LAYERS, dtype, tp, rank),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    report = sharded.report
    lookalikes = DeltaRuleHC(LAYERS, dtype).lookalikes()
    fusion = report.record("gated_mean_quant")
    assert fusion.notes[0] == f"HC stream collapses found: {2 * LAYERS + 1}", fusion.notes
    left_out = f"collapse-shaped sums that are no HC stream collapse, left out: {lookalikes} ("
    [left_out_note] = [note for note in fusion.notes if note.startswith(left_out)]
    assert "is not wider than its" in left_out_note, fusion.notes  # n = S = i and n = chunk > S = i
    sp = report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 2 * LAYERS + 1 and not sp.facts.get("cuts"), sp.notes
    assert any(note.startswith(left_out) for note in sp.notes), sp.notes
    want = {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": 2 * LAYERS + 1}
    assert collective_counts(sharded.graphs[0]) == want, sp.notes
    with torch.no_grad():
        expected = DeltaRuleHC(LAYERS, dtype)(ids)
    unsharded = sharded.sp_off()
    outputs = simulate(sharded.graphs, sharded.inputs)
    for got, want_outputs in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want_outputs, eager=[expected])
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got[0].float(), expected.float(), rtol=tol, atol=tol)

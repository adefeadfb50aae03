"""SP on HC models written independently of ``models/`` (``tests/corpus``): every grouped-norm spelling shards
every HC block at tp 2 on the simulator; a causal conv over tokens in a later layer cuts the region there and
the blocks on both sides stay sharded; outputs equal the SP-off graph
(exact but for last-bit roundings, which move at most one token row) and eager."""

from __future__ import annotations

import pytest
import torch
from corpus.delta_rule import DeltaRuleHC
from corpus.gated_residual import NORMS, UserHC
from harness import simulate
from harness.reference import assert_same_as_sp_off, capture_with_passes, collective_counts

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
    assert sp.facts["cuts"] == (conv_layer is not None), sp.notes
    # Each sub-layer input and the final mixer's x are gathered; at the conv, the streams it reads.
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
    assert fusion.notes[2].startswith(left_out), fusion.notes
    assert "is not wider than its" in fusion.notes[2], fusion.notes  # n = S = i and n = chunk > S = i
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

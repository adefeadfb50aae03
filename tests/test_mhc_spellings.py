"""Both passes on mHC models whose blocks each spell the collapse another code base's way
(``tests/corpus/mhc_spelled.py``: transformers, DeepSeek's reference, an MLX port, a batched matmul, an einsum).

Hypothesis draws, per block, the collapse and the sub-layer input quant (or none), and per model the dtype, tp (1,
2, 4 or 8; 8, the usual TP of one node, most often: one trace gives 8 graphs), the token layout (``[T]`` or
``[batch, seq]``) and T (1, below tp, ragged, a multiple of tp). Each example checks the exact counts of every pass
in the graph and in the report, the SP graph against the same graph with SP off (exact but for last-bit roundings,
which move at most one token row) and the model against eager.
"""

from __future__ import annotations

import pytest
import torch
from corpus.mhc_spelled import COLLAPSES, MHCSpelling, SpelledMHC
from corpus.quants import QUANTS
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
from test_spellings import SPELLING_TIMEOUT_S, SPELLING_TPS, token_counts

from hcpasses.config import HCPassesConfig

SPELLINGS = st.builds(
    MHCSpelling, collapse=st.sampled_from(list(COLLAPSES)), quant=st.none() | st.sampled_from(list(QUANTS))
)


def canonical_rewrites(collapse: str, quant: str | None, dtype: torch.dtype) -> int:
    """How many rewrites canonical_forms makes in one block of this spelling (see hcpasses.passes.canonical_forms)."""
    low = int(dtype != torch.float32)
    per_collapse = {
        "transformers": 0,
        "deepseek_reference": low,  # the upcast of the flat streams into the gated sum's mul
        "mlx_port": 1 + low,  # pre[..., None]; the upcast of the stacked streams
        "batched_matmul": 1,  # the per-token bmm
        "einsum": 1,
    }[collapse]
    per_quant = {"max_values": 1, "amax_then_upcast": low}.get(quant or "", 0)
    return per_collapse + per_quant


@pytest.mark.timeout(SPELLING_TIMEOUT_S)
@given(data=st.data())
def test_every_mhc_collapse_spelling_is_sharded_and_fused(data: st.DataObject, checked_graphs: CheckedGraphs) -> None:
    blocks = data.draw(st.lists(SPELLINGS, min_size=1, max_size=3), label="blocks")
    final = data.draw(st.sampled_from(list(COLLAPSES)), label="final")
    dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16)), label="dtype")
    tp = data.draw(SPELLING_TPS, label="tp")
    batch = data.draw(st.sampled_from((None, 1, 2)), label="batch")  # None: tokens [T], else [batch, seq]
    tokens = data.draw(token_counts(tp), label="tokens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    shape = (tokens,) if batch is None else (batch, max(1, tokens // batch))
    ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))

    sharded = capture_with_passes(
        lambda rank, size: SpelledMHC(blocks, final, dtype, size, rank),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=1),
        one_trace=True,
    )
    report, graph = sharded.report, sharded.graphs[0]
    fusion = report.record("gated_mean_quant")
    assert fusion.notes[0] == f"HC stream collapses found: {len(blocks) + 1}", report
    fused = sum(block.fuses for block in blocks)
    assert fusion.applied == fused == fused_op_count(graph), report
    rewrites = sum(canonical_rewrites(b.collapse, b.quant, dtype) for b in blocks)
    rewrites += canonical_rewrites(final, None, dtype)
    assert report.applied["canonical_forms"] == rewrites, report.record("canonical_forms").notes
    sp = report.record("sp_rewrite")
    if tp == 1:
        assert sp.status != "applied" and collective_counts(graph) == dict.fromkeys(collective_counts(graph), 0)
    else:
        assert sp.status == "applied" and sp.applied == len(blocks) + 1 and not sp.facts.get("cuts"), sp.notes
        gathers = sum(2 if block.fuses else 1 for block in blocks) + 1  # x or (q, scale) per block; the final x
        want = {"all_reduce": 0, "reduce_scatter": len(blocks), "all_gather": gathers}
        assert collective_counts(graph) == want, sp.notes

    with torch.no_grad():
        expected = SpelledMHC(blocks, final, dtype)(ids)
    outputs = simulate(sharded.graphs, sharded.inputs)
    unsharded = sharded.sp_off()
    any_quant = any(block.quant is not None for block in blocks)
    for got, want_outputs in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want_outputs, fp8=any_quant, eager=[expected])
    assert_ranks_near_eager(sharded, outputs, expected, dtype, any_quant)
    checked_graphs.add(sharded)

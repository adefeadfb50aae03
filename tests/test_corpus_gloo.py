"""The spelling corpus at TP 2 over real gloo collectives, through ``torch.compile(backend=hcpasses)``.

The spelling properties (``test_spellings.py``, ``test_mhc_spellings.py``) run the corpus on the virtual-rank
simulator. Here two gloo processes compile one model that holds every spelling of the corpus: a gated-mean HC
model whose blocks take every grouped norm, collapse and quant (fp32), and an mHC model whose blocks take every
collapse and quant (bf16). Each rank's report must give the exact counts of both passes, and its logits must
match single-device eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from corpus.gated_residual import NORMS
from corpus.mhc_spelled import COLLAPSES as MHC_COLLAPSES
from corpus.mhc_spelled import MHCSpelling, SpelledMHC
from corpus.quants import QUANTS
from corpus.spelled import COLLAPSES, BlockSpelling, SpelledHC
from harness.reference import assert_near_eager

import hcpasses
from hcpasses.testing.multiproc import run_ranks

pytestmark = pytest.mark.thorough  # processes over gloo: CI, not the quick local run

TOKENS = 13  # ragged at tp 2
QUANTS_OR_NONE = [*QUANTS, None]
# 6 blocks (3 layers): every norm, collapse and quant spelling at least once, each collapse with a quant behind it
# at least once (every collapse of this corpus fuses, FUSES).
HC_BLOCKS = [
    BlockSpelling(list(NORMS)[i % len(NORMS)], list(COLLAPSES)[i % len(COLLAPSES)], QUANTS_OR_NONE[i % 5])
    for i in range(6)
]
HC_FINAL = BlockSpelling("gemma", "fp32_sum_div", None)
MHC_BLOCKS = [MHCSpelling(collapse, quant) for collapse, quant in zip(MHC_COLLAPSES, QUANTS_OR_NONE, strict=True)]
MHC_FINAL = "einsum"


def build(family: str, tp: int = 1, rank: int = 0) -> torch.nn.Module:
    if family == "hc":
        return SpelledHC(HC_BLOCKS, HC_FINAL, None, torch.float32, tp, rank)
    return SpelledMHC(MHC_BLOCKS, MHC_FINAL, torch.bfloat16, tp, rank)


def token_ids() -> torch.Tensor:
    return torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(11))


def corpus_rank(rank: int, world_size: int) -> dict[str, Any]:
    """One gloo rank: both corpus models compiled with every pass on; logits and report counts."""
    results: dict[str, Any] = {}
    for family in ("hc", "mhc"):
        torch._dynamo.reset()
        be = hcpasses.backend(sp_min_tokens=1)
        with torch.no_grad():
            results[family] = torch.compile(build(family, world_size, rank), backend=be)(token_ids())
        [report] = be.reports
        sp, fusion = report.record("sp_rewrite"), report.record("gated_mean_quant")
        results[f"{family}-counts"] = (sp.status, sp.applied, fusion.notes[0], fusion.applied)
    return results


def test_corpus_at_tp2_over_gloo_counts_exactly_and_matches_eager() -> None:
    results = run_ranks(corpus_rank, 2, timeout_s=900)
    fused = {"hc": sum(b.fuses for b in HC_BLOCKS), "mhc": sum(b.fuses for b in MHC_BLOCKS)}
    blocks = {"hc": len(HC_BLOCKS), "mhc": len(MHC_BLOCKS)}
    assert fused == {"hc": 5, "mhc": 4}  # the tests below would pass vacuously with no quant in the models
    for family, dtype in (("hc", torch.float32), ("mhc", torch.bfloat16)):
        with torch.no_grad():
            expected = build(family)(token_ids())
        for rank, rank_results in enumerate(results):
            counts = (
                "applied",
                blocks[family] + 1,  # every block and the final collapse
                f"HC stream collapses found: {blocks[family] + 1}",
                fused[family],
            )
            assert rank_results[f"{family}-counts"] == counts, (family, rank)
            assert_near_eager(rank_results[family], expected, dtype, fp8=True)

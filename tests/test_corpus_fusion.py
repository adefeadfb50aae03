"""The fusion on quant spellings written independently (``tests/corpus/quants.py``) after the gated mean of an
independently written HC model (``tests/corpus/gated_residual.py``): every spelling fuses every HC block's
quant in fp32 and bf16, the canonical-forms pass says which spellings it rewrote, and the compiled model
matches eager. (The fused op's numerics against the unfused graph: tests/test_gated_mean_quant.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corpus.gated_residual import UserHC
from corpus.quants import QUANTS
from harness import passes_run_every_compile
from harness.reference import fused_op_count

import hcpasses

LAYERS = 1
REWRITTEN = {"reference": 0, "method_chain": 0, "max_values": 2 * LAYERS}  # canonical_forms rewrites per graph


class QuantisedUserHC(UserHC):
    """Each sub-layer reads its input through a per-token FP8 quant and dequant (PTPC-FP8 linear's input)."""

    def __init__(self, quant: str, dtype: torch.dtype) -> None:
        super().__init__("rsqrt", LAYERS, None, dtype)
        self.quant = QUANTS[quant]

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("quant", list(QUANTS))
def test_every_quant_spelling_fuses_every_block(quant: str, dtype: torch.dtype) -> None:
    model = QuantisedUserHC(quant, dtype)
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(7))
    report, graph, out = compiled_graph_and_output(model, ids)
    assert report.applied["gated_mean_quant"] == 2 * LAYERS == fused_op_count(graph), report
    # amax before the upcast is already canonical in fp32 (the upcast is a no-op there)
    rewritten = REWRITTEN.get(quant, 2 * LAYERS if dtype != torch.float32 else 0)
    assert report.applied["canonical_forms"] == rewritten, report
    with torch.no_grad():
        expected = model(ids)
    # The fused op quantises x as the spelled-out quant does (DESIGN §5); bf16 eager rounds the stream sum
    # and the model's intermediates where the compiled graph keeps fp32, which may flip an FP8 code.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_without_canonical_forms_a_respelled_quant_fuses_by_evaluation() -> None:
    """``torch.max(...).values`` fuses by the traced pattern once canonical forms has rewritten it; with that pass
    off, the fusion finds the same quant by evaluation (it computes the contract's values) and says so."""
    model = QuantisedUserHC("max_values", torch.float32)
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(7))
    report, graph, _ = compiled_graph_and_output(model, ids, canonical_forms=False)
    assert report.record("canonical_forms").status == "disabled"
    assert report.applied["gated_mean_quant"] == 2 * LAYERS == fused_op_count(graph)
    assert f"of them matched by evaluation (7 probes): {2 * LAYERS}" in report.record("gated_mean_quant").notes

"""The transformers HC models under torch.compile: where Dynamo breaks the graph, and the hcpasses backend."""

from __future__ import annotations

import pytest
import torch
from hf_cases import FAMILIES, ONE_LAYER, logits, token_ids

import hcpasses
from hcpasses.hf import swap_fp8_linears


def break_sites(family: str) -> set[tuple[str, str]]:
    """``(file, first line of the reason)`` of every graph break Dynamo reports for the full tiny model."""
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(FAMILIES[family]())(token_ids(1))
    return {
        (reason.user_stack[-1].filename.rsplit("/", 1)[-1], reason.reason.splitlines()[0])
        for reason in explanation.break_reasons
    }


def test_deepseek_v4_traces_as_one_graph() -> None:
    assert break_sites("deepseek_v4") == set()


def test_qwen4_exp_breaks_only_in_the_qsa_indexer() -> None:
    """The QSA indexer loops over batch and query positions and calls ``torch.nonzero`` on each mask row:
    a data-dependent output shape, so Dynamo breaks there (transformers' code, not ours). Everything before
    and after the indexer is traced."""
    sites = break_sites("qwen4_exp")
    assert sites
    assert {file for file, _ in sites} == {"modeling_qwen4_exp.py"}
    assert all("Dynamic shape operator" in reason or "nonzero" in reason for _, reason in sites)


@pytest.mark.parametrize("batch", [1, 2])
def test_hcpasses_backend_matches_eager(family: str, batch: int) -> None:
    model = FAMILIES[family](**ONE_LAYER[family])
    swap_fp8_linears(model)
    ids = token_ids(batch, seed=9)
    expected = logits(model, ids)
    backend = hcpasses.backend()
    torch._dynamo.reset()
    # No SIMD code: halves Inductor's C++ codegen and compile time on CPU; the numbers are the same.
    with torch._inductor.config.patch({"cpp.simdlen": 0, "force_disable_caches": True}):
        actual = logits(torch.compile(model, backend=backend), ids)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)
    assert len(backend.reports) == 1  # one graph: no break in the one-layer models
    print(backend.reports[0])

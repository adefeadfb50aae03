"""SP on the transformers HC models sharded with ``hcpasses.hf.shard_for_tp`` ([batch, seq, hidden]).

Each rank's post-grad graph is captured under the fake group and run on the virtual-rank simulator;
the result is compared with the single-device eager model.
"""

from __future__ import annotations

import pytest
import torch
from harness import capture_ranks, count_calls, simulate
from hf_cases import FAMILIES, ONE_LAYER, logits, token_ids

from hcpasses.config import HCPassesConfig
from hcpasses.hf import shard_for_tp, swap_fp8_linears
from hcpasses.manager import PassManager

c10d = torch.ops._c10d_functional


class Logits(torch.nn.Module):
    """``input_ids -> logits`` (the transformers output object is not a graph output)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def build(family: str, fp8: bool, rank: int | None = None, tp: int | None = None) -> torch.nn.Module:
    model = FAMILIES[family](**ONE_LAYER[family])
    if fp8:
        swap_fp8_linears(model)
    if tp is not None:
        shard_for_tp(model, rank, tp)
    return model


@pytest.mark.parametrize(("family", "fp8", "batch"), [("qwen4_exp", True, 2), ("deepseek_v4", False, 2)])
def test_sp_shards_every_hc_block_and_matches_one_device(family: str, fp8: bool, batch: int) -> None:
    ids = token_ids(batch, seed=4)
    reports: list = []
    manager = PassManager(HCPassesConfig(sp_min_tokens=1), reports.append)
    graphs = capture_ranks(
        lambda rank, tp: Logits(build(family, fp8, rank, tp)),
        lambda rank, tp: (ids,),
        2,
        codegen=False,
        config_patches={"post_grad_custom_pre_pass": manager},
    )
    outputs = simulate([g[0].gm for g in graphs], [g[0].inputs for g in graphs])
    expected = logits(build(family, fp8), ids)
    for (actual,) in outputs:
        # fp32; FP8 codes can flip where the TP partial sums round differently (one e4m3 step)
        torch.testing.assert_close(actual, expected, atol=2e-2 if fp8 else 1e-4, rtol=2e-2 if fp8 else 1e-4)
    sp = reports[0].record("sp_rewrite")
    # one layer: the attention-side HC, the MoE HC and the final mixer
    assert sp.status == "applied" and sp.applied == 3, reports[0]
    gm = graphs[0][0].gm
    assert count_calls(gm, c10d.all_reduce.default) == 0
    assert count_calls(gm, c10d.reduce_scatter_tensor.default) == 2
    assert sp.facts["streams_gathered"] == 0


def compiled_rank(rank: int, tp: int) -> dict[str, object]:
    """One gloo rank: the sharded one-layer FP8 qwen4_exp through ``torch.compile(backend=hcpasses)``."""
    import hcpasses

    model = build("qwen4_exp", True, rank, tp)
    backend = hcpasses.backend(sp_min_tokens=1)
    with torch._inductor.config.patch({"cpp.simdlen": 0, "force_disable_caches": True}):
        actual = logits(torch.compile(model, backend=backend), token_ids(2, seed=6))
    return {"logits": actual, "reports": [str(r) for r in backend.reports], "sp": backend.reports[0].applied}


def test_two_gloo_ranks_compile_qwen4_exp_with_sp() -> None:
    from hcpasses.multiproc import run_ranks

    results = run_ranks(compiled_rank, 2, timeout_s=600)
    expected = logits(build("qwen4_exp", True), token_ids(2, seed=6))
    for result in results:
        torch.testing.assert_close(result["logits"], expected, atol=2e-2, rtol=2e-2)  # FP8, see above
        assert len(result["reports"]) == 1, result["reports"]
        assert result["sp"]["sp_rewrite"] == 3 and result["sp"]["gated_mean_quant"] == 1, result["reports"]

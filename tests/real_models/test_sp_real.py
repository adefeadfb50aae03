"""SP on the transformers HC models sharded with ``hcpasses.hf.shard_for_tp`` ([batch, seq, hidden]).

Each rank's post-grad graph is captured under the fake group and run on the virtual-rank simulator;
the result is compared first with the same TP graph before the SP pass (exact but for fp32 GEMM
blocking), then with the single-device eager model.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from harness import passes_run_every_compile, simulate
from harness.reference import RankGraphs, assert_same_as_sp_off, capture_with_passes, collective_counts, fused_op_count
from hf_cases import FAMILIES, ONE_LAYER, logits, token_ids

from hcpasses.config import HCPassesConfig
from hcpasses.hf import eager_kernels_under_compile, shard_for_tp, swap_fp8_linears


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


@pytest.mark.parametrize(
    ("family", "fp8", "batch", "delta_rule_op"),
    [("qwen4_exp", True, 2, False), ("qwen4_exp", True, 2, True), ("deepseek_v4", False, 2, False)],
)
def test_sp_shards_every_hc_block_and_matches_one_device(
    family: str, fp8: bool, batch: int, delta_rule_op: bool
) -> None:
    """``delta_rule_op``: inside ``eager_kernels_under_compile`` (GatedDeltaNet's delta rule one opaque op in the
    graph, as on the GPU with flash-linear-attention): SP is the same."""
    ids = token_ids(batch, seed=4)
    with eager_kernels_under_compile() if delta_rule_op else contextlib.nullcontext():
        graphs = capture_with_passes(
            lambda rank, tp: Logits(build(family, fp8, rank, tp)),
            lambda rank, tp: (ids,),
            2,
            HCPassesConfig(sp_min_tokens=1),
            codegen=False,
        )
        outputs = simulate(graphs.graphs, graphs.inputs)
        unsharded = graphs.sp_off()
        for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
            assert_same_as_sp_off(got, want, fp8=fp8)  # the models are fp32
        expected = logits(build(family, fp8), ids)
    delta_rules = sum(
        node.target is torch.ops.hcpasses.chunk_gated_delta_rule.default for node in graphs.graphs[0].graph.nodes
    )
    assert delta_rules == (1 if delta_rule_op else 0)
    for (actual,) in outputs:
        # fp32; FP8 codes can flip where the TP partial sums round differently (one e4m3 step)
        torch.testing.assert_close(actual, expected, atol=2e-2 if fp8 else 1e-4, rtol=2e-2 if fp8 else 1e-4)
    sp = graphs.report.record("sp_rewrite")
    # one layer: the attention-side HC, the MoE HC and the final mixer
    assert sp.status == "applied" and sp.applied == 3, graphs.report
    counts = collective_counts(graphs.graphs[0])
    assert counts["all_reduce"] == 0 and counts["reduce_scatter"] == 2, counts
    assert collective_counts(unsharded.graphs[0])["all_reduce"] == 2
    assert sp.facts["streams_gathered"] == 0
    # qwen4_exp: the attention HC, and the MoE HC through the MoE's view(-1, hidden) by evaluation
    fused = 2 if fp8 else 0
    assert fused_op_count(graphs.graphs[0]) == fused == graphs.report.applied["gated_mean_quant"]


def compiled_rank(rank: int, tp: int) -> dict[str, object]:
    """One gloo rank: the sharded one-layer FP8 qwen4_exp through ``torch.compile(backend=hcpasses)``."""
    import hcpasses

    model = build("qwen4_exp", True, rank, tp)
    backend = hcpasses.backend(sp_min_tokens=1)
    with passes_run_every_compile():
        actual = logits(torch.compile(model, backend=backend), token_ids(2, seed=6))
    return {"logits": actual, "reports": [str(r) for r in backend.reports], "sp": backend.reports[0].applied}


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_two_gloo_ranks_compile_qwen4_exp_with_sp() -> None:
    from hcpasses.testing.multiproc import run_ranks

    results = run_ranks(compiled_rank, 2, timeout_s=600)
    expected = logits(build("qwen4_exp", True), token_ids(2, seed=6))
    for result in results:
        torch.testing.assert_close(result["logits"], expected, atol=2e-2, rtol=2e-2)  # FP8, see above
        assert len(result["reports"]) == 1, result["reports"]
        assert result["sp"]["sp_rewrite"] == 3 and result["sp"]["gated_mean_quant"] == 2, result["reports"]


# Two GatedDeltaNet layers, the PLE in the second (inside the region: after two HC blocks), one sequence.
PLE_INSIDE = {"num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2, "ple_layer_ids": [2]}


@pytest.mark.parametrize("tokens", [16, 13])  # even and ragged at tp 2 (its heads do not split 3 or 4 ways)
def test_qwen4_exp_ple_runs_on_the_shards(tokens: int) -> None:
    """The PLE after HC blocks: its n-gram embedding lookup, key and value projections and their norm run on this
    rank's rows (hoisted from the ids), its conv on them and the 9 rows before (a halo), and the streams are never
    gathered; the logits are SP off's and eager's (one sequence: its tokens are the token rows)."""
    ids, tp = torch.randint(128, (1, tokens), generator=torch.Generator().manual_seed(tokens)), 2

    def build_ple(rank: int | None = None, size: int | None = None) -> torch.nn.Module:
        model = FAMILIES["qwen4_exp"](**PLE_INSIDE)
        if size is not None:
            shard_for_tp(model, rank, size)
        return model

    graphs = capture_with_passes(
        lambda rank, size: Logits(build_ple(rank, size)),
        lambda rank, size: (ids,),
        tp,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    sp = graphs.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 5, graphs.report  # 2 HC blocks per layer and the final mixer
    assert (sp.facts["cuts"], sp.facts["halos"], sp.facts["streams_gathered"]) == (0, 1, 0), sp.notes
    assert sp.facts["hoisted"] > 0, sp.notes
    assert_like_sp_off_and_eager(graphs, logits(build_ple(), ids))


class KeptLogits(Logits):
    """``input_ids -> logits`` of the last token of each sequence (``logits_to_keep=1``, as serving's prefill)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, logits_to_keep=1).logits


@pytest.mark.parametrize(("family", "final_norm"), [("qwen4_exp", False), ("deepseek_v4", True)])
def test_logits_to_keep_gathers_only_the_last_row_of_each_sequence(family: str, final_norm: bool) -> None:
    """Two ragged sequences of 13 tokens at tp 2 (R = 13 rows; row 12 on rank 0, row 25 on rank 1): the final
    mixer's output (qwen4_exp) or its final norm's, run on the shards (deepseek_v4), is gathered in its 2 kept rows,
    not 26; the logits are SP off's and eager's."""
    ids = token_ids(2, seed=9)[:, :13]
    graphs = capture_with_passes(
        lambda rank, tp: KeptLogits(build(family, False, rank, tp)),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    sp = graphs.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.applied == 3 and sp.facts["kept_rows_gathers"] == 1, sp.notes
    assert (sp.facts["tail"] > 0) == final_norm, sp.notes
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    last = [node for node in graphs.graphs[1].graph.nodes if node.target is gather][-1]
    assert last.args[0].meta["val"].shape[0] == 2  # one kept row per sequence from each rank
    expected = KeptLogits(build(family, False))(ids)
    assert expected.shape[:2] == (2, 1)
    assert_like_sp_off_and_eager(graphs, expected)


def assert_like_sp_off_and_eager(graphs: RankGraphs, expected: torch.Tensor) -> None:
    """Every rank's logits equal the SP-off graph's and ``expected`` (eager's, fp32: GEMM blocking only)."""
    outputs = simulate(graphs.graphs, graphs.inputs)
    unsharded = graphs.sp_off()
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want)
    for (actual,) in outputs:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)

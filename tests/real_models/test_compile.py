"""The transformers HC models under torch.compile: where Dynamo breaks the graph, and the hcpasses backend."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from harness.capture import RecordingPass, passes_run_every_compile
from harness.reference import capture_with_passes
from hf_cases import FAMILIES, ONE_LAYER, logits, token_ids
from transformers.models.qwen4_exp import modeling_qwen4_exp

import hcpasses
from hcpasses.config import HCPassesConfig
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


# What each pass does to the one-layer FP8-swapped models at tp = 1, checked by hand on the post-grad graph:
# ``(status, rewrites, reason)`` per pass; ``None`` leaves the reason unchecked (see below).
#
# qwen4_exp has 3 HC collapses (attention, MoE, final mixer). The attention collapse feeds the GatedDeltaNet
# in_proj FP8 linears directly and is fused by the traced patterns. The MoE collapse reaches its shared-expert
# FP8 linears through the MoE's ``view(-1, hidden)`` (a regrouping of token rows) and is fused by evaluation;
# the final mixer has no quant.
# deepseek_v4 has 3 mHC collapses (attention, MoE, head); the attention and MoE collapses reach their FP8
# linears through the sub-layer RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``): the quant is of the norm's
# output, not of the collapse, which the fused ops (collapse + quant of x) do not cover; the head has no quant.
# The fusion's reason names each unfused collapse and what follows it (EXPECTED_FUSION_REASON: how many
# collapses have no FP8 quant after them, and the ops every "FP8 cast follows" path must show).
#
# Under torch.compile on torch 2.11, transformers' GatedDeltaNet takes its export path, the torch chunk loop
# (seen on the H200 machine, 2026-12-03: 1628 post-grad nodes against 598 on torch 2.13; the same graph as
# ``test_qwen4_exp_delta_rule_loop_is_not_counted_as_hc_blocks`` makes on 2.13 by mocking the export check).
DELTA_RULE_LOOP_UNDER_COMPILE = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
NOT_DISTRIBUTED = "not distributed (tp = 1): nothing to shard"
# qwen4_exp's n-gram hashing scans the EOS positions with a torch.cummax, once per shift of the token ids (2 at
# ngram_size 3); blocked_scans leaves CPU graphs alone and names each scan
ON_CPU = "left as it is: on cpu, where Inductor runs every scan as ATen's kernel"
CUMMAX_ON_CPU = f"cummax {ON_CPU}; cummax_1 {ON_CPU}"
QWEN4_EXP_PASSES = (
    {
        # the chunk loop leaves no fp32 -> fp32 convert, and one unused select of its output buffer
        "canonical_forms": ("unchanged", 0, None),
        "gated_mean_quant": ("applied", 2, None),
        "sp_rewrite": ("unchanged", 0, NOT_DISTRIBUTED),
        "blocked_scans": ("unchanged", 0, CUMMAX_ON_CPU),
        "cleanup": ("applied", 1, None),
    }
    if DELTA_RULE_LOOP_UNDER_COMPILE
    else {
        # one fp32 -> fp32 convert left in the fp32 model's graph (dropped: a no-op)
        "canonical_forms": ("applied", 1, None),
        "gated_mean_quant": ("applied", 2, None),
        "sp_rewrite": ("unchanged", 0, NOT_DISTRIBUTED),
        "blocked_scans": ("unchanged", 0, CUMMAX_ON_CPU),
        "cleanup": ("unchanged", 0, "no unused pure nodes"),
    }
)
EXPECTED_PASSES: dict[str, dict[str, tuple[str, int, str | None]]] = {
    "qwen4_exp": QWEN4_EXP_PASSES,
    "deepseek_v4": {
        # one torch.max(...).values whose indices nothing reads (exact rewrite to amax)
        "canonical_forms": ("applied", 1, None),
        "gated_mean_quant": ("unchanged", 0, None),
        "sp_rewrite": ("unchanged", 0, NOT_DISTRIBUTED),
        "blocked_scans": ("unchanged", 0, "no cummax or cummin"),
        "cleanup": ("unchanged", 0, "no unused pure nodes"),
    },
}
# The fusion's notes: the collapses it found and how many it fused (3 collapses per family, see above), besides
# the time evaluation took (EVALUATION_TIME: checked by its shape, the number varies). qwen4_exp's fused x's are
# each read by several FP8 linears (GatedDeltaNet's 4 in-projections, the shared expert's gate and up): one quant
# is fused, the other 4 read the fused codes and scales.
EXPECTED_FUSION_NOTES = {
    "qwen4_exp": (
        "HC stream collapses found: 3",
        "fused with a per-token FP8 quant: 2",
        "of them matched by evaluation (7 probes): 1",
        "other FP8 quants of a fused x served by the fused codes and scales: 4",
    ),
    "deepseek_v4": ("HC stream collapses found: 3", "fused with a per-token FP8 quant: 0"),
}
# The chunk loop's forward substitution: one gated sum per row i = 1 .. 63 of a 64-token chunk (transformers'
# chunk size), each in the stacked mHC form but over [batch, heads, chunks, i, i].
DELTA_RULE_LOOKALIKES = "collapse-shaped sums that are no HC stream collapse, left out: 63"
EVALUATION_TIME = re.compile(r"quants judged by evaluation after (\d+) collapses: \d+\.\d ms")


def fusion_counts(notes: tuple[str, ...], judged: int) -> tuple[str, ...]:
    """The notes but the evaluation's time, after checking that exactly one note gives it for ``judged`` collapses."""
    times = [EVALUATION_TIME.fullmatch(note) for note in notes]
    assert [int(m.group(1)) for m in times if m] == [judged], notes
    return tuple(note for note, m in zip(notes, times, strict=True) if not m)


EXPECTED_FUSION_REASON = {
    "qwen4_exp": {"no quant": 1, "cast through": []},  # the final mixer
    # head; attention and MoE collapses: x * rsqrt(mean(x^2) + eps) * w, then the quant's division
    "deepseek_v4": {"no quant": 1, "cast through": ["mul -> mul -> div", "mul -> mul -> div"]},
}
EXPECTED_FP8_CASTS_LEFT = {"qwen4_exp": 0, "deepseek_v4": 4}
# The fused op each family's collapse becomes: the gated mean (qwen4_exp) or the mHC weighted sum.
FUSED_OPS = {
    "qwen4_exp": torch.ops.hcpasses.gated_mean_quant.default,
    "deepseek_v4": torch.ops.hcpasses.weighted_sum_quant.default,
}


@pytest.mark.parametrize("batch", [1, 2])
def test_hcpasses_backend_matches_eager(family: str, batch: int) -> None:
    model = FAMILIES[family](**ONE_LAYER[family])
    swap_fp8_linears(model)
    ids = token_ids(batch, seed=9)
    expected = logits(model, ids)
    backend = hcpasses.backend()
    # Inductor's post-grad post pass runs after hcpasses' pre pass and Inductor's own post-grad passes: the
    # graph it records is the one Inductor lowers.
    lowered = RecordingPass()
    torch._dynamo.reset()
    with passes_run_every_compile(), torch._inductor.config.patch(post_grad_custom_post_pass=lowered):
        actual = logits(torch.compile(model, backend=backend), ids)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)

    assert len(backend.reports) == 1  # one graph: no break in the one-layer models
    report = backend.reports[0]
    assert [record.name for record in report.passes] == list(EXPECTED_PASSES[family]), str(report)
    assert not report.cached, str(report)
    for name, (status, applied, reason) in EXPECTED_PASSES[family].items():
        record = report.record(name)
        assert (record.status, record.applied) == (status, applied), f"{name}:\n{report}"
        if reason is not None:
            assert record.reason == reason, f"{name}:\n{report}"
    # collapses judged by evaluation: those no traced pattern fused (qwen4_exp: the MoE's and the final mixer's)
    notes = fusion_counts(report.record("gated_mean_quant").notes, judged=2 if family == "qwen4_exp" else 3)
    if family == "qwen4_exp" and DELTA_RULE_LOOP_UNDER_COMPILE:
        *notes, lookalikes = notes
        assert lookalikes.startswith(f"{DELTA_RULE_LOOKALIKES} "), str(report)
    assert tuple(notes) == EXPECTED_FUSION_NOTES[family], str(report)
    reason = report.record("gated_mean_quant").reason
    expected_reason = EXPECTED_FUSION_REASON[family]
    assert reason.startswith("not fused: "), reason
    entries = reason.removeprefix("not fused: ").split("; ")
    assert sum(e.endswith(": no FP8 quant after it") for e in entries) == expected_reason["no quant"], reason
    casts = [e for e in entries if ": an FP8 cast follows (" in e]
    assert len(casts) == len(expected_reason["cast through"]), reason
    for entry, op in zip(casts, expected_reason["cast through"], strict=True):
        assert op in entry.split("through ", 1)[1], reason

    # Each reported fusion is one fused op in the lowered graph, and its FP8 codes and scales are used.
    assert len(lowered.graphs) == 1
    graph = lowered.graphs[0].graph
    # x is quantised once: in qwen4_exp no FP8 cast is left (every quant fused or served). deepseek_v4's quants
    # read its sub-layer RMSNorm outputs, not a collapse's x: all 4 remain (q_a_proj and the KV projection, the
    # shared expert's gate and up; two quants of each norm output, which only a sharing of any source would merge)
    casts = [node for node in graph.nodes if node.target is torch.ops.prims.convert_element_type.default]
    fp8_casts = [node for node in casts if node.args[1] in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert len(fp8_casts) == EXPECTED_FP8_CASTS_LEFT[family], [node.meta.get("nn_module_stack") for node in fp8_casts]
    fused = [node for node in graph.nodes if node.target in FUSED_OPS.values()]
    assert [node.target for node in fused] == [FUSED_OPS[family]] * report.applied["gated_mean_quant"]
    for node in fused:
        used = {user.args[1] for user in node.users if user.target is operator.getitem and user.users}
        assert {1, 2} <= used, f"{node.format_node()}: q or scale unused"


def test_qwen4_exp_delta_rule_loop_is_not_counted_as_hc_blocks() -> None:
    """On its export path (``is_torchdynamo_exporting()``; torch 2.11 also takes it under ``torch.compile``,
    where the H200 run counted 196 "HC collapses" for a 3-layer model) GatedDeltaNet builds its UT transform by
    forward substitution, ``(row.unsqueeze(-1) * sub).sum(-2)`` over ``[batch, heads, chunks, i, i]``: 63
    gated sums per layer in the stacked mHC form. The fusion counts the 3 HC collapses and names the rest."""

    def build(rank: int, tp: int) -> Callable[[torch.Tensor], torch.Tensor]:
        model = FAMILIES["qwen4_exp"](**ONE_LAYER["qwen4_exp"])
        swap_fp8_linears(model)
        return lambda ids: model(ids).logits

    with mock.patch.object(modeling_qwen4_exp, "is_torchdynamo_exporting", lambda: True):
        captured = capture_with_passes(build, lambda rank, tp: (token_ids(1),), 1, HCPassesConfig(), codegen=False)
    graph = captured.graphs[0].graph
    assert sum(1 for node in graph.nodes if "torch_chunk_gated_delta_rule" in (node.meta.get("stack_trace") or "")) > 0
    fusion = captured.report.record("gated_mean_quant")
    *counts, lookalikes = fusion_counts(fusion.notes, judged=2)
    assert tuple(counts) == EXPECTED_FUSION_NOTES["qwen4_exp"], fusion.notes
    assert lookalikes.startswith(f"{DELTA_RULE_LOOKALIKES} ")
    assert "3 leading dims" in lookalikes, fusion.notes
    assert fusion.applied == 2 == sum(1 for node in graph.nodes if node.target is FUSED_OPS["qwen4_exp"])

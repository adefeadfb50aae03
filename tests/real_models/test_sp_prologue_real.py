"""SP prologues on transformers' deepseek_v4 as torch 2.11 lowers it (tests/test_sp_prologue.py has the mechanism on a
model of our own)."""

from __future__ import annotations

import pytest
import torch
from harness.reference import assert_same_as_sp_off, capture_with_passes
from hf_cases import token_ids
from test_sp_prologue import gathered_dtypes
from test_sp_real import Logits, build
from test_sp_rewrite import run

from hcpasses.config import HCPassesConfig
from hcpasses.passes.canonical_forms import CanonicalForms

CONVERT = torch.ops.prims.convert_element_type.default


def fold_bf16_round_trips(graph: torch.fx.Graph) -> None:
    """What torch 2.11's joint-graph ``pointless_convert`` does and 2.13's keeps (it now leaves a narrower middle
    dtype): ``convert(convert(x, bf16), f32)`` of an fp32 x becomes x. On 2.11 deepseek_v4's mHC collapse then
    hands its fp32 sum to the sub-layer's RMS norm (the gathers the H200 run measured in fp32)."""
    for node in list(graph.nodes):
        middle = node.args[0] if node.target is CONVERT and node.args[1] is torch.float32 else None
        if middle is not None and middle.target is CONVERT and middle.args[1] is torch.bfloat16:
            if middle.args[0].meta["val"].dtype is torch.float32:
                node.replace_all_uses_with(middle.args[0])


def test_deepseek_v4_as_torch_211_lowers_it_gathers_every_sub_layer_input_in_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers' deepseek_v4 in bf16 with 2.11's fold: every sub-layer input (attention, MoE) and the final
    head's output reach their norms as fp32 sums; each norm and its bf16 cast run on the shards and the bf16 value is
    gathered. Each block's prologue is judged on its own: a step dropped in one (a view the q GEMM reads) takes none
    of the later blocks' steps with it."""
    original = CanonicalForms.run

    def run_after_the_fold(self: CanonicalForms, graph: torch.fx.Graph, config: HCPassesConfig) -> object:
        fold_bf16_round_trips(graph)
        return original(self, graph, config)

    monkeypatch.setattr(CanonicalForms, "run", run_after_the_fold)
    ids = token_ids(2, seed=4)
    sharded = capture_with_passes(
        lambda rank, tp: Logits(build("deepseek_v4", False, rank, tp).to(torch.bfloat16)),
        lambda rank, tp: (ids,),
        2,
        HCPassesConfig(sp_min_tokens=1),
        codegen=False,
    )
    sp = sharded.report.record("sp_rewrite")
    assert sp.facts["prologue_gathers"] == 3 and sp.facts["cuts"] == 0, sp.notes
    for gm in sharded.graphs:
        assert gathered_dtypes(gm) == [torch.bfloat16] * 3, gm.graph
    # Against SP off only: the fold drops a bf16 rounding that eager keeps, so eager computes other numbers.
    for got, want in zip(run(sharded, ids), run(sharded.sp_off(), ids), strict=True):
        assert_same_as_sp_off(got, want, fp8=True)

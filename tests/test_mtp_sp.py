"""SP through the MTP drafter: target + drafter in one graph keep the HC state sharded (simulator)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import count_calls, simulate
from harness.reference import assert_same_as_sp_off, capture_with_passes, fused_op_count

from hcpasses.config import HCPassesConfig
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.testing.models.mtp import MTPDrafter, prefill_target_and_drafter

c10d = torch.ops._c10d_functional
CFG = HCConfig.tiny(n_layers=2, ple_layer=0, fp8=True, n_heads=12, n_kv_heads=12, intermediate=96, seed=3)


class TargetAndDrafter(torch.nn.Module):
    """The user's prefill: target and drafter called from one function (``streams``: return the drafter's)."""

    def __init__(self, tp_rank: int | None, tp_size: int | None, streams: bool) -> None:
        super().__init__()
        self.target = HCDecoder(CFG, tp_rank, tp_size)
        self.drafter = MTPDrafter(CFG, tp_rank, tp_size, target=self.target)
        self.streams = streams

    def forward(self, ids: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        target_logits, drafter_logits, streams = prefill_target_and_drafter(self.target, self.drafter, ids, next_ids)
        return (target_logits, drafter_logits, streams) if self.streams else (target_logits, drafter_logits)


def run_sharded(build: Any, args: tuple[torch.Tensor, ...], tp: int) -> tuple[list, Any, torch.fx.GraphModule]:
    """Each rank's outputs with SP (checked against the same graphs before SP), SP's record, rank 0's graph."""
    graphs = capture_with_passes(build, lambda rank, tp: args, tp, HCPassesConfig(sp_min_tokens=1), codegen=False)
    outputs = simulate(graphs.graphs, graphs.inputs)
    unsharded = graphs.sp_off()
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want, fp8=True)  # CFG: fp32 model, FP8 sub-layer inputs
    assert fused_op_count(graphs.graphs[0]) == graphs.report.applied["gated_mean_quant"] > 0
    return outputs, graphs.report.record("sp_rewrite"), graphs.graphs[0]


def ids(tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("tp", "tokens", "streams"), [(2, 11, True), (3, 8, False)])
def test_fused_target_and_drafter_keep_the_state_sharded(tp: int, tokens: int, streams: bool) -> None:
    args = (ids(tokens, 1), ids(tokens, 2))
    outputs, sp, gm = run_sharded(lambda rank, tp: TargetAndDrafter(None, None, streams), args, tp)
    with torch.no_grad():
        expected = TargetAndDrafter(0, 1, streams)(*args)
    for rank_outputs in outputs:
        for got, want in zip(rank_outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)  # FP8: a flipped code is one e4m3 step
    # every HC block of both models is sharded: target 2 layers x 2 + final mixer, drafter 2 + its mixer
    assert sp.applied == 8, sp
    assert sp.facts["entries_sharded"] == 1  # the drafter's projected embedding, where it joins the streams
    # The target's HC state is never gathered; the only stream-wide gather is the drafter's returned streams.
    assert sp.facts["streams_gathered"] == int(streams), sp
    assert count_calls(gm, c10d.all_reduce.default) == 0
    assert count_calls(gm, c10d.reduce_scatter_tensor.default) == 6  # 2 target layers (PLE first) + 1 drafter layer
    # q + scale per sub-layer input (6), the two final mixers' x, the drafter's streams when returned
    assert count_calls(gm, c10d.all_gather_into_tensor.default) == 2 * 6 + 2 + int(streams)


def test_separately_compiled_target_gathers_its_state_at_the_exit() -> None:
    args = (ids(9, 3),)
    outputs, sp, _ = run_sharded(lambda rank, tp: StateExit(HCDecoder(CFG)), args, 2)
    with torch.no_grad():
        expected = HCDecoder(CFG, 0, 1)(*args, return_hc_state=True)
    for rank_outputs in outputs:
        for got, want in zip(rank_outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert sp.facts["streams_gathered"] == 1 and sp.facts["entries_sharded"] == 0, sp


class StateExit(torch.nn.Module):
    def __init__(self, target: HCDecoder) -> None:
        super().__init__()
        self.target = target

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target(ids, return_hc_state=True)

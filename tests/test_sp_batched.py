"""The SP rewrite on ``[batch, seq, hidden]`` activations (the transformers layout), on the simulator.

The token dim that is sharded is batch x seq flattened; a shard keeps the rank (``[1, R, ...]``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from harness import capture_ranks, count_calls, simulate
from harness.toy import BatchedHCModel
from hypothesis import given, settings
from hypothesis import strategies as st

from hcpasses.config import HCPassesConfig
from hcpasses.manager import PassManager
from models import HCConfig

c10d = torch.ops._c10d_functional
EXAMPLE = (2, 7)  # batch != seq, so the symbolic sizes of a dynamic capture can be told apart

# (tp, seq_mix_layer, return_state, fp8, dynamic)
CASES = [
    (2, None, False, False, True),
    (3, 1, True, True, True),
    (2, 0, True, False, False),
    (4, None, False, True, False),
]


def config(fp8: bool) -> HCConfig:
    return HCConfig.tiny(n_layers=2, fp8=fp8, intermediate=96, seed=5)


@functools.cache
def captured(case: tuple, batch: int, seq: int) -> tuple[list, list, list]:
    tp, mix, state, fp8, dynamic = case
    reports: list = []
    manager = PassManager(HCPassesConfig(sp_min_tokens=1), reports.append)
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(batch * seq))
    graphs = capture_ranks(
        lambda rank, tp: BatchedHCModel(config(fp8), mix, state),
        lambda rank, tp: (ids,),
        tp,
        dynamic=dynamic,
        codegen=False,
        config_patches={"post_grad_custom_pre_pass": manager},
    )
    return [g[0].gm for g in graphs], [g[0].inputs for g in graphs], reports


def with_ids(inputs: list[Any], gm: torch.fx.GraphModule, ids: torch.Tensor) -> list[Any]:
    """The captured inputs with the ids and the symbolic batch / seq sizes replaced."""
    sizes = dict(zip(EXAMPLE, ids.shape, strict=True))
    values = []
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs, strict=True):
        if isinstance(node.meta["val"], torch.SymInt):
            value = sizes[value]
        elif isinstance(value, torch.Tensor) and not value.is_floating_point():
            value = ids
        values.append(value)
    return values


@pytest.mark.parametrize("case", CASES, ids=lambda c: "tp{}-mix{}-state{}-fp8{}-dyn{}".format(*c))
@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_batched_streams_are_sharded_and_match_eager(case: tuple, batch: int, seq: int, seed: int) -> None:
    tp, mix, state, fp8, dynamic = case
    shape = EXAMPLE if dynamic else (batch, seq)
    graphs, inputs, reports = captured(case, *shape)
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    outputs = simulate(graphs, [with_ids(inputs[r], graphs[r], ids) for r in range(tp)])
    with torch.no_grad():
        expected = BatchedHCModel(config(fp8), mix, state)(ids)  # no process group: one device
    expected = expected if state else (expected,)
    tol = 3e-2 if fp8 else 1e-4  # FP8: a flipped code moves one element by one e4m3 step
    for rank_outputs in outputs:
        for got, want in zip(rank_outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    sharded_layers = 2 - (mix or 0)
    sp = reports[0].record("sp_rewrite")
    assert sp.applied == 2 * sharded_layers + 1, reports[0]
    assert count_calls(graphs[0], c10d.reduce_scatter_tensor.default) == 2 * sharded_layers
    assert count_calls(graphs[0], c10d.all_reduce.default) == 2 * (mix or 0)
    gathers = 2 * sharded_layers * (2 if fp8 else 1) + 1 + int(state)
    assert count_calls(graphs[0], c10d.all_gather_into_tensor.default) == gathers
    assert reports[0].applied["gated_mean_quant"] == (4 if fp8 else 0)


SHAPES = [(2, 9), (3, 4), (2, 3)]  # batch x seq = 18, 12, 6 against sp_min_tokens=10 (batch 1 would specialise)


def batched_rank(rank: int, tp: int) -> dict[str, Any]:
    """One gloo rank: the batched model compiled with dynamic batch and seq, called on SHAPES."""
    import hcpasses

    model = BatchedHCModel(config(True), seq_mix_layer=None, return_state=True)
    be = hcpasses.backend(sp_min_tokens=10)
    compiled = torch.compile(model, backend=be, dynamic=True)
    results: dict[str, Any] = {}
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        for shape in SHAPES:
            results[shape] = compiled(batched_ids(shape))
    results["calls"] = [dict(d.calls) for d in be.dispatchers]
    results["variants"] = [r.variant for r in be.reports]
    results["sp"] = [r.record("sp_rewrite").status for r in be.reports]
    return results


def batched_ids(shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(shape[0] * 100 + shape[1]))


def test_two_gloo_ranks_dispatch_on_batch_times_seq() -> None:
    from hcpasses.multiproc import run_ranks

    results = run_ranks(batched_rank, 2, timeout_s=600)
    reference = BatchedHCModel(config(True), seq_mix_layer=None, return_state=True)
    for rank_results in results:
        for shape in SHAPES:
            with torch.no_grad():
                want = reference(batched_ids(shape))
            for got, expected in zip(rank_results[shape], want, strict=True):
                torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2, msg=str(shape))
    first = results[0]
    # one graph for every shape, in two variants, dispatched on batch*seq: 18 and 12 sharded, 6 not
    assert first["calls"] == [{"sharded": 2, "unsharded": 1}], first
    assert first["variants"] == ["sharded", "unsharded"] and first["sp"][0] == "applied", first

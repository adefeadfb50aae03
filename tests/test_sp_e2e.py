"""The SP rewrite through ``torch.compile(backend=...)``: real graphs (fake group) and 2 gloo processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from harness import compile_without_codegen, fake_process_group, passes_run_every_compile
from harness.toy import D_MODEL, build_toy_mlp

import hcpasses
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.testing.multiproc import run_ranks

TINY = dict(n_heads=12, n_kv_heads=12, intermediate=96)


def compile_once(model: torch.nn.Module, ids: torch.Tensor, **flags: Any) -> hcpasses.HCPassesBackend:
    torch._dynamo.reset()
    be = hcpasses.backend(**flags)
    with passes_run_every_compile(), torch.no_grad():
        torch.compile(model, backend=be)(ids)
    return be


@pytest.fixture
def rank0_of_2() -> Iterator[None]:
    with fake_process_group(0, 2):
        yield


def sp_record(be: hcpasses.HCPassesBackend) -> hcpasses.PassRecord:
    return be.reports[-1].record("sp_rewrite")


@pytest.mark.usefixtures("rank0_of_2")
def test_fires_on_every_hc_block_of_the_builtin_model() -> None:
    cfg = HCConfig.tiny(n_layers=3, fp8=True, **TINY)
    be = compile_once(HCDecoder(cfg), torch.randint(0, 64, (37,)), sp_min_tokens=16)
    record = sp_record(be)
    assert record.status == "applied"
    assert record.applied == 2 * cfg.n_layers + 1  # attention + MLP HC per layer, final mixer
    assert "collectives: 6 all-reduce -> reduce-scatter; 13 all-gathers added" in record.notes
    assert be.reports[-1].applied["gated_mean_quant"] == 2 * cfg.n_layers


@pytest.mark.usefixtures("rank0_of_2")
def test_threshold_keeps_small_static_graphs_unsharded() -> None:
    be = compile_once(HCDecoder(HCConfig.tiny(**TINY)), torch.randint(0, 64, (37,)), sp_min_tokens=64)
    assert sp_record(be).status == "unchanged"
    assert sp_record(be).reason == "T=37 < sp_min_tokens=64"


@pytest.mark.usefixtures("rank0_of_2")
def test_leaves_a_non_hc_tp_graph_alone() -> None:
    be = compile_once(build_toy_mlp(0, 2), torch.randn(9, D_MODEL), sp_min_tokens=1)
    assert sp_record(be).status == "unchanged"
    assert sp_record(be).reason == "no HC block (stream collapse) in this graph"


@pytest.mark.usefixtures("rank0_of_2")
def test_unsupported_all_reduce_leaves_the_graph_unsharded(monkeypatch) -> None:
    def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return tensor.copy_(funcol.all_reduce(tensor, "max", group or dist.group.WORLD))

    monkeypatch.setattr("hcpasses.testing.models.tp.dist.all_reduce", all_reduce_max)
    be = compile_once(HCDecoder(HCConfig.tiny(**TINY)), torch.randint(0, 64, (37,)), sp_min_tokens=1)
    assert len(be.reports) == 1  # one graph: the patched reduce traces
    record = sp_record(be)
    assert record.status == "unchanged"
    assert "is not a waited sum" in record.reason


def e2e_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Both passes on, through torch.compile, on real gloo collectives."""
    cfg = HCConfig.tiny(n_layers=3, fp8=True, ple_layer=2, seed=5, **TINY)  # PLE in the last layer
    results: dict[str, Any] = {}
    model = HCDecoder(cfg)
    with torch.no_grad():
        be = hcpasses.backend(sp_min_tokens=8)
        compiled = torch.compile(lambda ids: model(ids, return_hc_state=True), backend=be, dynamic=True)
        # below and above the threshold of 8, odd; T <= tp (one row per rank) is left out: the sharded
        # variant's compile guards ceil(T/tp) != 1, so such T recompile once (see README).
        for tokens in (5, 16, 33, 7, 3):
            results[f"dynamic-{tokens}"] = compiled(token_ids(tokens))
        results["dynamic-reports"] = [str(r) for r in be.reports]
        results["dynamic-calls"] = [d.calls for d in be.dispatchers]
        # a static graph with T < tp: one rank holds a pad row only (ragged static T: the SP property)
        torch._dynamo.reset()
        be = hcpasses.backend(sp_min_tokens=1)
        static = torch.compile(lambda ids: model(ids, return_hc_state=True), backend=be, dynamic=False)
        results["static-1"] = static(token_ids(1))
        results["static-1-sp"] = be.reports[-1].record("sp_rewrite").status
    return results


def token_ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_two_gloo_ranks_match_single_device_eager() -> None:
    results = run_ranks(e2e_rank, 2, timeout_s=900)
    cfg = HCConfig.tiny(n_layers=3, fp8=True, ple_layer=2, seed=5, **TINY)
    reference = HCDecoder(cfg, tp_rank=0, tp_size=1)
    for rank_results in results:
        for key, value in rank_results.items():
            if not key.split("-")[-1].isdigit():
                continue
            with torch.no_grad():
                logits, state = reference(token_ids(int(key.split("-")[-1])), return_hc_state=True)
            torch.testing.assert_close(value[0], logits, rtol=1e-4, atol=1e-4, msg=key)
            torch.testing.assert_close(value[1], state, rtol=1e-4, atol=1e-4, msg=key)
    first = results[0]
    assert first["static-1-sp"] == "applied"
    # one dynamic graph in two variants, no recompile per T
    assert first["dynamic-calls"] == [{"sharded": 2, "unsharded": 3}], first["dynamic-reports"]
    reports = first["dynamic-reports"]
    assert "[sharded variant]" in reports[0] and "[unsharded variant]" in reports[1]
    assert "gated_mean_quant   applied" in reports[0]
    # overlap is on by default and falls back on gloo: said in the report, the values above are eager's
    assert "overlap over group '0' (rank 0 of 2): off: no CUDA device (symmetric memory needs GPUs)" in reports[0]


def recording_compile_fx(monkeypatch) -> list[dict[str, Any]]:
    """Record the Inductor config patches of every compile the backend makes; each compile runs the passes
    (reports are made) and stops before codegen (the backend's choices are tested, not Inductor's code)."""
    backend_module = sys.modules["hcpasses.backend"]  # the module; ``hcpasses.backend`` is the function
    seen: list[dict[str, Any]] = []

    def compile_fx(gm: Any, example_inputs: Any, config_patches: dict[str, Any]) -> Any:
        seen.append(config_patches)
        return compile_without_codegen(gm, example_inputs, config_patches)

    monkeypatch.setattr(backend_module, "compile_fx", compile_fx)
    return seen


@pytest.mark.usefixtures("rank0_of_2")
def test_cudagraphs_only_for_unsharded_graphs(monkeypatch) -> None:
    seen = recording_compile_fx(monkeypatch)
    model = HCDecoder(HCConfig.tiny(**TINY))
    compile_once(model, torch.randint(0, 64, (12,)), sp_min_tokens=64, cudagraphs=True)  # static, below the threshold
    assert [p["triton.cudagraphs"] for p in seen] == [False, True]  # recompiled with CUDA graphs: unsharded
    seen.clear()
    compile_once(model, torch.randint(0, 64, (80,)), sp_min_tokens=64, cudagraphs=True)  # static, sharded
    assert [p["triton.cudagraphs"] for p in seen] == [False]
    seen.clear()
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=64, cudagraphs=True)
    with passes_run_every_compile(), torch.no_grad():
        compiled = torch.compile(model, backend=be, dynamic=True)
        compiled(torch.randint(0, 64, (80,)))
        assert [r.variant for r in be.reports] == ["sharded"]  # the unsharded variant waits for a small T
        compiled(torch.randint(0, 64, (12,)))
    assert [r.variant for r in be.reports] == ["sharded", "unsharded"], [str(r) for r in be.reports]
    # Dynamo may trace the dynamic graph twice; every compile of the sharded pipeline is without CUDA graphs
    flags = [(p["post_grad_custom_pre_pass"].config.pass_enabled("sp_rewrite"), p["triton.cudagraphs"]) for p in seen]
    assert flags[-2:] == [(True, False), (False, True)]
    assert (True, True) not in flags

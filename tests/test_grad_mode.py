"""Grad mode: a model compiled with parameters that require grad is an autograd graph; the passes skip it and
every report says so. The same model under ``torch.no_grad()`` / ``torch.inference_mode()`` is rewritten."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from harness import passes_run_every_compile

import hcpasses
from hcpasses.manager import AUTOGRAD_REASON
from hcpasses.testing.models import HCConfig, HCDecoder

CFG = HCConfig.tiny(n_layers=2, fp8=True, dtype=torch.float32, seed=3)
PASSES = ("canonical_forms", "gated_mean_quant", "sp_rewrite", "blocked_scans", "cleanup")


def compile_and_run(
    model: torch.nn.Module, mode: Callable[[], contextlib.AbstractContextManager]
) -> tuple[hcpasses.HCPassesBackend, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=1)
    ids = torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    with passes_run_every_compile(), mode():
        out = torch.compile(model, backend=be)(ids)
        expected = model(ids)
    return be, out, expected


def trainable(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters that require grad, as a user's model has them (our reference models freeze theirs)."""
    for parameter in model.parameters():
        parameter.requires_grad_(parameter.dtype.is_floating_point and parameter.element_size() > 1)
    return model


def test_grad_mode_graph_is_skipped_with_the_reason() -> None:
    model = trainable(HCDecoder(CFG))
    be, out, expected = compile_and_run(model, contextlib.nullcontext)
    torch.testing.assert_close(out, expected)
    assert len(be.reports) == 1, "one forward graph"
    # Training through the compiled model works (the passes touched nothing); AOTAutograd compiles the
    # backward on the first backward call, through the same pipeline: a second report.
    with passes_run_every_compile():
        out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert len(be.reports) == 2, "forward and backward graphs"
    for report in be.reports:
        assert report.variant == "autograd"
        for name in PASSES:
            record = report.record(name)
            assert (record.status, record.applied, record.reason) == ("skipped", 0, AUTOGRAD_REASON)
    assert "torch.no_grad()" in AUTOGRAD_REASON


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_inference_compile_is_rewritten(mode: Callable[[], contextlib.AbstractContextManager]) -> None:
    be, out, expected = compile_and_run(trainable(HCDecoder(CFG)), mode)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    [report] = be.reports
    assert report.variant == "only"
    assert report.record("gated_mean_quant").status == "applied"
    assert report.applied["gated_mean_quant"] == 2 * CFG.n_layers


def test_frozen_parameters_in_grad_mode_are_an_inference_graph() -> None:
    """Nothing requires grad: AOTAutograd builds no backward, so the graph is rewritten as under no_grad."""
    model = trainable(HCDecoder(CFG)).requires_grad_(False)
    be, out, expected = compile_and_run(model, contextlib.nullcontext)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    [report] = be.reports
    assert report.variant == "only"
    assert report.applied["gated_mean_quant"] == 2 * CFG.n_layers


def test_cache_hits_get_the_report_of_their_own_mode(tmp_path, monkeypatch) -> None:
    """grad, no_grad, no_grad, grad compiles sharing Inductor's caches: each hit reloads its own mode's report
    (the key holds the grad mode), never the other's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ids = torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    modes = [contextlib.nullcontext, torch.no_grad, torch.no_grad, contextlib.nullcontext]
    reports = []
    for mode in modes:
        torch._dynamo.reset()
        be = hcpasses.backend(sp_min_tokens=1)
        model = trainable(HCDecoder(CFG))
        with mode():
            torch.testing.assert_close(torch.compile(model, backend=be)(ids), model(ids), rtol=1e-5, atol=1e-5)
        reports.append(be.reports[0])
    assert [r.cached for r in reports] == [False, False, True, True]
    assert [r.variant for r in reports] == ["autograd", "only", "only", "autograd"]
    assert [r.record("gated_mean_quant").status for r in reports] == ["skipped", "applied", "applied", "skipped"]
    assert reports[2].applied["gated_mean_quant"] == 2 * CFG.n_layers

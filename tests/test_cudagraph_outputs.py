"""``cudagraphs=True`` hands the caller outputs it owns (``hcpasses.backend.OwnedOutputs``): a tensor kept from one
call to the next (a KV cache, a list of a decode loop's outputs) is not overwritten by the next call.

Inductor's CUDA-graph trees return each call's outputs in the graph's memory pool and write the next call's over
them (deepseek_v4's sliding-window cache in ``generate()`` read them afterwards: "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run", H100, torch 2.11). On CPU, where Inductor captures no
CUDA graph, ``PoolOutputs`` stands in for that behaviour: the same outputs, written into one buffer per output that
every call overwrites. On the GPU the last test runs the real thing. ``OwnedOutputs`` alone, and which compiles get
it: ``tests/unit/test_unit_backend.py`` (fast, for the mutation run).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import hcpasses

backend_module = sys.modules["hcpasses.backend"]  # the module; ``hcpasses.backend`` is the function


class PoolOutputs:
    """A compiled graph whose outputs live in buffers every call overwrites, as a CUDA graph's replay does."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.pool: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> Any:
        outputs = self.compiled(*args)
        return type(outputs)(self._in_pool(i, output) for i, output in enumerate(outputs))

    def _in_pool(self, index: int, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            return output
        buffer = self.pool.get(index)
        if buffer is None or buffer.shape != output.shape or buffer.dtype != output.dtype:
            buffer = self.pool[index] = torch.empty_like(output)
        return buffer.copy_(output)


class Window(torch.nn.Module):
    """A sliding-window cache of the last 3 rows, as deepseek_v4 keeps ``full[:, :, -window + 1 :, :]``."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = x if self.keys is None else torch.cat([self.keys, x])
        self.keys = full[-3:]
        return full.sum(0) * 2


def decode(model: Window, steps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each step's output, kept (as ``generate()`` keeps its tokens' logits) until the end."""
    return [model(x) for x in steps]


def graph_pools_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every compile with CUDA graphs asked for returns its outputs in a pool (``PoolOutputs``); which asked."""
    real_compile_fx = backend_module.compile_fx
    asked = []

    def compile_fx(gm: Any, example_inputs: Any, config_patches: dict[str, Any]) -> Any:
        compiled = real_compile_fx(gm, example_inputs, config_patches=config_patches)
        asked.append(config_patches["triton.cudagraphs"])
        return PoolOutputs(compiled) if config_patches["triton.cudagraphs"] else compiled

    monkeypatch.setattr(backend_module, "compile_fx", compile_fx)
    return asked


def steps(count: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(1, 8, generator=gen).to(device) for _ in range(count)]


@pytest.mark.parametrize("owned", [True, False])
def test_outputs_kept_across_calls_of_a_cuda_graph_keep_their_values(
    owned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the backend with ``cudagraphs=True``: every output kept over 7 steps equals eager's. Without
    ``OwnedOutputs`` (the ``owned=False`` case) the kept outputs read the last call's values: the test can fail."""
    asked = graph_pools_on_cpu(monkeypatch)
    if not owned:
        monkeypatch.setattr(backend_module, "OwnedOutputs", lambda compiled: compiled)
    xs = steps(7)
    want = decode(Window(), xs)
    torch._dynamo.reset()
    with torch.no_grad():
        got = decode(torch.compile(Window(), backend=hcpasses.backend(cudagraphs=True), dynamic=False), xs)
    assert asked and all(asked[1::2]), asked  # each graph compiled again with CUDA graphs
    same = [torch.equal(g, w) for g, w in zip(got, want, strict=True)]
    assert all(same) if owned else not all(same), same


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("owned", [True, False])
def test_on_cuda_a_kept_output_of_a_captured_graph_is_not_overwritten(
    owned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's CUDA-graph trees, for real: with ``OwnedOutputs`` every kept output equals eager's; without it
    reading a kept output raises Inductor's "overwritten by a subsequent run" (what ``generate()`` of deepseek_v4
    hit), which pins the behaviour the copy is for."""
    if not owned:
        monkeypatch.setattr(backend_module, "OwnedOutputs", lambda compiled: compiled)
    xs = steps(7, "cuda")
    want = decode(Window(), xs)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(Window(), backend=hcpasses.backend(cudagraphs=True), dynamic=False)
        if owned:
            got = decode(compiled, xs)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        else:
            with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
                got = decode(compiled, xs)
                [g.sum().item() for g in got]

"""``lazy_variants``: a graph SP sharded with a symbolic T compiles its unsharded variant on the first call that
needs it (T < sp_min_tokens), inside the Dynamo context it was made in, without a recompile, with eager's values;
a compile that adds shape constraints Dynamo no longer checks gives the variant up for the sharded graph."""

from __future__ import annotations

import logging
import sys
import weakref
from pathlib import Path

import pytest
import torch
from corpus.gated_residual import UserHC
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import hcpasses
from hcpasses.backend import LazyInputs, LazyVariant
from hcpasses.testing.models import HCConfig, HCDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulated_tp import simulated_tp

MIN_TOKENS = 16


def ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))


def frames_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("lazy", [True, False])
def test_the_unsharded_variant_is_compiled_on_the_first_small_call_and_serves_every_small_t(lazy: bool) -> None:
    torch._dynamo.reset()
    model = UserHC(layers=1, tp=2, rank=0)
    be = hcpasses.backend(sp_min_tokens=MIN_TOKENS, lazy_variants=lazy)
    compiled = torch.compile(model, backend=be, dynamic=True)
    with simulated_tp(2, 0) as ledger, torch.no_grad():
        seen = []
        for tokens in (32, 8, 3, 64, 5):
            ledger.clear()
            got = compiled(ids(tokens))
            seen.append((tokens, [r.variant for r in be.reports], ledger.counts()))
            if tokens < MIN_TOKENS:  # unsharded: the stand-in all-reduce is the identity, as in eager here
                torch.testing.assert_close(got, model(ids(tokens)), rtol=1e-5, atol=1e-5)
            if tokens == 32:
                frames = frames_compiled()
    (dispatch,) = be.dispatchers
    assert frames_compiled() == frames, "a small T recompiled the frame"
    assert dispatch.calls == {"sharded": 2, "unsharded": 3}
    both = ["sharded", "unsharded"]
    assert seen[0][1] == (["sharded"] if lazy else both)  # lazily: nothing compiled for small T yet
    assert [variants for _, variants, _ in seen[1:]] == [both] * 4  # compiled once, on T = 8
    assert all("reduce_scatter" in counts for tokens, _, counts in seen if tokens >= MIN_TOKENS)
    assert all(counts == {"all_reduce": 2} for tokens, _, counts in seen if tokens < MIN_TOKENS)
    assert isinstance(dispatch.unsharded, LazyVariant) == lazy
    if lazy:
        assert dispatch.unsharded.added == [] and dispatch.unsharded.compiled is not dispatch.sharded


def test_a_graph_that_reads_a_lifted_float_compiles_its_unsharded_variant_lazily() -> None:
    """HCDecoder's norms read ``eps``, a Python float Dynamo lifts to a 0-d tensor input that the graph reads with
    ``.item()`` while it compiles: the lazy compile needs that input's value, not only its fake."""
    torch._dynamo.reset()
    model = HCDecoder(HCConfig.tiny(n_heads=12, n_kv_heads=12, intermediate=96), tp_rank=0, tp_size=2)
    be = hcpasses.backend(sp_min_tokens=MIN_TOKENS)
    compiled = torch.compile(model, backend=be, dynamic=True)
    with simulated_tp(2, 0), torch.no_grad():
        compiled(ids(32))
        got = compiled(ids(8))
        torch.testing.assert_close(got, model(ids(8)), rtol=1e-4, atol=1e-4)
    (dispatch,) = be.dispatchers
    assert dispatch.calls == {"sharded": 1, "unsharded": 1} and dispatch.unsharded.added == []
    assert [r.variant for r in be.reports] == ["sharded", "unsharded"]


def test_lazy_inputs_keep_no_activation_alive_but_keep_what_the_model_holds_and_tiny_tensors() -> None:
    activation, weight, lifted = torch.randn(8, 4), torch.nn.Parameter(torch.randn(4, 4)), torch.tensor(1e-6)
    fakes = ["fake activation", "fake weight", "fake lifted", None]
    inputs = LazyInputs([activation, weight, lifted, 7], fakes)
    released = weakref.ref(activation)
    del activation  # the first call is over: only the lazy inputs could still hold it
    assert released() is None
    got = inputs.get()
    assert got[0] == "fake activation" and got[1] is weight and got[2] is lifted and got[3] == 7


def tracing_context() -> tuple[torch._guards.TracingContext, torch.SymInt]:
    """A Dynamo-like context: a fake mode over a ShapeEnv holding one backed size symbol (hint 32)."""
    shape_env = ShapeEnv()
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=shape_env))
    tokens = shape_env.create_symintnode(shape_env.create_symbol(32, ConstantSource("tokens")), hint=32)
    return context, tokens


def sharded(*args: object) -> str:
    return "sharded"


def test_a_lazy_compile_runs_in_the_context_it_was_made_in_and_only_once() -> None:
    context, _ = tracing_context()
    contexts = []

    def compile_unsharded() -> object:
        contexts.append(torch._guards.TracingContext.try_get())
        return lambda *args: ("unsharded", args)

    variant = LazyVariant(compile_unsharded, sharded, context)
    assert contexts == [] and variant.compiled is None  # nothing compiled before the first call
    assert variant(1, 2) == ("unsharded", (1, 2)) and variant(3) == ("unsharded", (3,))
    assert contexts == [context] and variant.added == []
    assert torch._guards.TracingContext.try_get() is None  # the context is left again


@pytest.mark.parametrize(
    ("constrain", "added"),
    [
        (lambda tokens: bool(tokens >= 4), "{s} >= 4"),  # a guard
        (lambda tokens: bool(tokens == 32), "{s} -> 32"),  # a specialisation
        (lambda tokens: torch._check(tokens <= 1000), "{s} in VR[2, 1000]"),  # a narrowed range
    ],
)
def test_a_lazy_compile_that_adds_shape_constraints_gives_the_variant_up_for_the_sharded_graph(
    constrain, added: str, caplog: pytest.LogCaptureFixture
) -> None:
    context, tokens = tracing_context()
    symbol = str(tokens)  # before a specialisation prints it as its value

    def compile_unsharded() -> object:
        constrain(tokens)  # what a compile that specialises on T does to Dynamo's ShapeEnv
        return lambda *args: "unsharded"

    variant = LazyVariant(compile_unsharded, sharded, context)
    with caplog.at_level(logging.WARNING, logger="hcpasses"):
        assert variant() == "sharded" and variant() == "sharded"
    added = added.format(s=symbol)
    assert added in variant.added, variant.added
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hcpasses"]
    assert "no longer checks" in warning and added in warning and "lazy_variants=False" in warning

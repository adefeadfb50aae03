"""``lazy_variants``: a graph SP sharded with a symbolic T compiles its unsharded variant on the first call that
needs it (T < sp_min_tokens), inside the Dynamo context it was made in, without a recompile, with eager's values;
through real compiles (the backend's decisions and LazyVariant / LazyInputs alone: tests/unit/test_unit_backend.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from corpus.gated_residual import UserHC

import hcpasses
from hcpasses.backend import LazyVariant
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

"""Tests of the test harness: the virtual-rank simulator (against real gloo ranks) and the graph capture."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from hypothesis import given
from hypothesis import strategies as st

# build_hc_decoder imports these lazily; importing them here makes a broken ``models`` package (installed
# with this repo) fail this file at collection instead of silently skipping the HCDecoder test.
from hcpasses.testing.models import HCConfig, HCDecoder  # noqa: F401
from hcpasses.testing.multiproc import run_ranks
from tests.harness import (
    CaptureError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    capture_post_grad,
    capture_ranks,
    check_inputs,
    fake_process_group,
    simulate,
    simulate_captured,
)
from tests.harness.capture import RecordingPass
from tests.harness.simulator import collective_name, is_collective, reduce_in_rank_order
from tests.harness.toy import (
    D_MODEL,
    JobError,
    ToyMLP,
    build_hc_decoder,
    build_toy_mlp,
    build_toy_sp,
    dense_reference,
    eager_outputs,
)

# funcol.reduce_scatter_tensor / all_gather_tensor warn as deprecated in 2.13; their replacements
# (*_single) may be missing in 2.11, so the toys keep them.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

C10D = torch.ops._c10d_functional
# Registered by importing torch.distributed._functional_collectives (toy.py does).
AUTOGRAD = torch.ops._c10d_functional_autograd
TOKENS = 6  # divisible by 2 and 3 (reduce-scatter rows)
SEED = 3
HC_CONFIG: dict[str, Any] = {}  # HCConfig.tiny() as is


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded standard normal values (never all zeros)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _trace(fn: Callable[..., Any]) -> torch.fx.GraphModule:
    """An FX graph of ``fn`` (ops called as ``torch.ops.ns.op.default`` become call_function nodes)."""
    return torch.fx.symbolic_trace(fn)


def _run(fn: Callable[..., Any], inputs: list[list[Any]], **kwargs: Any) -> list[list[Any]]:
    """Simulate the same traced ``fn`` on every rank."""
    gm = _trace(fn)
    return simulate([gm] * len(inputs), inputs, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Simulator: collective semantics on hand-built graphs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_all_reduce_folds_in_rank_order(op: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return C10D.wait_tensor.default(C10D.all_reduce.default(x, op, "0"))

    xs = [_randn(4, 5, seed=r) for r in range(3)]
    outs = _run(fn, [[x] for x in xs])
    expected = {
        "sum": xs[0] + xs[1] + xs[2],
        "avg": (xs[0] + xs[1] + xs[2]) / 3,
        "product": xs[0] * xs[1] * xs[2],
    }
    expected["max"] = torch.maximum(torch.maximum(xs[0], xs[1]), xs[2])
    expected["min"] = torch.minimum(torch.minimum(xs[0], xs[1]), xs[2])
    for rank_out in outs:
        assert torch.equal(rank_out[0], expected[op])
    assert outs[0][0] is not outs[1][0]  # every rank owns its result


def test_sum_order_and_dtype_are_those_of_a_rank_order_fold() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return C10D.wait_tensor.default(C10D.all_reduce.default(x, "sum", "0"))

    # fp32: (1e8 + -1e8) + 1 = 1, while any order that adds 1 first loses it.
    outs = _run(fn, [[torch.tensor([1e8])], [torch.tensor([-1e8])], [torch.tensor([1.0])]])
    assert outs[2][0].item() == 1.0
    # bf16: each partial sum is rounded to bf16 (as gloo adds two bf16 buffers), not accumulated in fp32.
    xs = [_randn(4096, seed=10 + r, dtype=torch.bfloat16) for r in range(4)]
    got = _run(fn, [[x] for x in xs])[0][0]
    stepwise = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert got.dtype == torch.bfloat16 and torch.equal(got, stepwise)
    assert not torch.equal(got, sum(x.float() for x in xs).bfloat16())


def test_in_place_all_reduce_writes_its_input() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        C10D.all_reduce_.default(y, "sum", "0")
        return y + 0

    xs = [_randn(3, seed=r) for r in range(2)]
    outs = _run(fn, [[x] for x in xs])
    assert torch.equal(outs[0][0], xs[0] + xs[1]) and torch.equal(outs[1][0], xs[0] + xs[1])


def test_reduce_scatter_all_gather_broadcast_all_to_all() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rs = C10D.wait_tensor.default(C10D.reduce_scatter_tensor.default(x, "sum", 3, "0"))
        ag = C10D.wait_tensor.default(C10D.all_gather_into_tensor.default(rs, 3, "0"))
        bc = C10D.wait_tensor.default(C10D.broadcast.default(x, 2, "0"))
        a2a = C10D.wait_tensor.default(C10D.all_to_all_single.default(x, [], [], "0"))
        ag_autograd = C10D.wait_tensor.default(AUTOGRAD.all_gather_into_tensor.default(rs, 3, "0"))
        return rs, ag, bc, a2a, ag_autograd

    xs = [_randn(6, 2, seed=r) for r in range(3)]
    outs = _run(fn, [[x] for x in xs])
    total = xs[0] + xs[1] + xs[2]
    for rank, (rs, ag, bc, a2a, ag_autograd) in enumerate(outs):
        assert torch.equal(rs, total[2 * rank : 2 * rank + 2])
        assert torch.equal(ag, total) and torch.equal(ag_autograd, total)
        assert torch.equal(bc, xs[2])
        assert torch.equal(a2a, torch.cat([x[2 * rank : 2 * rank + 2] for x in xs]))


def test_all_to_all_with_uneven_splits() -> None:
    sends = [[1, 2], [3, 1]]  # sends[r][d]: rows rank r sends to rank d
    recvs = [[sends[s][r] for s in range(2)] for r in range(2)]

    def make(send: list[int], recv: list[int]) -> torch.fx.GraphModule:
        def fn(x: torch.Tensor) -> torch.Tensor:
            return C10D.wait_tensor.default(C10D.all_to_all_single.default(x, recv, send, "0"))

        return _trace(fn)

    xs = [_randn(sum(sends[r]), 2, seed=r) for r in range(2)]
    outs = simulate([make(sends[r], recvs[r]) for r in range(2)], [[x] for x in xs])
    assert torch.equal(outs[0][0], torch.cat([xs[0][:1], xs[1][:3]]))
    assert torch.equal(outs[1][0], torch.cat([xs[0][1:], xs[1][3:]]))
    with pytest.raises(CollectiveMismatchError, match="expects output splits"):
        simulate([make(sends[0], [2, 2]), make(sends[1], recvs[1])], [[x] for x in xs])


def test_coalesced_all_reduce() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pair = C10D.all_reduce_coalesced.default([x, y], "max", "0")
        return C10D.wait_tensor.default(pair[0]), C10D.wait_tensor.default(pair[1])

    xs, ys = [_randn(3, 2, seed=r) for r in range(2)], [_randn(4, seed=5 + r) for r in range(2)]
    for x_out, y_out in _run(fn, [[xs[0], ys[0]], [xs[1], ys[1]]]):
        assert torch.equal(x_out, torch.maximum(*xs)) and torch.equal(y_out, torch.maximum(*ys))


@given(
    tp=st.integers(1, 4),
    rows_per_rank=st.integers(1, 3),
    cols=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_reduce_scatter_then_all_gather_is_all_reduce(tp: int, rows_per_rank: int, cols: int, seed: int):
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rs = C10D.wait_tensor.default(C10D.reduce_scatter_tensor.default(x, "sum", tp, "0"))
        ag = C10D.wait_tensor.default(C10D.all_gather_into_tensor.default(rs, tp, "0"))
        ar = C10D.wait_tensor.default(C10D.all_reduce.default(x, "sum", "0"))
        return ag, ar

    xs = [_randn(tp * rows_per_rank, cols, seed=seed + r) for r in range(tp)]
    for ag, ar in _run(fn, [[x] for x in xs]):
        assert torch.equal(ag, ar)
        assert torch.equal(ar, reduce_in_rank_order(xs, "sum"))


# ---------------------------------------------------------------------------------------------------------
# Simulator: error paths
# ---------------------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    return C10D.wait_tensor.default(C10D.all_reduce.default(x, "sum", "0"))


def _all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    return C10D.wait_tensor.default(C10D.all_reduce.default(x, "max", "0"))


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    return C10D.wait_tensor.default(C10D.all_gather_into_tensor.default(x, 2, "0"))


def _no_collective(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(
    ("fns", "shapes", "match"),
    [
        ((_all_reduce, _all_gather), ((4,), (4,)), r"(?s)different collectives.*all_reduce.*all_gather_into"),
        ((_all_reduce, _all_reduce_max), ((4,), (4,)), r"(?s)different collectives.*'sum'.*'max'"),
        ((_all_reduce, _all_reduce), ((4,), (5,)), r"(?s)different shapes.*\[5\]\) at node 'all_reduce"),
        ((_all_gather, _all_gather, _all_gather), ((4,), (4,), (4,)), "group_size 2 != tp 3"),
    ],
)
def test_mismatched_collectives_raise(fns: tuple, shapes: tuple, match: str) -> None:
    graphs = [_trace(fn) for fn in fns]
    inputs = [[torch.ones(shape)] for shape in shapes]
    with pytest.raises(CollectiveMismatchError, match=match):
        simulate(graphs, inputs, timeout_s=10)


def test_rank_that_skips_a_collective_raises_timeout_at_once() -> None:
    start = time.monotonic()
    graphs = [_trace(_all_reduce), _trace(_no_collective)]
    with pytest.raises(CollectiveTimeoutError, match=r"joined by ranks \[0\] but never by \[1\].*finished"):
        simulate(graphs, [[torch.ones(2)], [torch.ones(2)]], timeout_s=30)
    assert time.monotonic() - start < 5  # detected when rank 1 returned, not at the deadline


def _sleepy(x: torch.Tensor) -> torch.Tensor:
    time.sleep(3)
    return x


torch.fx.wrap("_sleepy")


def test_rank_stuck_before_a_collective_raises_timeout_within_the_timeout() -> None:
    def stuck(x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(_sleepy(x))

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"not done after 0\.5 s"):
        simulate([_trace(_all_reduce), _trace(stuck)], [[torch.ones(2)], [torch.ones(2)]], timeout_s=0.5)
    assert time.monotonic() - start < 2.5


def _raises(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom on this rank")


torch.fx.wrap("_raises")


def test_error_on_one_rank_is_raised_and_releases_the_others() -> None:
    def bad(x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(_raises(x))

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on this rank") as info:
        simulate([_trace(_all_reduce), _trace(bad)], [[torch.ones(2)], [torch.ones(2)]], timeout_s=30)
    if sys.version_info >= (3, 11):  # exception notes
        assert any("virtual rank 1" in note for note in info.value.__notes__)
    assert time.monotonic() - start < 5


def _unknown_collectives() -> list[Any]:
    """Collective ops the simulator does not handle: legacy c10d ops, and p2p ops where torch has them."""
    targets = [torch.ops.c10d.allreduce_.default, torch.ops.c10d.barrier.default]
    for name in ("isend", "batch_p2p_ops"):
        if hasattr(torch.ops._c10d_functional, name):
            targets.append(getattr(torch.ops._c10d_functional, name).default)
    return targets


@pytest.mark.parametrize("target", _unknown_collectives(), ids=str)
def test_unknown_collective_raises_not_implemented(target: Any) -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, (x,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(NotImplementedError, match=collective_name(target) or "?"):
        simulate([gm, gm], [[torch.ones(1)], [torch.ones(1)]])


def test_unknown_reduce_op_raises_not_implemented() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return C10D.wait_tensor.default(C10D.all_reduce.default(x, "premul_sum", "0"))

    with pytest.raises(NotImplementedError, match="premul_sum"):
        _run(fn, [[torch.ones(1)], [torch.ones(1)]])


# ---------------------------------------------------------------------------------------------------------
# Internal torch APIs the harness relies on (pinned here)
# ---------------------------------------------------------------------------------------------------------


def test_internal_op_types_pinned() -> None:
    """simulator.collective_name relies on torch._ops.OpOverload(.name()) / OpOverloadPacket."""
    assert isinstance(C10D.all_reduce.default, torch._ops.OpOverload)
    assert isinstance(C10D.all_reduce, torch._ops.OpOverloadPacket)
    assert collective_name(C10D.all_reduce.default) == "_c10d_functional::all_reduce"
    assert collective_name(C10D.all_reduce) == "_c10d_functional::all_reduce"


def test_fake_process_group_pinned() -> None:
    """FakeStore (torch.testing._internal.distributed.fake_pg) and the "fake" backend, torn down on error."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert issubclass(FakeStore, dist.Store)
    with pytest.raises(RuntimeError, match="inside"):
        with fake_process_group(2, 3):
            assert (dist.get_rank(), dist.get_world_size()) == (2, 3)
            assert dist.get_backend() == "fake"
            raise RuntimeError("inside")
    assert not dist.is_initialized()


def test_inductor_custom_pass_api_pinned() -> None:
    """CustomGraphPass is abstract in __call__ and uuid; our recorder passes Inductor's isinstance check."""
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    recorder = RecordingPass()
    assert isinstance(recorder, CustomGraphPass) and recorder.uuid() != RecordingPass().uuid()
    for key in ("post_grad_custom_pre_pass", "fx_graph_cache"):
        assert hasattr(inductor_config, key)


# ---------------------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------------------


def _targets(captured: Any) -> set[str]:
    return {str(t) for t in captured.targets()}


def test_capture_tp1_contains_collectives_and_matches_eager() -> None:
    x = _randn(TOKENS, D_MODEL, seed=1)
    mlp = capture_post_grad(ToyMLP(0, 1, SEED), (x,), fake_pg=True)
    sp = capture_post_grad(build_toy_sp(0, 1, SEED), (x,), fake_pg=True)
    assert len(mlp) == 1 and len(sp) == 1
    assert {"_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"} <= _targets(mlp[0])
    assert {
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_gather_into_tensor.default",
    } <= _targets(sp[0])
    with torch.no_grad():
        eager = ToyMLP(0, 1, SEED)(x)  # no group: no all-reduce, the same function at tp=1
    torch.testing.assert_close(simulate([mlp[0].gm], [mlp[0].inputs])[0][0], eager)
    torch.testing.assert_close(simulate([sp[0].gm], [sp[0].inputs])[0][0], dense_reference(x, SEED)["sp"])


def test_capture_keeps_meta_and_reruns_the_pass_every_compile() -> None:
    x = _randn(TOKENS, D_MODEL, seed=2)
    model = ToyMLP(0, 1, SEED)
    first = capture_post_grad(model, (x,))
    second = capture_post_grad(model, (x,))  # same code again: no cache may skip the recording pass
    assert len(first) == len(second) == 1
    captured = second[0]
    for node in captured.gm.graph.nodes:
        if node.op != "output":
            assert isinstance(node.meta.get("val"), torch.Tensor), node.format_node()
    vals = [p.meta["val"] for p in captured.placeholders()]
    assert [v.shape for v in vals] == [v.shape for v in captured.inputs]
    assert any(torch.equal(v, x) for v in captured.inputs)


def test_capture_runs_a_given_post_grad_pass_before_recording() -> None:
    class Tagger(RecordingPass):  # any CustomGraphPass; this one tags nodes
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                node.meta["tagged"] = True

    x = _randn(TOKENS, D_MODEL, seed=4)
    patches = {"post_grad_custom_pre_pass": Tagger()}
    captured = capture_post_grad(ToyMLP(0, 1, SEED), (x,), config_patches=patches)
    assert all(node.meta.get("tagged") for node in captured[0].gm.graph.nodes)


def test_check_inputs_rejects_inputs_that_do_not_fit() -> None:
    captured = capture_post_grad(ToyMLP(0, 1, SEED), (_randn(TOKENS, D_MODEL, seed=5),))[0]
    good = captured.inputs
    check_inputs(captured.gm, good)
    with pytest.raises(CaptureError, match="runtime inputs for"):
        check_inputs(captured.gm, good[:-1])
    for i in range(len(good)):
        wrong_shape = [*good[:i], torch.ones(7, 7), *good[i + 1 :]]
        with pytest.raises(CaptureError, match="shape"):
            check_inputs(captured.gm, wrong_shape)
    with pytest.raises(CaptureError, match="dtype"):
        check_inputs(captured.gm, [good[0].double(), *good[1:]])
    with pytest.raises(CaptureError, match="expected a tensor"):
        check_inputs(captured.gm, [3, *good[1:]])


def test_capture_tears_the_group_down_on_error() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)  # shape error at run time

    with pytest.raises(Exception, match=r"shape|size|mat"):
        capture_post_grad(broken, (torch.ones(2, 2),), tp=2, rank=1)
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------------
# Simulator against real gloo ranks
# ---------------------------------------------------------------------------------------------------------


def _toy_input() -> torch.Tensor:
    return _randn(TOKENS, D_MODEL, seed=7)


def _hc_input() -> torch.Tensor:
    return torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(8))


BUILDERS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "mlp": functools.partial(build_toy_mlp, seed=SEED),
    "sp": functools.partial(build_toy_sp, seed=SEED),
    "hc": functools.partial(build_hc_decoder, **HC_CONFIG),
}


@functools.cache
def _gloo_reference(tp: int) -> list[dict[str, Any]]:
    """Eager outputs of every model on real gloo ranks (one launch per tp: starting processes is slow)."""
    jobs = [(name, BUILDERS[name], (_toy_input(),)) for name in ("mlp", "sp")]
    if tp == 2:
        jobs.append(("hc", BUILDERS["hc"], (_hc_input(),)))
    return run_ranks(eager_outputs, tp, jobs, timeout_s=180)


def _simulated(name: str, tp: int, x: torch.Tensor) -> list[list[Any]]:
    """Capture model ``name`` on every rank of ``tp`` (one graph each, with collectives) and simulate it."""
    per_rank = capture_ranks(BUILDERS[name], lambda rank, tp: (x,), tp)
    assert all(len(graphs) == 1 for graphs in per_rank)
    for graphs in per_rank:
        assert any(is_collective(t) for t in graphs[0].targets())
    return simulate_captured([graphs[0] for graphs in per_rank])


def _reference_output(reference: list[dict[str, Any]], rank: int, name: str) -> torch.Tensor:
    """Rank ``rank``'s eager gloo output of ``name``; fail with the rank's traceback if it raised."""
    value = reference[rank][name]
    if isinstance(value, JobError):
        pytest.fail(f"eager {name} raised on gloo rank {rank}:\n{value}")
    return value


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "sp"])
def test_simulator_matches_gloo(name: str, tp: int) -> None:
    reference = _gloo_reference(tp)
    simulated = _simulated(name, tp, _toy_input())
    for rank in range(tp):
        got, want = simulated[rank][0], _reference_output(reference, rank, name)
        if name == "mlp" and tp == 2:
            assert torch.equal(got, want)  # same kernels, and a sum of two commutes: bit-exact
        else:
            # tp=3: gloo's ring adds in a per-segment order; sp: Inductor decomposes silu
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got, simulated[0][0])
    torch.testing.assert_close(simulated[0][0], dense_reference(_toy_input(), SEED)[name])


def test_dynamic_shapes_two_token_counts() -> None:
    xs = [_randn(tokens, D_MODEL, seed=tokens) for tokens in (6, 10)]
    per_rank = capture_ranks(
        BUILDERS["sp"], lambda rank, tp: (xs[0],), 2, extra_args_fn=lambda rank, tp: [(xs[1],)], dynamic=True
    )
    assert [len(graphs) for graphs in per_rank] == [1, 1]  # no recompile for the second T
    captures = [graphs[0] for graphs in per_rank]
    symbolic = [p for p in captures[0].placeholders() if isinstance(p.meta.get("val"), torch.SymInt)]
    assert symbolic, "a dynamic capture has SymInt placeholders"
    for call, x in enumerate(xs):
        ints = [v for v in captures[0].calls[call] if isinstance(v, int)]
        assert x.shape[0] in ints  # the token count is passed as an int
        outs = simulate_captured(captures, call=call)
        torch.testing.assert_close(outs[0][0], dense_reference(x, SEED)["sp"])
        assert torch.equal(outs[0][0], outs[1][0])


def test_hc_decoder_tp2_simulated_matches_gloo() -> None:
    reference = _gloo_reference(2)
    simulated = _simulated("hc", 2, _hc_input())
    for rank in range(2):
        assert simulated[rank][0].shape == (TOKENS, 64)
        want = _reference_output(reference, rank, "hc")
        torch.testing.assert_close(simulated[rank][0], want, rtol=1e-5, atol=1e-5)

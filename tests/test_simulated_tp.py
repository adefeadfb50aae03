"""``benchmarks/simulated_tp.py``: one process plays rank r of N; the stand-in collectives give real values
eagerly and inside Inductor's generated code, hcpasses sees the group, and the communication model's arithmetic."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from corpus.gated_residual import UserHC

import hcpasses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulated_tp import (
    DISPATCH_KEYS,
    NVLINK_GBPS_PER_DIRECTION,
    STANDIN_RANGE,
    CollectiveCall,
    CommModel,
    simulated_collectives,
    simulated_tp,
    standin_ms,
)

c10d = torch.ops._c10d_functional
OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor", "reduce_scatter_tensor_out")
OPS += ("all_reduce", "all_reduce_", "wait_tensor")


def backend_kernels() -> dict[tuple[str, str], bool]:
    return {
        (op, key): torch._C._dispatch_has_kernel_for_dispatch_key(f"_c10d_functional::{op}", key)
        for op in OPS
        for key in DISPATCH_KEYS
    }


def test_stand_ins_are_backend_kernels_that_the_context_removes() -> None:
    """Internal behaviour pinned: torch registers these ops for CompositeExplicitAutograd only, so the CPU and
    CUDA keys start empty, the library fills them, and destroying the library empties them again."""
    assert not any(backend_kernels().values())
    with simulated_collectives(rank=0):
        assert all(backend_kernels().values())
    assert not any(backend_kernels().values())


def collectives(x: torch.Tensor, tp: int) -> tuple[torch.Tensor, ...]:
    """Every stand-in once: gather, scatter of twice the gather, all-reduce (functional and in place)."""
    group = dist.group.WORLD.group_name
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, tp, group))
    scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(gathered * 2, "sum", tp, group))
    reduced = c10d.wait_tensor(c10d.all_reduce(scattered + 1, "sum", group))
    return gathered, scattered, reduced * 3


def check_values(x: torch.Tensor, tp: int, outputs: tuple[torch.Tensor, ...]) -> None:
    gathered, scattered, reduced = outputs
    assert gathered.shape == (tp * x.shape[0], *x.shape[1:])
    assert all(torch.equal(block, x) for block in gathered.split(x.shape[0]))
    torch.testing.assert_close(scattered, 2 * x)  # this rank's block of 2 * [x; x; ...]
    torch.testing.assert_close(reduced, (2 * x + 1) * 3)


@pytest.mark.parametrize(("tp", "rank"), [(2, 1), (4, 2)])
def test_stand_ins_eager(tp: int, rank: int) -> None:
    x = torch.randn(3, 5)
    with simulated_tp(tp, rank) as ledger:
        check_values(x, tp, collectives(x, tp))
        group = dist.group.WORLD.group_name
        out = torch.empty(tp * 3, 5)
        assert c10d.all_gather_into_tensor_out(x, tp, group, out=out) is out
        assert torch.equal(out[3 * rank : 3 * rank + 3], x)
        blocks = torch.randn(tp * 3, 5)
        scattered = torch.empty(3, 5)
        c10d.reduce_scatter_tensor_out(blocks, "sum", tp, group, out=scattered)
        assert torch.equal(scattered, blocks[3 * rank : 3 * rank + 3])
        inplace = x.clone()
        assert c10d.all_reduce_(inplace, "sum", group) is inplace and torch.equal(inplace, x)
    kinds = [call.kind for call in ledger.calls]
    assert kinds == ["all_gather", "reduce_scatter", "all_reduce", "all_gather", "reduce_scatter", "all_reduce"]
    assert {call.group_size for call in ledger.calls} == {tp}
    assert ledger.calls[0].full_bytes == tp * 3 * 5 * 4 and ledger.calls[2].full_bytes == 3 * 5 * 4


def test_stand_ins_inside_inductor_code() -> None:
    """Inductor lowers all_reduce to a clone + the in-place all_reduce_ extern kernel and calls the gather and
    the scatter as extern kernels: the values and the ledger show the stand-ins ran in the generated code."""
    torch._dynamo.reset()
    x, tp = torch.randn(3, 5), 4
    with simulated_tp(tp, rank=3) as ledger:
        check_values(x, tp, torch.compile(collectives, backend="inductor")(x, tp))
    assert ledger.counts() == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}


def test_stand_ins_run_in_profiler_ranges_that_standin_ms_sums() -> None:
    """Each stand-in (not the wait) runs in its ``simulated_tp::`` range, also from Inductor's code, and
    ``standin_ms`` sums exactly those ranges: a profile of compute alone has none."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    x, tp = torch.randn(256, 512), 4
    compiled = torch.compile(collectives, backend="inductor")
    with simulated_tp(tp, rank=1):
        compiled(x, tp)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x, tp)
        with profile(activities=[ProfilerActivity.CPU]) as compute_only:
            torch.mm(x, x.T)
    ranges = [event for event in prof.events() if event.name.startswith(STANDIN_RANGE)]
    names = sorted(event.name.removeprefix(STANDIN_RANGE) for event in ranges)
    assert names == ["all_gather_into_tensor", "all_reduce_", "reduce_scatter_tensor"], names
    inside = sum(e.cpu_time_total - e.self_cpu_time_total for e in ranges) / 1e3  # the ops in them, not their Python
    assert standin_ms(prof.events(), on_gpu=False) == pytest.approx(inside)
    assert standin_ms(prof.events(), on_gpu=False) > 0
    # no more than the ops' self time of the profile (the CPU's kernel time): compute = the rest is never negative
    ops = [e for e in prof.events() if not e.name.startswith(STANDIN_RANGE)]
    assert standin_ms(prof.events(), on_gpu=False) <= sum(e.self_cpu_time_total for e in ops) / 1e3
    assert standin_ms(compute_only.events(), on_gpu=False) == 0


def test_hcpasses_sees_a_group_of_size_n_and_rank_r() -> None:
    """The SP pass fires at tp 4, and the sharded graph computes rank 2's rows: with the stand-ins each of the
    final gather's tp blocks is rank 2's block of the unsharded (eager) result."""
    torch._dynamo.reset()
    tp, rank, tokens = 4, 2, 8
    rows = tokens // tp
    model = UserHC(layers=1, tp=tp, rank=rank)
    ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(1))
    be = hcpasses.backend(sp_min_tokens=1)
    with simulated_tp(tp, rank) as ledger, torch.no_grad():
        assert (dist.get_world_size(), dist.get_rank()) == (tp, rank)
        reference = model(ids)
        ledger.clear()
        sharded = torch.compile(model, backend=be)(ids)
    assert [r.record("sp_rewrite").applied for r in be.reports] == [3]  # both HC blocks and the final mixer
    assert ledger.counts()["reduce_scatter"] == 2 and "all_reduce" not in ledger.counts()
    assert {call.group_size for call in ledger.calls} == {tp}
    mine = reference[rank * rows : (rank + 1) * rows]
    for block in sharded.split(rows):
        torch.testing.assert_close(block, mine, rtol=1e-4, atol=1e-5)


def test_a_token_count_the_sharded_compile_fixes_below_the_threshold_runs_unsharded(caplog) -> None:
    """Dynamic T at tp 2: the sharded graph's guards exclude one row per rank, so T = 2 recompiles, and compiling
    that graph's sharded variant fixes T to 2 (``Eq(s0, 2)``) after the SP pass saw it symbolic. The graph must run
    unsharded (2 < sp_min_tokens): its all-reduce runs, no reduce-scatter, eager's values, and no warning (it used
    to log "cannot find the token count" and run sharded)."""
    torch._dynamo.reset()
    model = UserHC(layers=1, tp=2, rank=0)
    be = hcpasses.backend(sp_min_tokens=16)
    compiled = torch.compile(model, backend=be, dynamic=True)
    with simulated_tp(2, 0) as ledger, torch.no_grad(), caplog.at_level(logging.INFO, logger="hcpasses"):
        for tokens in (32, 2):
            ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))
            ledger.clear()
            got = compiled(ids)
        counts = ledger.counts()
        torch.testing.assert_close(got, model(ids), rtol=1e-5, atol=1e-5)
    assert counts == {"all_reduce": 2}, counts
    assert [r.variant for r in be.reports[-2:]] == ["sharded", "unsharded"]
    assert be.reports[-2].record("sp_rewrite").applied == 3 and be.dispatchers[-1].calls == {
        "sharded": 1,
        "unsharded": 0,
    }
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("fixed the token count" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_symbolic_token_count_compiles_once_for_even_and_ragged_counts(rank: int) -> None:
    """Pins what the SP rewrite's shard relies on in Inductor (torch 2.11 and 2.13): it lowers the slice of the
    rows zero-padded to R*tp with no guard on T. Rank 0 and the last rank (whose block holds the pad rows at an odd
    T) of tp 2 each compile one graph for T = 13, 14, 29 and 64 and run its sharded variant every time. A slice of
    the unpadded rows, whose end Inductor must clamp to T, added a guard: a second graph."""
    torch._dynamo.reset()
    model = UserHC(layers=1, tp=2, rank=rank)
    be = hcpasses.backend(sp_min_tokens=8)
    compiled = torch.compile(model, backend=be, dynamic=True)
    with simulated_tp(2, rank) as ledger, torch.no_grad():
        for tokens in (13, 14, 29, 64):
            compiled(torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens)))
        counts = ledger.counts()
    assert [r.variant for r in be.reports] == ["sharded"], [str(r) for r in be.reports]
    assert be.reports[0].record("sp_rewrite").status == "applied"
    assert be.dispatchers[0].calls == {"sharded": 4, "unsharded": 0}
    assert "all_reduce" not in counts and counts["reduce_scatter"] == 4 * 2, counts


def test_tp1_sets_up_nothing_and_ranks_are_checked() -> None:
    with simulated_tp(1) as ledger:
        assert not dist.is_initialized() and ledger.calls == []
    with pytest.raises(ValueError, match="rank 2"), simulated_tp(2, 2):
        pass
    assert not dist.is_initialized()


def test_comm_model_ring_arithmetic() -> None:
    mib = 1 << 20
    model = CommModel(link_gbps=100.0)
    all_reduce, all_gather = CollectiveCall("all_reduce", 8 * mib, 4), CollectiveCall("all_gather", 8 * mib, 4)
    reduce_scatter = CollectiveCall("reduce_scatter", 8 * mib, 4)
    assert model.wire_bytes(all_reduce) == 2 * 3 / 4 * 8 * mib
    assert model.wire_bytes(all_gather) == model.wire_bytes(reduce_scatter) == 3 / 4 * 8 * mib
    # A ring all-reduce moves the bytes of a reduce-scatter plus an all-gather of the same tensor.
    assert model.ms([all_reduce]) == pytest.approx(model.ms([reduce_scatter, all_gather]))
    assert model.call_ms(all_reduce) == pytest.approx(1.5 * 8 * mib / 100e9 * 1e3)
    assert model.call_ms(CollectiveCall("all_reduce", 8 * mib, 1)) == 0.0
    assert CommModel(link_gbps=100.0, latency_us=10.0).call_ms(all_gather) == pytest.approx(
        model.call_ms(all_gather) + 0.01
    )
    estimate = model.estimate(2.0, [all_reduce])
    assert estimate["serial_ms"] == pytest.approx(2.0 + estimate["comm_ms"])
    assert estimate["overlap_ms"] == max(2.0, estimate["comm_ms"])
    assert NVLINK_GBPS_PER_DIRECTION == 450.0  # H200 NVLink 4: 900 GB/s bidirectional per GPU

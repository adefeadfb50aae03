"""The blocked-scans pass (``hcpasses/passes/blocked_scans.py``): a long cummax / cummin whose indices nothing reads
becomes a two-level blocked scan with exactly the values of the one scan, on CUDA, where Inductor would otherwise
run it as ATen's kernel; every case the docstring says it bails out of leaves the graph as it was and says why.

The rewrite itself is checked on CPU (its ops run on any device): property tests against eager, bit for bit, with
ties, NaN and +-inf. The pass's decisions are checked on fake CUDA graphs (FakeTensor
needs no GPU); on the GPU the tests at the end pin Inductor's behaviour the pass relies on.
"""

from __future__ import annotations

import json
import operator
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from hypothesis import example, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import hcpasses
from hcpasses.config import HCPassesConfig
from hcpasses.passes import blocked_scans
from hcpasses.passes.blocked_scans import BlockedScans, block_scan, inductor_block, inductor_may_split

ROOT = Path(__file__).resolve().parents[1]
aten = torch.ops.aten
SCAN_OPS = (aten.cummax.default, aten.cummin.default)
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16)


def values_of(kind: str, dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    scan = torch.cummax if kind == "max" else torch.cummin
    return lambda x: scan(x, dim).values * 2  # a user of the values, as in a model


def scans_in(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if node.target in SCAN_OPS]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere); floats also get NaN, +inf and -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 6, shape, generator=gen)
    if not dtype.is_floating_point:
        return x.to(dtype)
    x = x.to(dtype) / 4
    special = torch.rand(shape, generator=gen)
    x[special < 0.01] = float("nan")
    x[(special >= 0.01) & (special < 0.02)] = float("inf")
    x[(special >= 0.02) & (special < 0.03)] = float("-inf")
    return x


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def every_level(block: int) -> Callable[[int, int], int | None]:
    """A block choice that blocks every level longer than ``block``."""
    return lambda length, rows: block if length > block else None


def levels(*blocks: int) -> Callable[[int, int], int | None]:
    """A block choice that gives ``blocks`` to the levels in turn, then scans the rest as it is."""
    queue = list(blocks)
    return lambda length, rows: queue.pop(0) if queue else None


def heuristic_of_an_h200(device: torch.device, length: int, rows: int, inner_reduction: bool) -> int:
    """``InductorChoices.reduction_split_factor`` on an H200 (132 SMs, before sm100) for the sizes these tests ask,
    in short: an inner reduction splits rows of more than 8192 elements when there are fewer than 264 rows; an outer
    one (below 8.6M elements in all) splits every 128 elements."""
    if inner_reduction:
        return 1 if rows >= 264 or length <= 8192 else 2
    return -(-length // 128)


# The quick profile draws two examples: these pin what each must cover (cummin of floats and ints, a scan along a
# middle dim of 3, dim -1 of a 1-d tensor), whatever it draws.
@example(rank_dim=(3, 1), length=700, block=64, dtype=torch.float32, kind="min", seed=1)
@example(rank_dim=(2, 0), length=37, block=2, dtype=torch.int32, kind="max", seed=2)
@example(rank_dim=(1, -1), length=50, block=16, dtype=torch.int16, kind="min", seed=3)
@given(
    rank_dim=st.sampled_from([(1, 0), (1, -1), (2, 1), (2, 0), (3, 1), (3, 2), (3, -1)]),
    length=st.integers(1, 700),
    block=st.sampled_from([2, 3, 16, 64]),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["max", "min"]),
    seed=st.integers(0, 2**16),
)
def test_the_blocked_scan_has_exactly_the_values_of_the_scan(
    rank_dim: tuple[int, int], length: int, block: int, dtype: torch.dtype, kind: str, seed: int
) -> None:
    rank, dim = rank_dim
    shape = [2, 3, 2][:rank]
    shape[dim] = length
    fn = values_of(kind, dim)
    x = sample(tuple(shape), dtype, seed)
    gm = make_fx(fn)(x)
    (scan,) = scans_in(gm.graph)
    _, blocks = block_scan(gm.graph, scan, every_level(block))
    gm.graph.lint()
    gm.recompile()
    expected, rest = [], length
    while rest > block:  # each level's carry is a scan of its blocks' last values, blocked in turn
        expected, rest = [*expected, block], -(-rest // block)
    assert blocks == expected
    assert len(scans_in(gm.graph)) == len(blocks) + 1, gm.code  # each level's blocks, and the last carry
    assert_same(gm(x), fn(x))


@pytest.mark.parametrize("block", [1, 300])
def test_a_block_of_one_element_or_of_the_whole_row_is_refused(block: int) -> None:
    gm = make_fx(values_of("max", 1))(torch.randn(2, 300))
    with pytest.raises(ValueError, match=f"a block of {block} elements cannot block a scan of 300"):
        block_scan(gm.graph, scans_in(gm.graph)[0], levels(block))


def test_a_scan_of_exactly_whole_blocks_and_one_with_a_last_block_of_one_element_match() -> None:
    for length in (2 * 64, 3 * 64, 65):
        x = sample((2, length), torch.float32, length)
        gm = make_fx(values_of("max", 1))(x)
        assert block_scan(gm.graph, scans_in(gm.graph)[0], levels(64))[1] == [64]
        gm.recompile()
        assert_same(gm(x), values_of("max", 1)(x))


def test_a_scan_whose_dim_is_a_keyword_is_blocked_along_that_dim() -> None:
    x = sample((3, 200), torch.float32, 4)
    gm = make_fx(values_of("max", 1))(x)
    (scan,) = scans_in(gm.graph)
    scan.args, scan.kwargs = scan.args[:1], {"dim": scan.args[1]}  # cummax(x, dim=1), as a hand-built graph has it
    block_scan(gm.graph, scan, levels(16))
    gm.recompile()
    assert_same(gm(x), values_of("max", 1)(x))


def fake_cuda_graph(fn: Callable[..., torch.Tensor], *shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> fx.Graph:
    """``fn`` traced on fake CUDA tensors (no GPU needed), as the pass sees a CUDA graph."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes_dtypes]
        return make_fx(fn)(*args).graph


def run_pass(graph: fx.Graph) -> hcpasses.graph_pass.PassResult:
    return BlockedScans().run(graph, HCPassesConfig())


def as_on_an_h200(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Inductor's split heuristic answers as on an H200; the (length, rows, inner) it is asked, in order (each asked
    for the scan's own device, with int sizes, as Inductor's heuristic needs)."""
    from torch._inductor.choices import InductorChoices

    asked = []

    def factor(device: torch.device, length: int, rows: int, inner_reduction: bool) -> int:
        assert device == torch.device("cuda", 0) and type(length) is int and type(rows) is int, (device, length, rows)
        asked.append((length, rows, inner_reduction))
        return heuristic_of_an_h200(device, length, rows, inner_reduction)

    monkeypatch.setattr(InductorChoices, "reduction_split_factor", staticmethod(factor))
    return asked


def test_a_long_cuda_scan_inductor_would_split_is_blocked_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen4_exp's scan at T = 16384 (the ids and their 2-id history): blocks of 1024 would be 17 rows, which an outer
    reduction splits 8 ways; 129 rows of 128 split neither way, and their carry is one row of 129."""
    asked = as_on_an_h200(monkeypatch)
    graph = fake_cuda_graph(values_of("max", 1), ((1, 16386), torch.int64))
    result = run_pass(graph)
    assert result.applied == 1 and result.reason is None, result
    assert asked[0] == (16386, 1, True)  # one row: the inner heuristic alone
    assert len(scans_in(graph)) == 2
    assert result.notes == (f"cummax: 16386 elements scanned in blocks of 128 -> {_values_name(graph)}",)
    (inner,) = [node for node in scans_in(graph) if node.args[0].target is aten.reshape.default]
    assert value_shape(inner.args[0]) == (1, 129, 128)


def value_shape(node: fx.Node) -> tuple[int, ...]:
    """The shape a reshape made (the pass adds no fake values to its nodes: the manager propagates them)."""
    return tuple(node.args[1])


@pytest.mark.parametrize(("length", "blocks"), [(20000, "128"), ((1 << 20) + 3, "128 then 128")])
def test_a_long_scan_of_a_1d_tensor_is_blocked_and_so_is_a_carry_inductor_would_split(
    length: int, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2**20 + 3 elements make 8193 blocks of 128: a carry of one row longer than 8192, which Inductor splits, so it is
    blocked in turn (65 blocks of 128, whose carry is short)."""
    asked = as_on_an_h200(monkeypatch)
    x = sample((length,), torch.float32, 5)
    graph = fake_cuda_graph(values_of("min", 0), ((length,), torch.float32))
    result = run_pass(graph)
    note = f"cummin: {length} elements scanned in blocks of {blocks} -> {_values_name(graph)}"
    assert result.applied == 1 and result.notes == (note,), result
    assert asked[0] == (length, 1, True)  # one row: no other dims
    assert len(scans_in(graph)) == blocks.count("128") + 1
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert_same(gm(x), values_of("min", 0)(x))  # the ops run on CPU too


def test_inductor_may_split_asks_both_of_inductors_heuristics_for_several_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate is Inductor's split heuristic, asked for the scan's device, length and rows: the inner reduction's,
    and for more than one row the outer one's too (Inductor picks between them by the strides of what the scan reads,
    which the pass cannot see). An internal API: its signature here, its answers on CUDA in the GPU tests below."""
    from torch._inductor.choices import InductorChoices

    cpu = torch.device("cpu")
    assert inductor_may_split(cpu, 1 << 20, 1) and not inductor_may_split(cpu, 64, 1)
    asked = []

    def factor(device: torch.device, length: int, rows: int, inner_reduction: bool) -> int:
        asked.append((device, length, rows, inner_reduction))
        return 2 if length > (5000 if inner_reduction else 500) else 1

    monkeypatch.setattr(InductorChoices, "reduction_split_factor", staticmethod(factor))
    device = torch.device("cuda", 1)
    assert inductor_may_split(device, 9000, 3) and inductor_may_split(device, 1000, 2)
    assert not inductor_may_split(device, 1000, 1) and not inductor_may_split(device, 100, 7)
    assert asked == [
        (device, 9000, 3, True),
        (device, 1000, 2, True),
        (device, 1000, 2, False),
        (device, 1000, 1, True),
        (device, 100, 7, True),
        (device, 100, 7, False),
    ]


SPLITS = {
    "h200": lambda length, rows: (
        heuristic_of_an_h200(torch.device("cuda"), length, rows, True) > 1
        or (rows > 1 and heuristic_of_an_h200(torch.device("cuda"), length, rows, False) > 1)
    ),
    "above 512": lambda length, rows: length > 512,
    "always": lambda length, rows: True,
    "600 only": lambda length, rows: length == 600,
}


@pytest.mark.parametrize(
    ("splits", "length", "rows", "block"),
    [
        ("h200", 16386, 1, 128),  # qwen4_exp at T = 16384: 17 rows of 1024 split as an outer reduction
        ("h200", 300, 8, 128),  # outer: 3 splits; 3 blocks of 128 per row (24 rows): none
        ("h200", 100, 4, None),  # split by neither heuristic
        ("above 512", 5000, 1, 512),  # the largest that fits, not the first that does from below
        ("always", 5000, 1, 32),  # nothing fits: Inductor's floor, which it never splits
        ("always", 50, 1, 32),  # ... also for a row just over it
        ("always", 32, 1000, None),  # the floor itself is never split
        ("600 only", 600, 1, 512),  # a block is shorter than the row: 1024 would be one block, scanned as the row
    ],
)
def test_inductor_block_is_the_largest_block_inductor_runs_unsplit(
    splits: str, length: int, rows: int, block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = torch.device("cuda", 1)

    def may_split(asked: torch.device, n: int, r: int) -> bool:
        assert asked == device  # the scan's own device
        return SPLITS[splits](n, r)

    monkeypatch.setattr(blocked_scans, "inductor_may_split", may_split)
    assert inductor_block(device, length, rows) == block


def _values_name(graph: fx.Graph) -> str:
    """The node the scan's user (the ``* 2``) reads now."""
    (mul,) = [node for node in graph.nodes if node.target is aten.mul.Tensor]
    return mul.args[0].name


def test_a_scan_of_symbolic_length_is_left_as_it_is_without_adding_shape_guards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blocks' sizes of a symbolic length would make the fake values guard on it (a graph for every length
    specialised): the pass leaves the scan alone, adds no guard and says why."""
    monkeypatch.setattr(blocked_scans, "inductor_may_split", lambda *args: pytest.fail("asked for a symbolic length"))
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    cpu = mode.from_tensor(torch.empty(2, 50), symbolic_context=dynamic)
    with mode:  # a fake CUDA tensor of the same symbolic shape (``.to("cuda")`` needs a CUDA build)
        x = torch.empty(cpu.shape, device="cuda")
    graph = make_fx(values_of("min", 1), tracing_mode="symbolic")(x).graph
    guards, before = len(env.guards), graph_code(graph)
    result = run_pass(graph)
    shape = tuple(scans_in(graph)[0].args[0].meta["val"].shape)
    assert result.applied == 0, result
    assert result.reason == f"cummin left as it is: symbolic sizes {shape}: the blocks' sizes would add shape guards"
    assert graph_code(graph) == before and len(env.guards) == guards


def graph_code(graph: fx.Graph) -> str:
    return fx.GraphModule(torch.nn.Module(), graph).code


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("unsplit", "Inductor scans 1 row(s) of 4000 elements unsplit, in Triton"),
        ("cpu", "on cpu, where Inductor runs every scan as ATen's kernel"),
        ("indices", "its indices are read (the blocks compute values only)"),
        ("bool", "dtype torch.bool has no lowest value to start a block from"),
        ("0-d", "a 0-d tensor has nothing to scan"),
    ],
)
def test_a_scan_the_pass_does_not_block_is_left_as_it_is_and_the_report_says_why(
    case: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocked_scans, "inductor_may_split", lambda device, n, rows: case != "unsplit")
    if case == "cpu":
        graph = make_fx(values_of("max", 1))(torch.randn(1, 20000)).graph
    elif case == "indices":
        graph = fake_cuda_graph(lambda x: torch.cummax(x, 1).indices + 1, ((1, 20000), torch.float32))
    elif case == "bool":
        graph = fake_cuda_graph(lambda x: torch.cummax(x, 1).values.logical_not(), ((1, 20000), torch.bool))
    elif case == "0-d":
        graph = fake_cuda_graph(values_of("max", 0), ((), torch.float32))
    else:
        graph = fake_cuda_graph(values_of("max", 1), ((1, 4000), torch.int32))
    before = graph_code(graph)
    result = run_pass(graph)
    assert result.applied == 0 and result.reason == f"cummax left as it is: {why}", result
    assert graph_code(graph) == before


def test_a_graph_without_scans_is_left_alone_and_says_so() -> None:
    graph = fake_cuda_graph(lambda x: torch.cumsum(x, 1), ((1, 20000), torch.float32))
    before = graph_code(graph)
    result = run_pass(graph)
    assert (result.applied, result.reason) == (0, "no cummax or cummin")
    assert graph_code(graph) == before


def test_each_scan_of_a_graph_is_judged_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan left alone (indices read, or too short) does not stop a later one from being blocked; the report names
    each, the reasons joined by "; "."""
    monkeypatch.setattr(blocked_scans, "inductor_may_split", lambda device, n, rows: n > 5000)

    def three_scans(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.cummax(y, 1).indices, torch.cummax(z, 1).values, torch.cummin(x, 1).values

    shapes = ((2, 9000), torch.float32), ((2, 9000), torch.float32), ((2, 100), torch.float32)
    graph = fake_cuda_graph(three_scans, *shapes)
    result = run_pass(graph)
    indices_read = "cummax left as it is: its indices are read (the blocks compute values only)"
    unsplit = "cummax_1 left as it is: Inductor scans 2 row(s) of 100 elements unsplit, in Triton"
    assert result.applied == 1
    assert result.reason == f"{indices_read}; {unsplit}"
    assert len(result.notes) == 3 and result.notes[0].startswith("cummin: 9000 elements scanned in blocks")
    remaining = scans_in(graph)
    assert sum(node.target is aten.cummax.default for node in remaining) == 2  # the ones left alone, untouched
    assert sum(node.target is aten.cummin.default for node in remaining) == 2


def test_the_unused_indices_item_goes_with_the_scan() -> None:
    x = torch.randn(2, 300)
    gm = make_fx(values_of("max", 1))(x)
    (scan,) = scans_in(gm.graph)
    items = [user for user in scan.users if user.target is operator.getitem]
    assert len(items) == 2  # make_fx keeps an unused getitem of the indices
    block_scan(gm.graph, scan, levels(64))
    assert not any(item in gm.graph.nodes for item in items)
    gm.graph.lint()


def test_the_flag_turns_the_pass_off_and_cpu_compiles_say_why_it_did_not_apply() -> None:
    def f(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        return torch.cummax(torch.where(ids == 0, positions, -1), dim=1).values + 1

    ids = torch.randint(0, 5, (1, 3000))
    be = hcpasses.backend()
    assert torch.equal(torch.compile(f, backend=be, fullgraph=True)(ids), f(ids))
    record = be.reports[0].record("blocked_scans")
    assert record.status == "unchanged" and "on cpu" in record.reason, record
    torch._dynamo.reset()
    off = hcpasses.backend(blocked_scans=False)
    torch.compile(f, backend=off, fullgraph=True)(ids)
    assert off.reports[0].record("blocked_scans").status == "disabled"


# --- on the GPU: Inductor's behaviour the pass relies on ---------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")


@cuda
@pytest.mark.gpu
def test_inductor_may_split_a_long_row_and_17_rows_of_1024_but_not_the_blocks_chosen() -> None:
    """Inductor's heuristics on this GPU (H100 / H200, before sm100): one row of 16386 splits; 17 rows of 1024 split
    as an outer reduction (8 ways), which is how Inductor classified qwen4_exp's blocks (the scan reads its ids
    through a cat) on torch 2.11; 129 rows of 128 and their one-row carry do not."""
    from torch._inductor.choices import InductorChoices

    device = torch.device("cuda")
    assert blocked_scans.inductor_may_split(device, 16386, 1)
    assert InductorChoices.reduction_split_factor(device, 1024, 17, inner_reduction=False) > 1
    assert blocked_scans.inductor_may_split(device, 1024, 17)
    assert blocked_scans.inductor_block(device, 16386, 1) == 128
    assert not blocked_scans.inductor_may_split(device, 128, 129)
    assert not blocked_scans.inductor_may_split(device, 129, 1)


def eos_scan(ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1], device=ids.device)
    return torch.cummax(torch.where(ids == 0, positions, -1), dim=1).values + 1


def eos_scan_of_the_history(ids: torch.Tensor) -> torch.Tensor:
    """As qwen4_exp scans: the ids after a 2-id EOS history (a cat, which Inductor reads through a masked index)."""
    return eos_scan(torch.cat([ids.new_zeros(ids.shape[0], 2), ids], dim=1))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("f", "batch"), [(eos_scan, 1), (eos_scan_of_the_history, 1), (eos_scan_of_the_history, 8)])
def test_on_cuda_the_blocked_scan_runs_in_triton_and_matches_eager(f: Callable, batch: int) -> None:
    """Without the pass the long cummax runs as ATen's scan kernel; with it only Triton kernels run, and the values
    are eager's, bit for bit. Judged by the kernels the profiler sees: the output code names ``aten.cummax`` in its
    comments either way (the FX nodes each kernel came from; torch 2.11)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, 50, (batch, 16384), device="cuda")
    kernels = {}
    for flag in (False, True):
        torch._dynamo.reset()
        be = hcpasses.backend(blocked_scans=flag)
        compiled = torch.compile(f, backend=be, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(ids), f(ids))  # compiles
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = compiled(ids)
            torch.cuda.synchronize()
        assert torch.equal(out, f(ids))
        kernels[flag] = {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}
        assert be.reports[0].applied.get("blocked_scans", 0) == int(flag), be.reports[0]
    aten_scans = {
        flag: [name for name in names if "scan" in name and "at::native" in name] for flag, names in kernels.items()
    }
    assert aten_scans[False], kernels[False]  # what the pass is for: ATen's scan kernel
    assert not aten_scans[True] and any(name.startswith("triton_") for name in kernels[True]), kernels[True]


@pytest.mark.parametrize(("source", "scans"), [("copy", 1), ("ngram", 2)])
def test_the_benchmark_runs_on_cpu_and_records_each_variant(source: str, scans: int, tmp_path: Path) -> None:
    """``benchmarks/blocked_scans.py --cpu-smoke``: every variant's values are checked against eager (it exits on a
    difference) and its kernel time, kernel count, the pass's count and the ATen scans its code calls (each with the
    shape it scans) are recorded per case; ``--source ngram`` scans with transformers' n-gram module (two shifts,
    each a scan of the ids and their 2-id history)."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [
            *(sys.executable, "benchmarks/blocked_scans.py", "--cpu-smoke", "--repeats", "2", "--warmup", "1"),
            *("--source", source, "--out", out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] and result["torch"] == torch.__version__ and result["source"] == source
    assert [(case["batch"], case["length"]) for case in result["cases"]] == [(1, 300), (2, 50)]
    for case in result["cases"]:
        assert case["inductor"]["applied"] is None and case["off"]["applied"] == 0
        assert case["blocked"]["applied"] == 0  # on CPU the pass leaves the scan to ATen
        shape = str((case["batch"], case["length"] + 2))  # the ids after their 2-id history
        for variant in ("inductor", "off", "blocked"):
            assert case[variant]["kernel_ms"] > 0 and case[variant]["kernels"] >= 1
            found = case[variant]["aten_scans"]
            assert [(scan["op"], scan["shape"]) for scan in found] == [("cummax", shape)] * scans, found
        assert case["off_over_blocked"] == round(case["off"]["kernel_ms"] / case["blocked"]["kernel_ms"], 3)


def test_the_benchmarks_aten_scan_record_reads_calls_not_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``aten_scans`` takes from output code: the calls, with the shape of what each scans (an allocated buffer
    or a graph input); the FX-node comments and size assertions that name the op are not calls."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # benchmarks/ is not a package
    from blocked_scans import aten_scans as read

    code = """
    # %cummax : [num_users=1] = call_function[target=torch.ops.aten.cummax.default](args = (%pad, -1))
    buf3 = empty_strided_cuda((1, 17, 1024), (17408, 1024, 1), torch.int64)
    buf4 = torch.ops.aten.cummax.default(buf3, -1)
    assert_size_stride(buf5, (1, 17, 1024), (17408, 1024, 1), 'torch.ops.aten.cummax.default')
    assert_size_stride(arg0_1, (1, 17), (17, 1))
    buf9 = torch.ops.aten.cummin.default(arg0_1, dim=1)
    buf1 = torch.ops.aten.cummax.default(reinterpret_tensor(buf0, (1, 17, 1024), (0, 1024, 1), 0), dim=-1)
    """
    assert read(code) == [
        {"op": "cummax", "scans": "buf3", "shape": "(1, 17, 1024)"},
        {"op": "cummin", "scans": "arg0_1", "shape": "(1, 17)"},
        {"op": "cummax", "scans": "buf0", "shape": "(1, 17, 1024)"},
    ]


def test_the_manager_verifies_a_blocked_cuda_graph_and_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the pass manager (fake values re-propagated on the new nodes, the graph verified): the rewrite stands
    (``applied``, not rolled back), and the scan's user keeps its value's shape and dtype."""
    from hcpasses.manager import PassManager

    monkeypatch.setattr(blocked_scans, "inductor_may_split", lambda device, n, rows: n > 5000)
    graph = fake_cuda_graph(values_of("max", 1), ((2, 9000), torch.bfloat16))
    reports = []
    PassManager(HCPassesConfig.resolve(env={}), reports.append, passes=[BlockedScans()])(graph)
    record = reports[0].record("blocked_scans")
    assert (record.status, record.applied) == ("applied", 1), reports[0]
    (mul,) = [node for node in graph.nodes if node.target is aten.mul.Tensor]
    assert mul.meta["val"].shape == (2, 9000) and mul.meta["val"].dtype == torch.bfloat16
    assert len(scans_in(graph)) == 2

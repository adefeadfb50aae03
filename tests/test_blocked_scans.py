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
from hcpasses.passes.blocked_scans import SCAN_BLOCK, BlockedScans, block_scan, inductor_splits

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


# The quick profile draws two examples: these pin what each must cover (cummin of floats and ints, a scan along a
# middle dim of 3, dim -1 of a 1-d tensor), whatever it draws.
@example(rank_dim=(3, 1), length=700, block=64, dtype=torch.float32, kind="min", seed=1)
@example(rank_dim=(2, 0), length=37, block=3, dtype=torch.int32, kind="max", seed=2)
@example(rank_dim=(1, -1), length=50, block=16, dtype=torch.int16, kind="min", seed=3)
@given(
    rank_dim=st.sampled_from([(1, 0), (1, -1), (2, 1), (2, 0), (3, 1), (3, 2), (3, -1)]),
    length=st.integers(1, 700),
    block=st.sampled_from([1, 3, 16, 64]),
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
    block_scan(gm.graph, scan, block)
    gm.graph.lint()
    gm.recompile()
    assert len(scans_in(gm.graph)) == 2, gm.code  # the blocks' scan and the carry's
    assert_same(gm(x), fn(x))


def test_a_scan_of_exactly_whole_blocks_and_a_single_block_match() -> None:
    for length in (SCAN_BLOCK, 3 * SCAN_BLOCK, 5):
        x = sample((2, length), torch.float32, length)
        gm = make_fx(values_of("max", 1))(x)
        block_scan(gm.graph, scans_in(gm.graph)[0], SCAN_BLOCK)
        gm.recompile()
        assert_same(gm(x), values_of("max", 1)(x))


def test_a_scan_whose_dim_is_a_keyword_is_blocked_along_that_dim() -> None:
    x = sample((3, 200), torch.float32, 4)
    gm = make_fx(values_of("max", 1))(x)
    (scan,) = scans_in(gm.graph)
    scan.args, scan.kwargs = scan.args[:1], {"dim": scan.args[1]}  # cummax(x, dim=1), as a hand-built graph has it
    block_scan(gm.graph, scan, 16)
    gm.recompile()
    assert_same(gm(x), values_of("max", 1)(x))


def fake_cuda_graph(fn: Callable[..., torch.Tensor], *shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> fx.Graph:
    """``fn`` traced on fake CUDA tensors (no GPU needed), as the pass sees a CUDA graph."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes_dtypes]
        return make_fx(fn)(*args).graph


def run_pass(graph: fx.Graph) -> hcpasses.graph_pass.PassResult:
    return BlockedScans().run(graph, HCPassesConfig())


def test_a_long_cuda_scan_inductor_would_split_is_blocked_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []
    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda *args: asked.append(args) or True)
    graph = fake_cuda_graph(values_of("max", 1), ((1, 16387), torch.int64))
    result = run_pass(graph)
    assert result.applied == 1 and result.reason is None, result
    assert asked == [(torch.device("cuda", 0), 16387, 1)]
    assert len(scans_in(graph)) == 2
    assert result.notes == (f"cummax: 16387 elements scanned in blocks of {SCAN_BLOCK} -> {_values_name(graph)}",)


@pytest.mark.parametrize("length", [20000, SCAN_BLOCK * SCAN_BLOCK])  # the most blocks the pass takes
def test_a_long_scan_of_a_1d_tensor_is_blocked(length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []
    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda *args: asked.append(args[1:]) or True)
    graph = fake_cuda_graph(values_of("min", 0), ((length,), torch.float32))
    assert run_pass(graph).applied == 1
    assert asked == [(length, 1)]  # one row: no other dims


def test_inductor_splits_asks_inductors_own_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate is Inductor's split heuristic, asked for the scan's device, length and rows (an internal API: here its
    signature on the CPU, its answers on CUDA in the GPU tests below)."""
    from torch._inductor.choices import InductorChoices

    assert inductor_splits(torch.device("cpu"), 1 << 20, 1) and not inductor_splits(torch.device("cpu"), 64, 1)
    asked = []

    def factor(device: torch.device, length: int, rows: int, inner_reduction: bool) -> int:
        asked.append((device, length, rows, inner_reduction))
        return 2 if length > 5000 else 1

    monkeypatch.setattr(InductorChoices, "reduction_split_factor", staticmethod(factor))
    device = torch.device("cuda", 1)
    assert inductor_splits(device, 9000, 3) and not inductor_splits(device, 100, 7)
    assert asked == [(device, 9000, 3, True), (device, 100, 7, True)]


def _values_name(graph: fx.Graph) -> str:
    """The node the scan's user (the ``* 2``) reads now."""
    (mul,) = [node for node in graph.nodes if node.target is aten.mul.Tensor]
    return mul.args[0].name


def test_a_scan_of_symbolic_length_is_left_as_it_is_without_adding_shape_guards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blocks' sizes of a symbolic length would make the fake values guard on it (a graph for every length
    specialised): the pass leaves the scan alone, adds no guard and says why."""
    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda *args: pytest.fail("asked for a symbolic length"))
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
        ("too_long", f"{SCAN_BLOCK * SCAN_BLOCK + 1} elements make more than {SCAN_BLOCK} blocks"),
        ("0-d", "a 0-d tensor has nothing to scan"),
    ],
)
def test_a_scan_the_pass_does_not_block_is_left_as_it_is_and_the_report_says_why(
    case: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda device, n, rows: case != "unsplit")
    if case == "cpu":
        graph = make_fx(values_of("max", 1))(torch.randn(1, 20000)).graph
    elif case == "indices":
        graph = fake_cuda_graph(lambda x: torch.cummax(x, 1).indices + 1, ((1, 20000), torch.float32))
    elif case == "bool":
        graph = fake_cuda_graph(lambda x: torch.cummax(x, 1).values.logical_not(), ((1, 20000), torch.bool))
    elif case == "0-d":
        graph = fake_cuda_graph(values_of("max", 0), ((), torch.float32))
    else:
        length = 4000 if case == "unsplit" else SCAN_BLOCK * SCAN_BLOCK + 1
        graph = fake_cuda_graph(values_of("max", 1), ((1, length), torch.int32))
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
    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda device, n, rows: n > 5000)

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
    block_scan(gm.graph, scan, 64)
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
def test_inductor_splits_a_long_row_and_not_the_blocks() -> None:
    device = torch.device("cuda")
    assert blocked_scans.inductor_splits(device, 16387, 1)
    assert not blocked_scans.inductor_splits(device, SCAN_BLOCK, 17)
    assert not blocked_scans.inductor_splits(device, 17, 1)


@cuda
@pytest.mark.gpu
def test_on_cuda_the_blocked_scan_runs_in_triton_and_matches_eager() -> None:
    """Without the pass the long cummax runs as ATen's scan kernel; with it only Triton kernels run, and the values
    are eager's, bit for bit. Judged by the kernels the profiler sees: the output code names ``aten.cummax`` in its
    comments either way (the FX nodes each kernel came from; torch 2.11)."""
    from torch.profiler import ProfilerActivity, profile

    def f(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return torch.cummax(torch.where(ids == 0, positions, -1), dim=1).values + 1

    ids = torch.randint(0, 50, (1, 16387), device="cuda")
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


@pytest.mark.parametrize(("source", "scans", "history"), [("copy", 1, 0), ("ngram", 2, 2)])
def test_the_benchmark_runs_on_cpu_and_records_each_variant(
    source: str, scans: int, history: int, tmp_path: Path
) -> None:
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
        shape = str((case["batch"], case["length"] + history))
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
    """
    assert read(code) == [
        {"op": "cummax", "scans": "buf3", "shape": "(1, 17, 1024)"},
        {"op": "cummin", "scans": "arg0_1", "shape": "(1, 17)"},
    ]


def test_the_manager_verifies_a_blocked_cuda_graph_and_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the pass manager (fake values re-propagated on the new nodes, the graph verified): the rewrite stands
    (``applied``, not rolled back), and the scan's user keeps its value's shape and dtype."""
    from hcpasses.manager import PassManager

    monkeypatch.setattr(blocked_scans, "inductor_splits", lambda *args: True)
    graph = fake_cuda_graph(values_of("max", 1), ((2, 9000), torch.bfloat16))
    reports = []
    PassManager(HCPassesConfig.resolve(env={}), reports.append, passes=[BlockedScans()])(graph)
    record = reports[0].record("blocked_scans")
    assert (record.status, record.applied) == ("applied", 1), reports[0]
    (mul,) = [node for node in graph.nodes if node.target is aten.mul.Tensor]
    assert mul.meta["val"].shape == (2, 9000) and mul.meta["val"].dtype == torch.bfloat16
    assert len(scans_in(graph)) == 2

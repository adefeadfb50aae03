"""Tests of the fused HC collapse + per-token FP8 quant ops and their Triton kernels (hcpasses.kernels).

Two parts:

- The custom ops on CPU (their torch reference): fake implementations; x, q and scale bit-exact against
  :func:`_contract_outputs`, a reference written here from the contract (DESIGN §5) and sharing no code
  with the ops; x also against a float64 formula and the quant against
  :func:`hcpasses.testing.models.fp8.quantize_per_token`.
- :class:`TestTritonKernels`: the Triton kernels against the torch reference — q and scale bit-exact given
  the kernel's own x, x within one ulp of its dtype — for each exact arithmetic path of the device
  (:func:`_paths`: compiled, hardware casts + FMA division and the interpreter's integer rounding +
  div_rn), and on CUDA that compiled graphs launch the kernel themselves (traced through the triton_op,
  or lowered as a post-grad op node). They run compiled on CUDA when a GPU is present and,
  always where Triton is installed, under ``TRITON_INTERPRET=1`` on CPU. The interpreter must be chosen
  before Triton is imported, and setting it for the whole session could change how Inductor behaves in
  other test files, so :func:`test_triton_kernels_under_interpreter` runs the class in a child pytest.
  The interpreter is slow: its hypothesis sweeps are capped at ``MAX_KERNEL_EXAMPLES`` examples (25; 60 on CUDA).
"""

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from hcpasses.kernels import (
    contract,
    gated_mean_quant_reference,
    quant_epilogue_reference,
    weighted_sum_quant_reference,
)
from hcpasses.testing.models import fp8

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Where TestTritonKernels runs: CPU tensors under the interpreter, else the GPU if there is one.
KERNEL_DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
# The interpreter runs a kernel sweep example in about 1 s on CPU (2026-12-02: 86 of the class's 138 s were the two
# sweeps at 40 examples each), one of the suite's longest tests: 25 there, 60 compiled on the GPU.
MAX_KERNEL_EXAMPLES = 25 if INTERPRET else 60
REPO_ROOT = Path(__file__).resolve().parents[1]
FP32_EPS = 2.0**-24
FLUSH_SLACK = 4 * torch.finfo(torch.float32).tiny  # up to n = 4 subnormal terms flushed to zero
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Row-magnitude exponents (base 10) each dtype can hold without overflowing the stream sum.
EXPONENT_RANGE = {torch.float32: (-30, 30), torch.bfloat16: (-30, 30), torch.float16: (-7, 2)}
HUGE = {torch.float32: 1e37, torch.bfloat16: 1e37, torch.float16: 1e4}
OPS = {
    "gated_mean_quant": (torch.ops.hcpasses.gated_mean_quant.default, gated_mean_quant_reference),
    "weighted_sum_quant": (torch.ops.hcpasses.weighted_sum_quant.default, weighted_sum_quant_reference),
}

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hcpasses.kernels.triton_gated_mean_quant import (
        LaunchConfig,
        default_launch_config,
        gated_mean_quant_triton,
        round_to_dtype,
        round_to_e4m3_grid,
        row_pieces,
        to_e4m3,
        weighted_sum_quant_triton,
    )

    TRITON_FUNCS = {"gated_mean_quant": gated_mean_quant_triton, "weighted_sum_quant": weighted_sum_quant_triton}

    @triton.jit
    def _e4m3_kernel(v_ptr, grid_ptr, q_ptr, n, BLOCK: tl.constexpr, HW_CASTS: tl.constexpr):
        """Store ``round_to_e4m3_grid(v)`` (fp32) and ``to_e4m3(v)`` (as bytes)."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
        tl.store(grid_ptr + offsets, round_to_e4m3_grid(v), mask=mask)
        tl.store(q_ptr + offsets, to_e4m3(v, HW_CASTS).to(tl.uint8, bitcast=True), mask=mask)

    @triton.jit
    def _cast_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr, HW_CASTS: tl.constexpr):
        """Store ``v`` cast to the output dtype: ``round_to_dtype`` or the hardware cast."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
        if HW_CASTS:
            tl.store(out_ptr + offsets, v.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + offsets, round_to_dtype(v, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr):
        """``out = fma(a, b, c)`` for one fp32 element."""
        tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(b_ptr), tl.load(c_ptr)))


@dataclasses.dataclass(frozen=True)
class Case:
    """One random problem: sizes, dtype, row magnitudes (powers of ten) and special rows."""

    tokens: int
    hidden: int
    n_streams: int
    dtype: torch.dtype
    seed: int
    exponent: int
    spread: int
    zero_rows: int
    huge_rows: int
    fp32_gates: bool = False

    def inputs(self, op: str, device: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(streams [T, n*S], gates, zero row indices)``; gates are ``u [T, n*S]`` or ``w [T, n]``.

        Gates are in the streams' dtype or, with ``fp32_gates``, in fp32 (mHC's scalar gates are fp32).
        """
        gen = torch.Generator().manual_seed(self.seed)
        width = self.n_streams * self.hidden
        lo, hi = EXPONENT_RANGE[self.dtype]
        row_exp = (self.exponent + (2 * torch.rand(self.tokens, 1, generator=gen) - 1) * self.spread).clamp(lo, hi)
        streams = torch.randn(self.tokens, width, generator=gen, dtype=torch.float64) * 10.0**row_exp
        special = torch.randperm(self.tokens, generator=gen).tolist()
        zero, huge = special[: self.zero_rows], special[self.zero_rows : self.zero_rows + self.huge_rows]
        streams[zero] = 0.0
        for row in huge:
            col = int(torch.randint(width, (1,), generator=gen))
            streams[row, col] = HUGE[self.dtype] * (1 if torch.rand(1, generator=gen) < 0.5 else -1)
        if op == "gated_mean_quant":
            gate_exp = 2.5 * torch.rand(self.tokens, 1, generator=gen) - 1
            gates = torch.randn(self.tokens, width, generator=gen, dtype=torch.float64) * 10.0**gate_exp
        else:
            gates = torch.randn(self.tokens, self.n_streams, generator=gen, dtype=torch.float64).clamp(-4, 4)
        gate_dtype = torch.float32 if self.fp32_gates else self.dtype
        return streams.to(self.dtype).to(device), gates.to(gate_dtype).to(device), zero


@st.composite
def cases(draw: st.DrawFn, max_elements: int = 90_000) -> Case:
    """Odd sizes (S not only powers of two), n in {2, 4}, every activation dtype, magnitudes over the range."""
    dtype = draw(st.sampled_from(DTYPES))
    hidden = draw(st.one_of(st.integers(1, 300), st.sampled_from([256, 512, 2560])))
    tokens = draw(st.integers(1, max(1, min(300, max_elements // hidden))))
    lo, hi = EXPONENT_RANGE[dtype]
    return Case(
        tokens=tokens,
        hidden=hidden,
        n_streams=draw(st.sampled_from([2, 4])),
        dtype=dtype,
        seed=draw(st.integers(0, 2**32 - 1)),
        exponent=draw(st.integers(lo, hi)),
        spread=draw(st.integers(0, 8)),
        zero_rows=draw(st.integers(0, min(2, tokens))),
        huge_rows=draw(st.integers(0, 2)),
        fp32_gates=draw(st.booleans()),
    )


def chunked_configs(hidden: int) -> st.SearchStrategy:
    """Launch configs that split a row of ``hidden`` columns into several chunks (when it has more than one)."""
    block = 1 << max(0, (hidden - 1).bit_length())
    return st.builds(
        lambda rows, split, warps: LaunchConfig(rows, max(1, block // split), warps),
        st.sampled_from([1, 2, 4]),
        st.sampled_from([2, 4, 8]),
        st.sampled_from([1, 2, 4]),
    )


def _formula_x(op: str, streams: torch.Tensor, gates: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The collapse in float64 straight from its definition, and the scale of fp32 error its terms allow.

    That scale is ``sum_s |term_s| * (16 + |u_s|)`` in units of fp32 eps: a few roundings per term, and a
    GPU sigmoid (``exp2(-u * log2 e)`` with the product rounded) is off by up to ``|u| / 2`` fp32 ulps.
    """
    s = streams.double().cpu().unflatten(-1, (n, -1))
    g = gates.double().cpu()
    if op == "gated_mean_quant":
        terms = torch.sigmoid(g).unflatten(-1, (n, -1)) * s / n
        return terms.sum(-2), (terms.abs() * (16 + g.abs().unflatten(-1, (n, -1)))).sum(-2) * FP32_EPS
    terms = g.unsqueeze(-1) * s
    return terms.sum(-2), 16 * terms.abs().sum(-2) * FP32_EPS


def _assert_x_close(x: torch.Tensor, expected: torch.Tensor, fp32_error: torch.Tensor) -> None:
    """``|x - expected| <= 1 ulp of x's dtype (at the larger of the two) + fp32_error + FLUSH_SLACK``.

    ``fp32_error`` comes from :func:`_formula_x`; ``FLUSH_SLACK`` lets a GPU flush fp32 subnormal terms.
    """
    assert torch.isfinite(x).all()
    xd, ed = x.double().cpu(), expected.double().cpu()
    big = torch.maximum(xd.abs(), ed.abs()).to(x.dtype)
    ulp = torch.nextafter(big, torch.full_like(big, math.inf)).double() - big.double()
    bound = ulp + fp32_error + FLUSH_SLACK
    err = (xd - ed).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"x off by {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g} at {worst}"


def _contract_collapse(op: str, streams: torch.Tensor, gates: torch.Tensor, n: int) -> torch.Tensor:
    """x as the contract defines it (DESIGN §5, ATOM's convention), written independently of the ops' code.

    fp32 terms (gated mean: ``sigmoid(u_s) * xn_s``; mHC: ``w[:, s] * h_s``), summed in stream order
    s = 0..n-1, the gated mean's sum divided by n, then one rounding to the streams' dtype.
    """
    hidden = streams.shape[1] // n
    columns = [slice(s * hidden, (s + 1) * hidden) for s in range(n)]
    values = streams.float()
    if op == "gated_mean_quant":
        gate = torch.sigmoid(gates.float())
        terms = [gate[:, c] * values[:, c] for c in columns]
    else:
        weights = gates.float()
        terms = [weights[:, s : s + 1] * values[:, c] for s, c in enumerate(columns)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    if op == "gated_mean_quant":
        total = total / n
    return total.to(streams.dtype)


def _contract_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token FP8 quant of DESIGN §5, written independently of the ops' and hcpasses.testing.models.fp8's code.

    amax of the (already rounded) x; ``scale = max(amax / 448, 1 / (448 * 512))`` rounded once to fp32;
    ``q = clamp(x / scale, ±448)`` with ``x / scale`` rounded once to fp32, cast round-to-nearest-even to
    e4m3. The divisions run in float64 and are then rounded to fp32: for a quotient of fp32 values that
    gives the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits), whatever division torch does in fp32.
    """
    x64 = x.double()
    amax = x64.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax / 448.0, min=1.0 / (448.0 * 512.0)).float()
    ratio = (x64 / scale.double()).float().clamp(-448.0, 448.0)
    return ratio.to(torch.float8_e4m3fn), scale


def _contract_outputs(op: str, streams: torch.Tensor, gates: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``(x, q, scale)`` of the contract for the op's inputs."""
    x = _contract_collapse(op, streams.cpu(), gates.cpu(), n)
    return (x, *_contract_quant(x))


def _assert_bit_exact(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """Each output has the dtype, shape and bits of the expected one (so -0.0 is not 0.0)."""
    for name, g, w in zip(("x", "q", "scale")[-len(want) :], got, want, strict=True):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{name}: {g.dtype} {tuple(g.shape)}"
        same = g.cpu().view(torch.uint8) == w.view(torch.uint8)
        assert same.all(), f"{name}: {int((~same).sum())} bytes differ"


def _assert_quant_matches(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero_rows: list[int]) -> None:
    """q and scale bit-exact against the quant reference applied to ``x``; zero rows: floor scale, zero codes."""
    assert q.dtype == contract.FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    q_ref, scale_ref = quant_epilogue_reference(x)
    codes, codes_ref = q.view(torch.uint8), q_ref.view(torch.uint8)
    assert torch.isfinite(scale).all() and not q.float().isnan().any()
    assert torch.equal(scale, scale_ref), f"{int((scale != scale_ref).sum())} scales differ"
    assert torch.equal(codes, codes_ref), f"{int((codes != codes_ref).sum())} codes differ"
    floor = torch.tensor(contract.MIN_SCALE, dtype=torch.float32)
    assert (scale[zero_rows].cpu() == floor).all() and (q[zero_rows].float() == 0).all()  # -0.0 for a negative gate


# ---------------------------------------------------------------------------------------------------------
# The custom ops on CPU: the torch reference.


def _kernel_module_imports() -> dict[str, set[str]]:
    """For each module of hcpasses/kernels (not the package itself): the sibling modules it imports, at
    module level or inside a function."""
    folder = REPO_ROOT / "hcpasses" / "kernels"
    names = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        found: set[str] = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hcpasses.kernels":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hcpasses.kernels."):
                found.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("hcpasses.kernels.")}
        graph[name] = found & names
    return graph


def test_kernel_modules_import_without_a_cycle() -> None:
    """The contract is a leaf; the op definitions import the kernels and the lowering, never the reverse."""
    graph = _kernel_module_imports()
    assert graph["contract"] == set()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for imported in graph[name]:
                visit(imported, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_constants_follow_models_fp8() -> None:
    assert (contract.FP8_MAX, contract.MIN_SCALE, contract.FP8_DTYPE) == (fp8.FP8_MAX, fp8.MIN_SCALE, fp8.FP8_DTYPE)


@pytest.mark.parametrize("op", list(OPS))
@given(case=cases(max_elements=30_000))
def test_op_matches_contract_formula_and_models_quant(op: str, case: Case) -> None:
    """CPU op: x, q, scale bit-exact against the contract reference (on CPU the op must round exactly as the
    contract says, so exact, not 1 ulp); x also within 1 ulp of the float64 formula; q, scale bit-exact
    against ``quantize_per_token(x)`` (the unfused path); zero rows: floor scale, zero codes."""
    streams, gates, zero = case.inputs(op, "cpu")
    x, q, scale = OPS[op][0](streams, gates, case.n_streams)
    assert x.dtype == case.dtype and x.shape == (case.tokens, case.hidden)
    _assert_bit_exact((x, q, scale), _contract_outputs(op, streams, gates, case.n_streams))
    _assert_x_close(x, *_formula_x(op, streams, gates, case.n_streams))
    q_ref, scale_ref = fp8.quantize_per_token(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    floor = torch.tensor(contract.MIN_SCALE, dtype=torch.float32)
    assert (scale[zero] == floor).all() and (q[zero].float() == 0).all()


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 64), st.integers(1, 300)),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_quant_epilogue_bit_exact_with_models_fp8(
    dtype: torch.dtype, shape: tuple[int, int], exponent: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=gen, dtype=torch.float64)
    scales = 10.0 ** (exponent + 4 * torch.rand(shape[0], 1, generator=gen, dtype=torch.float64) - 2)
    x = (rows * scales).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    x[0] = 0.0
    q, scale = quant_epilogue_reference(x)
    _assert_bit_exact((q, scale), _contract_quant(x))  # the Triton tests' oracle is the contract's quant
    q_ref, scale_ref = fp8.quantize_per_token(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert scale[0].item() == torch.tensor(contract.MIN_SCALE, dtype=torch.float32).item() and not q[0].float().any()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(op: str, dtype: torch.dtype) -> None:
    streams, gates, _ = Case(5, 24, 4, dtype, 0, 0, 1, 1, 0).inputs(op, "cpu")
    torch.library.opcheck(OPS[op][0], (streams, gates, 4))


@pytest.mark.parametrize("op", list(OPS))
def test_fake_impl_shapes(op: str) -> None:
    with FakeTensorMode():
        streams = torch.empty(7, 4 * 33, dtype=torch.bfloat16)
        gates = torch.empty(7, 4 * 33 if op == "gated_mean_quant" else 4)
        if op == "gated_mean_quant":
            gates = gates.to(torch.bfloat16)
        x, q, scale = OPS[op][0](streams, gates, 4)
    assert (x.shape, x.dtype) == ((7, 33), torch.bfloat16)
    assert (q.shape, q.dtype) == ((7, 33), torch.float8_e4m3fn)
    assert (scale.shape, scale.dtype) == ((7, 1), torch.float32)


@pytest.mark.parametrize("op", list(OPS))
def test_dynamic_token_count_through_compile(op: str) -> None:
    """The fake impl works with a symbolic T: one compiled graph serves several token counts.

    T = 1 is left out: Dynamo specialises sizes 0 and 1, so it would compile a second graph whatever the op.
    """
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda a, b: OPS[op][0](a, b, 2), backend=counter, dynamic=True, fullgraph=True)
    for tokens in (3, 17, 40):
        streams, gates, _ = Case(tokens, 10, 2, torch.bfloat16, tokens, 0, 2, 0, 0).inputs(op, "cpu")
        _assert_bit_exact(fn(streams, gates), _contract_outputs(op, streams, gates, 2))
    assert counter.frame_count == 1


@pytest.mark.parametrize("post_grad", [False, True], ids=["traced_through", "post_grad_node"])
@pytest.mark.parametrize("op", list(OPS))
def test_cpu_op_stays_the_reference_under_inductor(op: str, post_grad: bool) -> None:
    """Inductor on CPU calls the op (the torch reference), bit-exact with eager, never traces into it.

    ``traced_through``: a compiled function calls the op (the triton_op is decomposed on CUDA only).
    ``post_grad_node``: decomposition off, as for an op that hcpasses' fusion pass inserts post-grad; the
    lowering of :mod:`hcpasses.kernels.inductor_lowering` falls back to the op on CPU.
    """
    from torch._inductor.utils import run_and_get_code
    from torch.export._trace import _disable_custom_triton_op_functional_decomposition

    torch._dynamo.reset()
    streams, gates, _ = Case(37, 100, 4, torch.bfloat16, 11, 0, 2, 1, 1).inputs(op, "cpu")
    fn = torch.compile(lambda a, b: OPS[op][0](a, b, 4), fullgraph=True)
    ctx = _disable_custom_triton_op_functional_decomposition() if post_grad else contextlib.nullcontext()
    with ctx, torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(fn, streams, gates)
    assert f"torch.ops.hcpasses.{op}.default(" in "\n".join(codes)
    _assert_bit_exact(got, _contract_outputs(op, streams, gates, 4))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("op", list(OPS))
def test_triton_op_names_its_kernel(op: str) -> None:
    """The triton_op finds its kernel, so AOTAutograd's cache key covers the kernel's source."""
    from torch._library.triton import get_triton_kernels_for_op

    names = [getattr(k, "__name__", "") for k in get_triton_kernels_for_op(f"hcpasses::{op}")]
    assert INTERPRET or names == ["_collapse_quant_kernel"]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("tokens", [0, 1])
def test_tiny_token_counts(op: str, tokens: int) -> None:
    streams, gates, _ = Case(tokens, 5, 4, torch.float16, 3, 0, 0, 0, 0).inputs(op, "cpu")
    x, q, scale = OPS[op][0](streams, gates, 4)
    assert x.shape == q.shape == (tokens, 5) and scale.shape == (tokens, 1)


def _bad_inputs(op: str) -> list[tuple[torch.Tensor, torch.Tensor, int, str]]:
    """``(streams, gates, n_streams, message pattern)`` that the op must reject."""
    good = torch.randn(3, 8)
    gates = good.clone() if op == "gated_mean_quant" else torch.randn(3, 2)
    return [
        (good.view(3, 2, 4), gates, 2, r"shape \(3, 2, 4\)"),
        (good.t().contiguous().t(), gates, 2, "contiguous=False"),
        (good.double(), gates, 2, "dtype torch.float64"),
        (good.to(torch.int32), gates, 2, "dtype torch.int32"),
        (good, gates, 3, "divisible by n_streams=3"),
        (good, gates, 0, "n_streams=0"),
        (torch.randn(3, 0), gates, 2, "non-zero width"),
        (good, gates[:2], 2, r"got \(2, "),
        (good, gates.double(), 2, "dtype torch.float64"),
    ]


@pytest.mark.parametrize("op", list(OPS))
def test_bad_inputs_raise_value_error(op: str) -> None:
    for streams, gates, n, pattern in _bad_inputs(op):
        with pytest.raises(ValueError, match=pattern):
            OPS[op][0](streams, gates, n)
        with pytest.raises(ValueError, match=pattern), FakeTensorMode(allow_non_fake_inputs=True):
            OPS[op][0](streams, gates, n)


# ---------------------------------------------------------------------------------------------------------
# The Triton kernels: compiled on CUDA, or on CPU under TRITON_INTERPRET=1 (in a child pytest, below).


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs Triton; this is the parent of the interpreter run")
def test_triton_kernels_under_interpreter() -> None:
    """Run :class:`TestTritonKernels` in a child pytest with ``TRITON_INTERPRET=1`` (CPU tensors)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::TestTritonKernels"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0 and " passed" in proc.stdout, f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"


def _e4m3_probe_values() -> torch.Tensor:
    """Every e4m3 grid value and midpoint in [0, 448], 2 fp32 ulps either side, random bit patterns; both signs."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    centres = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    near, up, down = [centres], centres, centres
    for _ in range(2):
        up, down = torch.nextafter(up, torch.tensor(math.inf)), torch.nextafter(down, torch.tensor(0.0))
        near += [up, down]
    gen = torch.Generator().manual_seed(0)
    bits_of_448 = int(torch.tensor(448.0).view(torch.int32))
    random = torch.randint(0, bits_of_448 + 1, (200_000,), generator=gen, dtype=torch.int32).view(torch.float32)
    values = torch.cat([*near, random, torch.tensor([0.0, 2.0**-149, 2.0**-126, 2.0**-10, 2.0**-9, 2.0**-6])])
    values = values[values <= 448.0]
    return torch.cat([values, -values])


@functools.cache
def _fma_rounds_once() -> bool:
    """Whether ``tl.fma`` on ``KERNEL_DEVICE`` rounds once (before triton 3.7 the interpreter's rounds twice)."""
    one = torch.tensor([1.0 + 2.0**-12], device=KERNEL_DEVICE)
    out = torch.empty_like(one)
    _fma_kernel[(1,)](one, one, -torch.tensor([1.0 + 2.0**-11], device=KERNEL_DEVICE), out)
    return out.item() == 2.0**-24  # the exact result; rounding the product first gives 0


def _paths() -> list[LaunchConfig | None]:
    """Variants of the kernel's arithmetic to check here: the default and, where exact, the other ones.

    Compiled: hardware casts + FMA division + ftz sigmoid (the default), and the interpreter's integer
    rounding + div_rn + ``tl.sigmoid``. Interpreter: the latter (the default), and the FMA division where
    ``tl.fma`` is exact.
    """
    if KERNEL_DEVICE == "cuda":
        return [None, LaunchConfig(0, 0, 0, hw_casts=False, fma_division=False, fast_sigmoid=False)]
    return [None, *([LaunchConfig(0, 0, 0, fma_division=True)] if _fma_rounds_once() else [])]


def _with_path(config: LaunchConfig | None, path: LaunchConfig | None, hidden: int) -> LaunchConfig | None:
    """``config`` (or the default for ``hidden``) with the arithmetic flags of ``path``."""
    if path is None:
        return config
    flags = {f: getattr(path, f) for f in ("hw_casts", "fma_division", "fast_sigmoid")}
    return dataclasses.replace(config or default_launch_config(hidden), **flags)


def _kernel_examples(test: object) -> object:
    """Hypothesis settings for kernel sweeps: the profile's example count, capped at ``MAX_KERNEL_EXAMPLES``."""
    return settings(max_examples=min(settings().max_examples, MAX_KERNEL_EXAMPLES))(test)


@pytest.mark.skipif(not HAS_TRITON or KERNEL_DEVICE is None, reason="needs Triton and a GPU or TRITON_INTERPRET=1")
class TestTritonKernels:
    """The Triton kernels against the torch reference, on ``KERNEL_DEVICE``."""

    @pytest.mark.parametrize("hw_casts", [False, True], ids=["grid_rounding", "hw_cast"])
    def test_e4m3_rounding_matches_torch_cast(self, hw_casts: bool) -> None:
        """Both e4m3 paths against torch's cast (the hardware cast only compiled: the interpreter's is wrong)."""
        if hw_casts and KERNEL_DEVICE != "cuda":
            pytest.skip("the interpreter's FP8 cast is wrong for some values (triton#8322)")
        values = _e4m3_probe_values().to(KERNEL_DEVICE)
        rounded, codes = torch.empty_like(values), torch.empty(values.shape, dtype=torch.uint8, device=KERNEL_DEVICE)
        grid = (triton.cdiv(values.numel(), 4096),)
        _e4m3_kernel[grid](values, rounded, codes, values.numel(), BLOCK=4096, HW_CASTS=hw_casts)
        expected = values.to(torch.float8_e4m3fn)
        assert torch.equal(codes, expected.view(torch.uint8)), f"{int((codes != expected.view(torch.uint8)).sum())}"
        assert torch.equal(rounded.view(torch.int32), expected.float().view(torch.int32))

    @pytest.mark.parametrize("hw_casts", [False, True], ids=["int_rounding", "hw_cast"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_round_to_dtype_matches_torch_cast(self, dtype: torch.dtype, hw_casts: bool) -> None:
        if hw_casts and KERNEL_DEVICE != "cuda":
            pytest.skip("the interpreter's bf16 cast truncates")
        gen = torch.Generator().manual_seed(1)
        bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int32)
        ties = (bits & ~0xFFFF) | 0x8000  # exactly half a bf16 ulp
        values = torch.cat([bits, ties]).view(torch.float32)
        values = values[torch.isfinite(values)].to(KERNEL_DEVICE)
        out = torch.empty(values.shape, dtype=dtype, device=KERNEL_DEVICE)
        _cast_kernel[(triton.cdiv(values.numel(), 4096),)](values, out, values.numel(), BLOCK=4096, HW_CASTS=hw_casts)
        expected = values.to(dtype)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))

    @pytest.mark.parametrize("path", range(2), ids=["default", "other"])
    @pytest.mark.parametrize("config", [None, (1, 64, 2)], ids=["single_pass", "chunked"])
    def test_division_near_e4m3_midpoints(self, path: int, config: tuple[int, int, int] | None) -> None:
        """q bit-exact where ``x / scale`` lies within a few fp32 ulps of an e4m3 rounding point.

        x goes straight through ``weighted_sum_quant`` with one stream and gate 1 (x = h exactly, fp32).
        Rows: amax 448 * scale with scales over the range, then e4m3 grid points and midpoints times the
        scale, each nudged by -3..3 ulps, both signs, and ±0.
        """
        paths = _paths()
        if path >= len(paths):
            pytest.skip("tl.fma rounds twice here, so the FMA division is not exact")
        gen = torch.Generator().manual_seed(3)
        grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # 253 values in [0, 448]
        scales = torch.cat([torch.tensor([contract.MIN_SCALE]), 10.0 ** (torch.rand(63, generator=gen) * 60 - 30)])
        rows = []
        for s in scales.float():
            amax = (s.double() * 448).float()
            scale = quant_epilogue_reference(amax.reshape(1, 1))[1].reshape(())
            base = (points * scale).float()
            near = [base]
            up, down = base, base
            for _ in range(3):
                up, down = torch.nextafter(up, torch.tensor(math.inf)), torch.nextafter(down, torch.tensor(0.0))
                near += [up, down]
            vals = torch.cat(near).clamp(max=amax)
            sign = torch.where(torch.rand(vals.shape, generator=gen) < 0.5, -1.0, 1.0)
            rows.append(torch.cat([amax.reshape(1), vals * sign, torch.tensor([0.0, -0.0])]))
        h = torch.stack(rows).to(KERNEL_DEVICE)
        w = torch.ones(h.shape[0], 1, device=KERNEL_DEVICE)
        cfg = _with_path(None if config is None else LaunchConfig(*config), paths[path], h.shape[1])
        x, q, scale = weighted_sum_quant_triton(h, w, 1, cfg)
        assert torch.equal(x.view(torch.int32), h.view(torch.int32))
        _assert_quant_matches(x, q, scale, [])

    @pytest.mark.parametrize("op", list(OPS))
    @_kernel_examples
    @given(case=cases(max_elements=40_000), data=st.data())
    def test_kernel_matches_reference(self, op: str, case: Case, data: st.DataObject) -> None:
        """Default launch (single pass: the row in registers) or a drawn one (several chunks, re-read), with
        each exact arithmetic path of this device (:func:`_paths`)."""
        streams, gates, zero = case.inputs(op, KERNEL_DEVICE)
        config = data.draw(st.one_of(st.none(), chunked_configs(case.hidden)))
        config = _with_path(config, data.draw(st.sampled_from(_paths())), case.hidden)
        x, q, scale = TRITON_FUNCS[op](streams, gates, case.n_streams, config)
        assert x.dtype == case.dtype and x.shape == (case.tokens, case.hidden)
        _assert_quant_matches(x, q, scale, zero)
        x_ref, _, _ = OPS[op][1](streams, gates, case.n_streams)
        _assert_x_close(x, x_ref, _formula_x(op, streams, gates, case.n_streams)[1])

    @pytest.mark.parametrize("op", list(OPS))
    @pytest.mark.parametrize("config", [(1, 32, 1), (2, 64, 2), (4, 128, 2), (1, 4096, 4)], ids=str)
    def test_launch_config_does_not_change_results(self, op: str, config: tuple[int, int, int]) -> None:
        streams, gates, _ = Case(37, 100, 4, torch.bfloat16, 5, 0, 3, 1, 1).inputs(op, KERNEL_DEVICE)
        default = TRITON_FUNCS[op](streams, gates, 4)
        for path in _paths():
            got_all = TRITON_FUNCS[op](streams, gates, 4, _with_path(LaunchConfig(*config), path, 100))
            for got, want in zip(got_all, default, strict=True):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    def test_row_pieces_and_default_configs(self) -> None:
        assert row_pieces(2560) == (2048, 512) and row_pieces(7168) == (4096, 2048, 1024)
        assert row_pieces(300) == (256, 32, 16) and row_pieces(1000) == (1024,) and row_pieces(1) == (1,)
        for hidden in [*range(1, 600), 2560, 4096, 7168, 8191, 8193, 16384]:
            pieces = row_pieces(hidden)
            assert len(pieces) <= 3 and sum(pieces) >= hidden and all(p & (p - 1) == 0 for p in pieces)
            cfg = default_launch_config(hidden)
            assert cfg.rows & (cfg.rows - 1) == 0 and cfg.chunk & (cfg.chunk - 1) == 0 and cfg.num_warps >= 1
            assert (cfg.chunk >= hidden) == (sum(pieces) <= 8192)

    @pytest.mark.parametrize("op", list(OPS))
    def test_zero_tokens(self, op: str) -> None:
        streams, gates, _ = Case(0, 9, 2, torch.bfloat16, 0, 0, 0, 0, 0).inputs(op, KERNEL_DEVICE)
        x, q, scale = TRITON_FUNCS[op](streams, gates, 2)
        assert x.shape == q.shape == (0, 9) and scale.shape == (0, 1)

    @pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="the op dispatches to Triton on CUDA only")
    @pytest.mark.parametrize("op", list(OPS))
    def test_cuda_op_runs_the_triton_kernel(self, op: str) -> None:
        streams, gates, _ = Case(64, 2560, 4, torch.bfloat16, 9, 0, 2, 1, 1).inputs(op, "cuda")
        torch.library.opcheck(OPS[op][0], (streams, gates, 4))
        for got, want in zip(OPS[op][0](streams, gates, 4), TRITON_FUNCS[op](streams, gates, 4), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    @pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="Inductor launches the kernel on CUDA only")
    @pytest.mark.parametrize("post_grad", [False, True], ids=["traced_through", "post_grad_lowering"])
    @pytest.mark.parametrize("op", list(OPS))
    def test_compiled_graph_launches_the_kernel(self, op: str, post_grad: bool) -> None:
        """Inductor's code calls the Triton kernel itself, no custom-op fallback; results as eager.

        ``traced_through``: AOTAutograd decomposes the triton_op. ``post_grad_lowering``: decomposition off,
        so the op reaches Inductor as a graph node, as when hcpasses' fusion pass inserts it; the lowering
        of :mod:`hcpasses.kernels.inductor_lowering` launches the kernel.
        """
        from torch._inductor.utils import run_and_get_code
        from torch.export._trace import _disable_custom_triton_op_functional_decomposition

        torch._dynamo.reset()
        streams, gates, _ = Case(300, 2560, 4, torch.bfloat16, 11, 0, 2, 1, 1).inputs(op, "cuda")
        fn = torch.compile(lambda a, b: OPS[op][0](a, b, 4), fullgraph=True)
        ctx = _disable_custom_triton_op_functional_decomposition() if post_grad else contextlib.nullcontext()
        with ctx, torch._inductor.config.patch(force_disable_caches=True):  # the keys do not see ctx
            got, codes = run_and_get_code(fn, streams, gates)
        code = "\n".join(codes)
        assert "_collapse_quant_kernel" in code and "torch.ops.hcpasses" not in code, code[-3000:]
        for g, want in zip(got, OPS[op][0](streams, gates, 4), strict=True):
            assert torch.equal(g.view(torch.uint8), want.view(torch.uint8))

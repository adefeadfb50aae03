"""The per-token quant found by evaluation (hcpasses/patterns/quant_evaluation.py): spellings that give the
contract's codes and scales bit for bit on every probe are matched whatever ops they use; a spelling that differs
anywhere is a near miss named by the probe that separated it, and the fusion leaves it alone."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from corpus.gated_residual import UserHC
from harness import passes_run_every_compile
from harness.reference import fused_op_count
from torch.fx.experimental.proxy_tensor import make_fx

import hcpasses
from hcpasses.kernels.contract import per_token_quant
from hcpasses.patterns.quant_evaluation import NearMiss, NotAQuant, QuantMatch, judge_quant, probe_rows

FP8 = torch.float8_e4m3fn


def contract_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_quant(x)


def upcast_first_maximum_floor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's reference style in a bf16 model: one ``x.float()`` feeds the amax and the division; the floor as
    ``torch.maximum`` with a tensor constant (no pattern of ours is written so)."""
    xf = x.float()
    scale = torch.maximum(xf.abs().amax(dim=-1, keepdim=True) / 448.0, torch.tensor(1.0 / (448 * 512)))
    return (xf / scale).clamp(-448.0, 448.0).to(FP8), scale


def reciprocal_multiply(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / 448.0, min=1 / (448 * 512))
    return (xf * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8), scale


def unsigned_zeros(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros written as +0: the codes of -0.0 inputs differ (0x00 for 0x80), nothing else does."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / 448.0, min=1 / (448 * 512))
    return torch.where(xf == 0, 0.0, (xf / scale).clamp(-448.0, 448.0)).to(FP8), scale


def other_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / 447.0, min=1 / (448 * 512))
    return (xf / scale).clamp(-448.0, 448.0).to(FP8), scale


def traced(fn, dtype: torch.dtype, shape: tuple[int, ...] = (6, 32)) -> tuple[fx.Node, fx.Node, fx.GraphModule]:
    """``fn`` traced to ATen with fake values; (its input, its FP8 cast, the module)."""
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(shape, dtype=dtype))
    [source] = [n for n in gm.graph.nodes if n.op == "placeholder"]
    [cast] = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == FP8]
    return source, cast, gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fn", [contract_quant, upcast_first_maximum_floor], ids=lambda f: f.__name__)
def test_spellings_of_the_contract_are_matched(fn, dtype: torch.dtype) -> None:
    source, cast, _ = traced(fn, dtype)
    judgement = judge_quant(source, cast)
    assert isinstance(judgement, QuantMatch), judgement
    assert judgement.probes == len(probe_rows(32, dtype)) and judgement.codes is cast


@pytest.mark.parametrize(
    ("fn", "probe"),
    [
        (reciprocal_multiply, "ties between FP8 codes"),
        (unsigned_zeros, "negative zeros"),
        (other_max, "mixed magnitudes"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_near_misses_name_the_probe_that_separates_them(fn, probe: str, dtype: torch.dtype) -> None:
    source, cast, _ = traced(fn, dtype)
    judgement = judge_quant(source, cast)
    assert isinstance(judgement, NearMiss), judgement
    assert judgement.probe == probe and "where the contract gives" in judgement.detail


def test_probes_are_what_they_say() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        probes = probe_rows(40, dtype)
        assert all(rows.dtype == dtype and rows.shape[-1] == 40 for rows in probes.values())
        assert not probes["all-zero rows"].any()
        assert torch.signbit(probes["negative zeros"]).logical_and(probes["negative zeros"] == 0).any()
        _, scale = per_token_quant(probes["amax on the scale floor"])
        assert torch.all(scale == 1.0 / (448.0 * 512.0))


def test_a_cast_of_another_input_is_no_quant_of_the_source() -> None:
    def two_inputs(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = per_token_quant(x + y)
        return q, scale

    gm = make_fx(two_inputs, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 8))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    cast = next(n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == FP8)
    judgement = judge_quant(x, cast)
    assert isinstance(judgement, NotAQuant) and "besides" in judgement.why


def quant_behind_a_row_regroup(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' MoE: ``view(-1, hidden)`` of ``[batch, seq, hidden]`` before the shared expert's quant."""
    return per_token_quant(x.view(-1, x.shape[-1]))


def amax_over_batch_and_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per sequence position shared by the batch: per-token only when the batch is 1."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(dim=(0, -1), keepdim=True) / 448.0, min=1 / (448 * 512))
    return (xf / scale).clamp(-448.0, 448.0).to(FP8), scale


@pytest.mark.parametrize("shape", [(2, 8, 32), (2, 4096, 256)], ids=["graph sizes", "shrunk probe"])
def test_a_quant_behind_a_regrouping_of_token_rows_is_matched(shape: tuple[int, ...]) -> None:
    """Above MAX_PROBE_ELEMENTS the probe has 16 rows: the regrouping is spelled anew for them."""
    source, cast, _ = traced(quant_behind_a_row_regroup, torch.bfloat16, shape)
    judgement = judge_quant(source, cast)
    assert isinstance(judgement, QuantMatch), judgement
    assert any(n.target is torch.ops.aten.view.default for n in judgement.nodes)


def test_a_reduction_over_token_rows_is_not_probed_on_fewer_rows() -> None:
    """Probe rows have leading dims of 1, on which an amax over the batch looks per-token: refused, not matched."""
    judgement = judge_quant(*traced(amax_over_batch_and_row, torch.float32, (2, 4096, 256))[:2])
    assert isinstance(judgement, NotAQuant) and "mixes token rows" in judgement.why, judgement
    # at the graph's own sizes the probes separate it
    assert isinstance(judge_quant(*traced(amax_over_batch_and_row, torch.float32, (2, 8, 32))[:2]), NearMiss)


class QuantisedHC(UserHC):
    """An independently written HC model whose sub-layers read their input through ``quant``."""

    def __init__(self, quant, dtype: torch.dtype) -> None:
        super().__init__("rsqrt", 1, None, dtype)
        self.quant = quant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids].repeat(1, self.n)
        for block, sublayer in zip(self.blocks, self.sublayers, strict=True):
            x, inject = block(h)
            q, scale = self.quant(x)
            h = block.combine(h, sublayer((q.float() * scale).to(x.dtype)), inject)
        return F.linear(self.final(h)[0], self.head)


def compile_and_run(model: torch.nn.Module, ids: torch.Tensor) -> tuple:
    torch._dynamo.reset()
    be = hcpasses.backend()
    graphs: list[fx.GraphModule] = []
    record = lambda graph: graphs.append(fx.GraphModule(torch.nn.Module(), graph))  # noqa: E731
    with torch.no_grad(), passes_run_every_compile():
        with torch._inductor.config.patch(post_grad_custom_post_pass=record):
            out = torch.compile(model, backend=be)(ids)
        expected = model(ids)
    return be.reports[0], graphs[0], out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_unpatterned_spelling_of_the_quant_fuses_by_evaluation(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = QuantisedHC(upcast_first_maximum_floor, dtype)
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(7))
    report, graph, out, expected = compile_and_run(model, ids)
    assert report.applied["gated_mean_quant"] == 2 == fused_op_count(graph), report
    assert "of them matched by evaluation (7 probes): 2" in report.record("gated_mean_quant").notes, report
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # as tests/test_corpus_fusion.py: bf16 eager rounds more often
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_a_near_miss_is_left_unfused_and_the_report_names_its_probe() -> None:
    torch.manual_seed(0)
    model = QuantisedHC(reciprocal_multiply, torch.float32)
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(7))
    report, graph, out, expected = compile_and_run(model, ids)
    assert report.applied["gated_mean_quant"] == 0 == fused_op_count(graph), report
    reason = report.record("gated_mean_quant").reason
    assert reason.count("near miss of the per-token quant") == 2 and "'ties between FP8 codes'" in reason, reason
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_probes_run_on_the_device_and_the_quant_fuses_by_evaluation() -> None:
    """The probes run where the graph runs (a CUDA division by a Python scalar may round otherwise than CPU's)."""
    torch.manual_seed(0)
    model = QuantisedHC(upcast_first_maximum_floor, torch.bfloat16).cuda()
    ids = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(7)).cuda()
    report, graph, out, expected = compile_and_run(model, ids)
    assert report.applied["gated_mean_quant"] == 2 == fused_op_count(graph), report
    assert "of them matched by evaluation (7 probes): 2" in report.record("gated_mean_quant").notes, report
    torch.testing.assert_close(out.float(), expected.float(), rtol=5e-2, atol=5e-2)

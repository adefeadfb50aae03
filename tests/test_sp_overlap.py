"""Overlap (``hcpasses.passes.sp_rewrite.overlap``): SP's collectives in the form Inductor's micro-pipeline TP fuses.

Where symmetric memory cannot work (here: no CUDA; a fake, gloo or one-rank group) the flag changes nothing and the
report says why; the backend leaves Inductor's pass off. With the capability pretended (``overlap_blocker`` patched
to find none), the shaped graph gives SP off's and eager's values at a ragged and an even T, and Inductor's own pass
(``micro_pipeline_tp_pass`` under ``torch.distributed._symmetric_memory._test_mode``, with NCCL's availability
patched: private APIs, pinned here) fuses every gathered sub-layer input with its GEMMs and every reduce-scatter
with its GEMM, FP8 ``_scaled_mm`` projections and ``[batch, seq]`` tokens included; at a ragged T without the
shaping it fuses none. A symbolic T is left unshaped: the fused ops' meta functions refuse symbolic sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import fake_process_group, simulate
from harness.reference import (
    RankGraphs,
    assert_ranks_near_eager,
    assert_same_as_sp_off,
    capture_with_passes,
    collective_counts,
)
from harness.toy import BatchedHCModel
from torch._inductor.fx_passes import micro_pipeline_tp
from torch.distributed import _symmetric_memory

import hcpasses.passes.sp_rewrite as sp_rewrite
from hcpasses.backend import MICRO_PIPELINE_TP, HCPassesBackend
from hcpasses.config import HCPassesConfig
from hcpasses.fp8 import Fp8Linear
from hcpasses.passes.sp_rewrite.overlap import overlap_blocker
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.verify import refresh_fake_values

LAYERS = 2
SYMM_MEM_OPS = {
    "symm_mem.fused_all_gather_matmul.default",
    "symm_mem.fused_all_gather_scaled_matmul.default",
    "symm_mem.fused_matmul_reduce_scatter.default",
}


def model_config(fp8: bool) -> HCConfig:
    dtype = torch.bfloat16 if fp8 else torch.float32
    return HCConfig.tiny(n_layers=LAYERS, fp8=fp8, dtype=dtype, intermediate=96, seed=5)


def capture(tokens: int, fp8: bool = False, overlap: bool = True) -> tuple[RankGraphs, torch.Tensor]:
    cfg = model_config(fp8)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    config = HCPassesConfig(sp_min_tokens=1, overlap=overlap)
    return capture_with_passes(lambda r, n: HCDecoder(cfg), lambda r, n: (ids,), 2, config, one_trace=True), ids


def fused_by_inductor(graphs: RankGraphs, monkeypatch) -> dict[str, int]:
    """Inductor's micro-pipeline TP pass on a copy of rank 0's graph, as if symmetric memory were enabled; the fused
    graph's values then propagate through the fused ops' meta functions (dtypes and shapes they accept: FP8 codes
    gathered as bytes failed here, uint8 into ``_scaled_mm``)."""
    graph = copy.deepcopy(graphs.graphs[0]).graph
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with _symmetric_memory._test_mode():
        micro_pipeline_tp.micro_pipeline_tp_pass(graph)
    with fake_process_group(0, 2):  # the fused ops' meta functions ask the group its size
        refresh_fake_values(graph)
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if str(node.target).startswith("symm_mem."):
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return counts


@pytest.fixture
def capable_groups(monkeypatch) -> None:
    """Every group counts as NCCL on CUDA with > 1 rank: what this machine cannot give."""
    monkeypatch.setattr(sp_rewrite, "overlap_blocker", lambda group_name: None)


@pytest.fixture
def scaled_mm_on_cpu(monkeypatch) -> None:
    """Fp8Linear takes its CUDA path (a row-wise ``_scaled_mm``), which runs on CPU too."""
    monkeypatch.setattr(Fp8Linear, "_use_scaled_mm", lambda self, x: x.dtype == torch.bfloat16)


def test_overlap_is_off_without_cuda_and_changes_nothing() -> None:
    on, _ = capture(9)
    off, _ = capture(9, overlap=False)
    assert on.graphs[0].code == off.graphs[0].code
    record = on.report.record("sp_rewrite")
    assert "overlap over group '0' (rank 0 of 2): off: no CUDA device (symmetric memory needs GPUs)" in record.notes
    assert record.facts["gemms_after_gathers"] == record.facts["gemms_before_scatters"] == 0
    assert "overlap over group '0' (rank 0 of 2): off: flag overlap=False" in off.report.record("sp_rewrite").notes
    backend = HCPassesBackend(HCPassesConfig())
    assert MICRO_PIPELINE_TP not in backend.inductor_config(backend.manager)


def test_the_blocker_names_the_backend_and_the_size(monkeypatch) -> None:
    assert overlap_blocker("0") == "no CUDA device (symmetric memory needs GPUs)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with fake_process_group(0, 2):
        name = dist.group.WORLD.group_name
        assert overlap_blocker(name) == f"group '{name}' runs on fake (symmetric memory needs NCCL)"
        monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
        assert overlap_blocker(name) is None
        monkeypatch.setattr(dist, "get_world_size", lambda group: 1)
        assert overlap_blocker(name) == f"group '{name}' has one rank"


@pytest.mark.usefixtures("capable_groups")
@pytest.mark.parametrize("tokens", [9, 8], ids=["ragged", "even"])
def test_shaped_graph_is_exact_and_inductor_fuses_every_collective(tokens: int, monkeypatch) -> None:
    graphs, ids = capture(tokens)
    record = graphs.report.record("sp_rewrite")
    # per layer: attention's qkv and the MLP's gate_up read the gathered x; o_proj and down feed the scatters; the
    # lm_head reads the gathered final norm (it runs on the shards: as many bytes as the final mixer's output)
    assert record.facts["gemms_after_gathers"] == 2 * LAYERS + 1, record.notes
    assert record.facts["gemms_before_scatters"] == 2 * LAYERS, record.notes
    assert collective_counts(graphs.graphs[0]) == {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 5}
    unsharded = graphs.sp_off()
    with torch.no_grad():
        eager = HCDecoder(model_config(False))(ids)
    outputs = simulate(graphs.graphs, graphs.inputs)
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want, eager=[eager])
        torch.testing.assert_close(got[0], eager, rtol=1e-4, atol=1e-4)
    fused = fused_by_inductor(graphs, monkeypatch)
    assert fused == {
        "symm_mem.fused_all_gather_matmul.default": 2 * LAYERS + 1,
        "symm_mem.fused_matmul_reduce_scatter.default": 2 * LAYERS,
    }


def test_without_the_shaping_a_ragged_t_fuses_nothing(monkeypatch) -> None:
    graphs, _ = capture(9, overlap=False)
    assert fused_by_inductor(graphs, monkeypatch) == {}


@pytest.mark.usefixtures("capable_groups", "scaled_mm_on_cpu")
def test_fp8_codes_gather_into_the_scaled_gemms() -> None:
    """bf16 FP8 model, projections as ``_scaled_mm`` reading the gathered codes and their row-wise scales: the
    codes' gathers are shaped and send FP8 (not bytes; the scales' gathers stay: Inductor's fused op takes them
    replicated)."""
    graphs, ids = capture(9, fp8=True)
    record = graphs.report.record("sp_rewrite")
    # the FP8 projections' gathered codes, and the bf16 lm_head's gathered final norm
    assert record.facts["gemms_after_gathers"] == 2 * LAYERS + 1 and record.facts["gemms_before_scatters"] == 2 * LAYERS
    unsharded = graphs.sp_off()
    with torch.no_grad():
        eager = HCDecoder(model_config(True))(ids)
    outputs = simulate(graphs.graphs, graphs.inputs)
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want, fp8=True)
    assert_ranks_near_eager(graphs, outputs, eager, torch.bfloat16, fp8=True)


def test_fp8_fusion_by_inductor(monkeypatch, capable_groups, scaled_mm_on_cpu) -> None:
    graphs, _ = capture(9, fp8=True)
    fused = fused_by_inductor(graphs, monkeypatch)
    assert set(fused) <= SYMM_MEM_OPS
    assert fused.get("symm_mem.fused_all_gather_scaled_matmul.default") == 2 * LAYERS, fused


def capture_batched(dynamic: bool) -> tuple[RankGraphs, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    config = HCPassesConfig(sp_min_tokens=1)
    graphs = capture_with_passes(batched_model, lambda r, n: (ids,), 2, config, dynamic=dynamic, one_trace=True)
    return graphs, ids


def batched_model(rank: int = 0, size: int = 1) -> BatchedHCModel:
    """Built under the rank's group: its TP MLPs read the rank and size then."""
    return BatchedHCModel(HCConfig.tiny(n_layers=LAYERS, intermediate=96, seed=5), None, False)


@pytest.mark.usefixtures("capable_groups")
def test_batch_seq_tokens_are_shaped_through_their_reshapes(monkeypatch) -> None:
    """``[batch, seq, S]`` values (transformers' layout): the GEMMs read the gathered rows through the reshape to
    ``[T, S]``; the final x's gather feeds the lm_head as well (5 GEMMs after gathers)."""
    graphs, ids = capture_batched(dynamic=False)
    record = graphs.report.record("sp_rewrite")
    assert (record.facts["gemms_after_gathers"], record.facts["gemms_before_scatters"]) == (5, 4), record.notes
    unsharded = graphs.sp_off()
    with torch.no_grad():
        eager = batched_model()(ids)
    outputs = simulate(graphs.graphs, graphs.inputs)
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want, eager=[eager])
    fused = fused_by_inductor(graphs, monkeypatch)
    assert fused == {
        "symm_mem.fused_all_gather_matmul.default": 5,
        "symm_mem.fused_matmul_reduce_scatter.default": 4,
    }


@pytest.mark.usefixtures("capable_groups")
def test_a_symbolic_token_count_is_not_shaped(monkeypatch) -> None:
    """Fused, a graph with a symbolic T would not compile (the symm_mem ops' meta functions refuse symbolic sizes,
    seen by propagating such a fused graph): SP leaves it unshaped, says why, and Inductor's pass fuses nothing."""
    graphs, _ = capture_batched(dynamic=True)
    record = graphs.report.record("sp_rewrite")
    assert record.facts["gemms_after_gathers"] == record.facts["gemms_before_scatters"] == 0
    [note] = [note for note in record.notes if note.startswith("overlap")]
    assert "off: symbolic token count" in note and "need static sizes" in note, note
    assert fused_by_inductor(graphs, monkeypatch) == {}

"""``benchmarks/prefill_sp.py --kernels``: kernels summed by name and kind per forward, the variants side by side."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # benchmarks/ is not a package
    import prefill_sp

    return prefill_sp


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("triton_poi_fused_add_mul_0", "triton pointwise"),
        ("triton_red_fused_mean_1", "triton reduction"),
        ("triton_per_fused_sum_2", "triton reduction"),
        ("triton_tem_fused_mm_3", "triton template"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "library GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "library GEMM"),
        ("aten::mm", "library GEMM"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernel_kind_reads_the_kind_from_the_name(bench: ModuleType, name: str, kind: str) -> None:
    assert bench.kernel_kind(name) == kind


def test_kernel_profile_sums_per_forward_by_name_and_kind(bench: ModuleType) -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    calls = []

    def step(i: int) -> torch.Tensor:
        calls.append(i)
        return torch.mm(a, b) + torch.mm(b, a)  # two GEMMs and one add per forward

    profile = bench.kernel_profile(step, 3, torch.device("cpu"))
    assert calls == [0, 1, 2]
    names = {entry["name"]: entry for entry in profile["by_name"]}
    assert names["aten::mm"]["launches"] == pytest.approx(2) and names["aten::add"]["launches"] == pytest.approx(1)
    assert profile["by_kind_us"]["library GEMM"] > 0
    assert profile["total_us"] == pytest.approx(sum(profile["by_kind_us"].values()))
    assert profile["launches"] == pytest.approx(sum(entry["launches"] for entry in profile["by_name"]))
    assert [e["us"] for e in profile["by_name"]] == sorted((e["us"] for e in profile["by_name"]), reverse=True)


def test_kernel_table_puts_the_variants_side_by_side(bench: ModuleType) -> None:
    def profile(gemm: float, copy: float) -> dict:
        return {"total_us": gemm + copy, "launches": 3, "by_kind_us": {"library GEMM": gemm, "copy": copy}}

    summary = {
        "points": [
            {"point": "1024x16", "variants": {"a": {"kernel_profile_rank0": profile(10.0, 2.0)}, "b": {}}},
            {"point": "64x1", "variants": {"a": {}}},  # no profile at this point: no lines
        ]
    }
    header, copy, gemm, total = bench.kernel_table(summary)
    assert "1024x16" in header and header.rstrip().endswith("a") and " b" not in header
    assert copy.split() == ["copy", "2.0"] and gemm.split() == ["library", "GEMM", "10.0"]
    assert total.split()[-3:] == ["12.0", "(", "3)"]

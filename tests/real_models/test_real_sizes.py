"""The real-size builders (``hcpasses.testing.hf_models.real_*``), checked on the meta device: the published
shapes, the layer patterns, the experts implementation per device and the errors. Running them takes a GPU
(``tests/test_gpu.py::test_real_size_models_compile_and_count_exactly_on_cuda``)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config

from hcpasses.testing.hf_models import experts_for, real_deepseek_v4, real_qwen4_exp


def shapes(model: torch.nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
    return {name[len(prefix) :]: tuple(p.shape) for name, p in model.named_parameters() if name.startswith(prefix)}


def test_qwen4_exp_has_the_real_hc_sizes_and_layer_pattern() -> None:
    model = real_qwen4_exp(4, device="meta")
    assert model.config.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]
    assert model.config.ple_layer_ids == [2] and model.config._experts_implementation == "batched_mm"
    layer = shapes(model, "model.layers.0.")
    # n * S = 4 * 2560 streams, rank 320, a scalar inject per stream
    assert layer["attn_hyper_connection.input_mix_weight_down.weight"] == (320, 4 * 2560)
    assert layer["attn_hyper_connection.block_inject_weight.weight"] == (4, 4 * 2560)
    assert layer["mlp.experts.gate_up_proj"] == (32, 2 * 512, 2560)  # 32 experts of 512
    assert layer["linear_attn.in_proj_z.weight"] == (32 * 128, 2560)  # 32 value heads of 128
    attention = shapes(model, "model.layers.3.self_attn.")
    assert attention["q_proj.weight"] == (2 * 16 * 256, 2560)  # 16 heads of 256, gated
    assert attention["k_proj.weight"] == (2 * 256, 2560)  # 2 KV heads
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_deepseek_v4_has_the_published_shapes_for_any_layer_count() -> None:
    published = DeepseekV4Config()
    model = real_deepseek_v4(3, device="meta", dtype=torch.float32)
    assert model.config.layer_types == published.layer_types[:3]
    assert model.config.mlp_layer_types == published.mlp_layer_types[:3]
    assert model.config.num_nextn_predict_layers == 0
    layer = shapes(model, "model.layers.0.")
    assert layer["mlp.experts.gate_up_proj"] == (256, 2 * 2048, 4096)
    assert layer["self_attn.q_b_proj.weight"] == (64 * 512, 1024)
    assert layer["attn_hc.fn"] == (24, 4 * 4096)  # mHC: n = 4 streams of 4096


def test_experts_implementation_per_device_and_layer_count_errors() -> None:
    assert experts_for("cuda") == experts_for(torch.device("cuda", 1)) == "grouped_mm"
    assert experts_for("cpu") == experts_for("meta") == "batched_mm"
    with pytest.raises(ValueError, match="at least 1"):
        real_qwen4_exp(0, device="meta")
    with pytest.raises(ValueError, match="has 43 layers"):
        real_deepseek_v4(44, device="meta")

"""hcpasses.hf.fp8_swap: PTPC-FP8 sub-layer input projections on the transformers HC models."""

from __future__ import annotations

import pytest
import torch
from hf_cases import FAMILIES, ONE_LAYER, logits, relative_error, token_ids
from torch import nn

from hcpasses.hf import swap_fp8_linears
from hcpasses.testing.hf_models import tiny_deepseek_v4, tiny_qwen4_exp
from hcpasses.testing.models.fp8 import Fp8Linear

QWEN_SUBLAYER_INPUTS = {
    "linear_attention": [f"linear_attn.in_proj_{part}" for part in ("qkv", "z", "b", "a")],
    "indexed_attention": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
}
DEEPSEEK_SHARED_EXPERT = ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]


def test_qwen4_exp_default_selection() -> None:
    model = tiny_qwen4_exp()
    expected = [
        f"model.layers.{i}.{suffix}"
        for i, kind in enumerate(model.config.layer_types)
        for suffix in [*QWEN_SUBLAYER_INPUTS[kind], "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
    ]
    assert swap_fp8_linears(model) == expected
    assert all(isinstance(model.get_submodule(name), Fp8Linear) for name in expected)
    # Routing and scoring stay in high precision: router, shared-expert gate, QSA indexer.
    assert type(model.model.layers[0].mlp.shared_expert_gate) is nn.Linear
    assert type(model.model.layers[3].self_attn.indexer.index_qk_proj) is nn.Linear


def test_deepseek_v4_default_selection() -> None:
    model = tiny_deepseek_v4()
    expected = [
        f"model.layers.{i}.{suffix}"
        for i in range(model.config.num_hidden_layers)
        for suffix in ["self_attn.q_a_proj", "self_attn.kv_proj", *DEEPSEEK_SHARED_EXPERT]
    ]
    assert swap_fp8_linears(model) == expected
    # Compressor and indexer projections ship in BF16 in the DeepSeek-V4 FP8 checkpoint: not swapped.
    assert type(model.model.layers[1].self_attn.compressor.kv_proj) is nn.Linear


@pytest.mark.parametrize(("dtype", "batch"), [(torch.float32, 2), (torch.bfloat16, 1)])
def test_logits_stay_close_to_the_high_precision_model(family: str, dtype: torch.dtype, batch: int) -> None:
    ids = token_ids(batch, seed=5)
    reference = logits(FAMILIES[family](dtype=dtype), ids)
    model = FAMILIES[family](dtype=dtype)
    swap_fp8_linears(model)
    out = logits(model, ids)
    assert out.dtype == dtype
    # e4m3 keeps 3 mantissa bits; a few quantised GEMMs per layer land within a few percent.
    assert relative_error(out, reference) < 0.1


def test_custom_selector_and_no_second_swap() -> None:
    model = tiny_qwen4_exp()
    assert swap_fp8_linears(model, lambda name, linear: name.endswith(".k_proj")) == ["model.layers.3.self_attn.k_proj"]
    with pytest.raises(ValueError, match=r"no nn\.Linear selected"):
        swap_fp8_linears(model, lambda name, linear: name.endswith(".k_proj"))


def test_nothing_selected_raises() -> None:
    with pytest.raises(ValueError, match=r"no nn\.Linear selected for FP8"):
        swap_fp8_linears(nn.Sequential(nn.Linear(4, 4)))


def test_bias_is_kept() -> None:
    model = tiny_qwen4_exp(attention_bias=True)
    ids = token_ids(1)
    reference = logits(model, ids)
    swap_fp8_linears(model, lambda name, linear: name.endswith("self_attn.v_proj"))
    assert relative_error(logits(model, ids), reference) < 0.1


def test_quant_constants_are_graph_literals(family: str) -> None:
    """The fusion pattern matches ``amax / 448`` and the ``1/(448*512)`` floor: they must be constants in the
    traced graph, not graph inputs, also with a symbolic sequence length."""
    model = FAMILIES[family](**ONE_LAYER[family])
    swap_fp8_linears(model)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True)(token_ids(2))
    arguments = [arg for gm in graphs for node in gm.graph.nodes for arg in (*node.args, *node.kwargs.values())]
    constants = {arg for arg in arguments if isinstance(arg, float)}
    assert {448.0, 1.0 / (448.0 * 512.0)} <= constants

"""hcpasses.testing.hf_models: the tiny transformers HC models build deterministically and run eagerly."""

from __future__ import annotations

import pytest
import torch
from hf_cases import FAMILIES, SEQ, logits, relative_error, token_ids

from hcpasses.testing.hf_models import tiny_deepseek_v4, tiny_qwen4_exp


def test_same_seed_same_weights_other_seed_other_weights(family: str) -> None:
    build = FAMILIES[family]
    first, again, other = build(seed=3).state_dict(), build(seed=3).state_dict(), build(seed=4).state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_building_leaves_the_global_rng_alone(family: str) -> None:
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    FAMILIES[family]()
    assert torch.equal(torch.rand(3), expected)


def test_no_parameter_is_left_constant(family: str) -> None:
    model = FAMILIES[family]()
    constant = [name for name, p in model.named_parameters() if p.numel() > 1 and bool((p == p.flatten()[0]).all())]
    assert constant == []


def test_qwen4_exp_structure() -> None:
    model = tiny_qwen4_exp()
    config, layers = model.config, model.model.layers
    assert config.hc_count == 4
    assert {layer.layer_type for layer in layers} == {"linear_attention", "indexed_attention"}
    assert [i for i, layer in enumerate(layers) if layer.ple is not None] == [1]  # the checkpoint's layers.1
    assert layers[1].ple.conv1d.weight.abs().min() > 0  # zero-initialised by transformers, re-drawn here
    assert config._experts_implementation == "batched_mm"
    assert config._attn_implementation == "sdpa"


def test_deepseek_v4_structure() -> None:
    model = tiny_deepseek_v4()
    config = model.config
    assert config.hc_mult == 4
    assert set(config.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(config.mlp_layer_types) == {"hash_moe", "moe"}
    routes = model.model.layers[0].mlp.gate.tid2eid
    assert bool((routes[:, 0] != routes[:, 1]).all())  # each token goes to two distinct experts
    assert config._experts_implementation == "batched_mm"
    assert config._attn_implementation == "eager"


def test_bf16_keeps_the_fp32_modules_transformers_keeps() -> None:
    model = tiny_deepseek_v4(dtype=torch.bfloat16)
    layer = model.model.layers[0]
    assert layer.attn_hc.fn.dtype == torch.float32
    assert layer.self_attn.sinks.dtype == torch.float32
    assert layer.self_attn.q_b_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_forward_fp32_and_bf16(family: str, batch: int) -> None:
    ids = token_ids(batch)
    reference = logits(FAMILIES[family](), ids)
    assert reference.shape == (batch, SEQ, 128)
    assert bool(torch.isfinite(reference).all())
    low = logits(FAMILIES[family](dtype=torch.bfloat16), ids)
    assert low.dtype == torch.bfloat16
    assert relative_error(low, reference) < 0.05  # the bf16 model is the fp32 model cast


def test_batch_rows_are_independent(family: str) -> None:
    ids = token_ids(2)
    model = FAMILIES[family]()
    both = logits(model, ids)
    torch.testing.assert_close(both[1:], logits(model, ids[1:]), atol=1e-5, rtol=1e-5)

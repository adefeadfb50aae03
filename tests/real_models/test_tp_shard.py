"""hcpasses.hf.tp_shard: sharded eager models on 2 gloo ranks give the single-device logits."""

from __future__ import annotations

import pytest
import torch
from hf_cases import FAMILIES, logits, token_ids

from hcpasses.hf import shard_for_tp, swap_fp8_linears
from hcpasses.testing.hf_models import tiny_deepseek_v4, tiny_qwen4_exp
from hcpasses.testing.models.fp8 import Fp8Linear
from hcpasses.testing.multiproc import run_ranks

BATCHES = (1, 2)


def sharded_logits(rank: int, world_size: int, family: str, fp8: bool) -> list[torch.Tensor]:
    """On one rank: the sharded model's logits for each batch size (default process group, no explicit rank)."""
    model = FAMILIES[family]()
    if fp8:
        swap_fp8_linears(model)
    shard_for_tp(model)
    return [logits(model, token_ids(batch, seed=batch)) for batch in BATCHES]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_two_gloo_ranks_match_one_device(family: str, fp8: bool) -> None:
    model = FAMILIES[family]()
    if fp8:
        swap_fp8_linears(model)
    expected = [logits(model, token_ids(batch, seed=batch)) for batch in BATCHES]
    for rank_logits in run_ranks(sharded_logits, 2, family, fp8, timeout_s=240.0):
        for actual, reference in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)


def test_qwen4_exp_shapes_on_rank_1_of_2() -> None:
    model = shard_for_tp(tiny_qwen4_exp(), tp_rank=1, tp_size=2)
    reference = tiny_qwen4_exp()
    gdn, full = model.model.layers[0].linear_attn, reference.model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads) == (1, 2)
    assert gdn.conv1d.weight.shape[0] == gdn.in_proj_qkv.weight.shape[0] == full.conv_dim // 2
    # Rank 1 keeps the second half of each of q, k and v: the k part starts at key_dim in the full layout.
    torch.testing.assert_close(gdn.in_proj_qkv.weight[gdn.key_dim], full.in_proj_qkv.weight[full.key_dim + gdn.key_dim])
    torch.testing.assert_close(gdn.A_log, full.A_log[2:])
    attn = model.model.layers[3].self_attn
    assert attn.q_proj.weight.shape[0] == reference.model.layers[3].self_attn.q_proj.weight.shape[0] // 2
    assert attn.o_proj.weight.shape[1] == attn.q_proj.weight.shape[0] // 2  # o reads heads, q also has gates
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[1] == experts.down_proj.shape[2] * 2 == 16


def test_hc_blocks_norms_and_embeddings_stay_replicated(family: str) -> None:
    replicated = ("hyper_connection", "attn_hc", "ffn_hc", "hc_head", "norm", "embed", "ple", "lm_head", ".gate.")
    reference = FAMILIES[family]().state_dict()
    model = shard_for_tp(FAMILIES[family](), tp_rank=0, tp_size=2)
    kept = [name for name in reference if any(part in name for part in replicated)]
    assert kept
    for name in kept:
        assert torch.equal(model.state_dict()[name], reference[name]), name


def test_deepseek_v4_head_groups_and_sinks() -> None:
    model = shard_for_tp(tiny_deepseek_v4(), tp_rank=1, tp_size=2)
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == attn.num_key_value_groups == 2
    assert attn.config.o_groups == attn.o_a_proj.n_groups == 1
    assert model.config.o_groups == 2  # only the attention module's own config copy describes the shard
    torch.testing.assert_close(attn.sinks, tiny_deepseek_v4().model.layers[0].self_attn.sinks[2:])


def test_fp8_input_projections_are_split_by_output_channel() -> None:
    model = tiny_qwen4_exp()
    swap_fp8_linears(model)
    full = model.model.layers[0].mlp.shared_expert.gate_proj.weight_q.clone()
    shard_for_tp(model, tp_rank=1, tp_size=2)
    proj = model.model.layers[0].mlp.shared_expert.gate_proj
    assert isinstance(proj, Fp8Linear)
    assert torch.equal(proj.weight_q.view(torch.uint8), full[8:].view(torch.uint8))


def test_indivisible_sizes_name_the_size(family: str) -> None:
    with pytest.raises(ValueError, match="not divisible by tp = 3"):
        shard_for_tp(FAMILIES[family](), tp_rank=0, tp_size=3)


def test_needs_a_process_group_or_explicit_tp() -> None:
    with pytest.raises(ValueError, match="pass tp_rank and tp_size"):
        shard_for_tp(tiny_qwen4_exp())


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="no sub-layer that shard_for_tp knows"):
        shard_for_tp(torch.nn.Sequential(torch.nn.Linear(4, 4)), tp_rank=0, tp_size=2)


def test_tp_1_is_a_no_op() -> None:
    model = tiny_qwen4_exp()
    assert shard_for_tp(model, tp_rank=0, tp_size=1) is model
    assert model.model.layers[0].linear_attn.num_v_heads == 4

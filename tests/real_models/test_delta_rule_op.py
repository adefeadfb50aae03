"""``hcpasses.hf.delta_rule_op``: transformers' chunked delta rule as one custom op under ``torch.compile``.

On CPU the op's body runs transformers' torch reference (flash-linear-attention needs CUDA); the GPU run of
``benchmarks/prefill_hf.py`` shows it running fla's kernels. The SP test with the op in the graph is
``test_sp_real.py::test_sp_shards_every_hc_block_and_matches_one_device`` (its ``delta_rule_op`` case).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hf_cases import FAMILIES, ONE_LAYER, GraphRecorder, token_ids
from transformers.models.qwen4_exp import modeling_qwen4_exp

from hcpasses.hf import delta_rule_as_one_op, eager_kernels_under_compile

MODULE = "transformers.models.qwen4_exp.modeling_qwen4_exp"
OP = torch.ops.hcpasses.chunk_gated_delta_rule
TWO_LINEAR_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2, "ple_layer_ids": [1]}


def delta_rule_inputs(
    batch: int = 2, tokens: int = 70, heads: int = 2, value_heads: int = 4, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random (query, key, value, g, beta) with the shapes and ranges GatedDeltaNet passes (g <= 0, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(batch, tokens, heads, 8, generator=gen) for _ in range(2))
    value = torch.randn(batch, tokens, value_heads, 16, generator=gen)
    g = -torch.rand(batch, tokens, value_heads, generator=gen)
    beta = torch.rand(batch, tokens, value_heads, generator=gen)
    # the torch reference expects as many key heads as value heads (the model repeats them before the call)
    query, key = (t.repeat_interleave(value_heads // heads, dim=2) for t in (query, key))
    return query, key, value, g, beta


def test_compiled_model_is_one_graph_with_one_op_per_linear_attention_layer() -> None:
    model = FAMILIES["qwen4_exp"](**TWO_LINEAR_LAYERS)
    ids = token_ids(2, seed=3)
    with torch.no_grad():
        expected = model(ids).logits
    recorder = GraphRecorder()
    one_layer = FAMILIES["qwen4_exp"](**ONE_LAYER["qwen4_exp"])
    torch._dynamo.reset()
    with eager_kernels_under_compile() as patched, torch.no_grad():
        recorded = torch.compile(model, backend=recorder)(ids).logits
        torch._dynamo.reset()
        # Inductor calls the op as an extern kernel (one layer: half the compile time of two)
        inductor = torch.compile(one_layer, backend="inductor")(ids).logits
        one_layer_expected = one_layer(ids).logits
    assert MODULE in patched["delta_rule_op"]
    assert len(recorder.graphs) == 1  # no break around the delta rule
    targets = [node.target for node in recorder.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(OP) == 2, targets
    assert torch.linalg.solve_triangular not in targets  # the reference is not traced
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    torch.testing.assert_close(inductor, one_layer_expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("output_final_state", [False, True])
def test_the_op_is_the_wrapper_and_its_fake_agrees(output_final_state: bool) -> None:
    query, key, value, g, beta = delta_rule_inputs()
    want, want_state = modeling_qwen4_exp.torch_chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True
    )
    args = (MODULE, query, key, value, g, beta, None, output_final_state, True, None)
    got, got_state = OP(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if output_final_state:
        assert got_state.shape == (2, 4, 8, 16) and got_state.dtype == torch.float32
        torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)
    else:
        assert want_state is None and got_state.numel() == 0
    torch.library.opcheck(OP, args, test_utils=("test_schema", "test_faketensor"))


def test_calls_the_op_does_not_cover_go_to_the_wrapper() -> None:
    query, key, value, g, beta = delta_rule_inputs(tokens=9)
    sentinel = (torch.zeros(1), None)
    wrapper = mock.Mock(return_value=sentinel)
    with mock.patch.object(modeling_qwen4_exp, "torch_chunk_gated_delta_rule", wrapper), delta_rule_as_one_op():
        delta_rule = modeling_qwen4_exp.torch_chunk_gated_delta_rule
        assert delta_rule is not wrapper and delta_rule.replaced_wrapper is wrapper
        assert delta_rule(query, key, value, g, beta, chunk_size=32) is sentinel
        assert delta_rule(query, key, value, g, beta, cp_context=object()) is sentinel
        assert wrapper.call_count == 2
        # flags the model passes along (None or False) do not stop the op; its body calls the wrapper once
        wrapper.return_value = (torch.zeros_like(value), None)
        out, state = delta_rule(query, key, value, g, beta, output_router_logits=False, position_ids=None)
        assert wrapper.call_count == 3 and state is None and out.shape == value.shape


def test_a_kernel_that_returns_other_shapes_is_an_error() -> None:
    query, key, value, g, beta = delta_rule_inputs(tokens=9)
    wrong = mock.Mock(return_value=(value[:, :, :1], None))
    with mock.patch.object(modeling_qwen4_exp, "torch_chunk_gated_delta_rule", wrong), delta_rule_as_one_op():
        with pytest.raises(RuntimeError, match=r"the kernel's output is .* expected \(2, 9, 4, 16\)"):
            modeling_qwen4_exp.torch_chunk_gated_delta_rule(query, key, value, g, beta)


def test_the_context_restores_the_wrappers_on_exit_and_on_raise() -> None:
    original = modeling_qwen4_exp.torch_chunk_gated_delta_rule
    with delta_rule_as_one_op() as patched:
        assert MODULE in patched and modeling_qwen4_exp.torch_chunk_gated_delta_rule is not original
    assert modeling_qwen4_exp.torch_chunk_gated_delta_rule is original
    with pytest.raises(KeyError), delta_rule_as_one_op():
        raise KeyError("body")
    assert modeling_qwen4_exp.torch_chunk_gated_delta_rule is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")
def test_on_cuda_the_op_runs_flash_linear_attention_as_eager_does() -> None:
    """With ``fla`` on the path (its wheels carried: DESIGN §10) eager calls fla's chunk kernel, and so does the
    compiled model's op, in one graph. Without ``fla`` there is nothing to check: skipped."""
    chunk = pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    heads = {"linear_key_head_dim": 64, "linear_value_head_dim": 64}  # fla's kernels want head dims >= 16
    model = FAMILIES["qwen4_exp"](torch.bfloat16, **TWO_LINEAR_LAYERS, **heads).cuda()
    ids = torch.randint(128, (2, 200), generator=torch.Generator().manual_seed(5)).cuda()
    apply = mock.patch.object(chunk.ChunkGatedDeltaRuleFunction, "apply", wraps=chunk.ChunkGatedDeltaRuleFunction.apply)
    with torch.no_grad(), apply as fla_calls:
        expected = model(ids).logits
        assert fla_calls.call_count == 2  # eager: fla, once per layer
        torch._dynamo.reset()
        with eager_kernels_under_compile():
            compiled = torch.compile(model, backend="inductor")
            actual = compiled(ids).logits
        assert fla_calls.call_count == 4
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_nested_contexts_call_the_kernel_once() -> None:
    query, key, value, g, beta = delta_rule_inputs(tokens=9)
    original = modeling_qwen4_exp.torch_chunk_gated_delta_rule
    want, _ = original(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    with delta_rule_as_one_op(), eager_kernels_under_compile():
        delta_rule = modeling_qwen4_exp.torch_chunk_gated_delta_rule
        assert delta_rule.replaced_wrapper is original
        got, _ = delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert modeling_qwen4_exp.torch_chunk_gated_delta_rule is original

"""Randomly initialised transformers HC models (qwen4_exp, deepseek_v4) for tests, benchmarks and demos.

Nothing is downloaded; needs transformers (the ``test`` extra). The same seed always gives the same weights.

Tiny models (``tiny_qwen4_exp``, ``tiny_deepseek_v4``) keep the real structure at toy sizes: n = 4 HC
streams, linear attention and (indexed / compressed) attention layers, MoE with a shared expert, PLE
(qwen4_exp), hash and top-k routing (deepseek_v4). A bf16 tiny model is the fp32 model cast (parameters that
transformers keeps in fp32 stay fp32).

Real-size models, any layer count:

- ``real_deepseek_v4``: transformers' ``DeepseekV4Config`` defaults, which transformers documents as the
  ``deepseek-ai/DeepSeek-V4-Flash-Base`` shapes (hidden 4096, 64 attention heads of 512, q LoRA 1024,
  8 output groups of LoRA 1024, compressed / heavily compressed attention at rates 4 / 128 with a
  64 x 128 indexer, 256 routed experts of 2048 top-6 + 1 shared, hash routing in the first 3 layers,
  n = 4 mHC streams), cut to the first ``num_layers`` layers of its layer pattern; no MTP layer.
- ``real_qwen4_exp``: the Qwen3.8-Flash-Next HC sizes (``QWEN4_EXP_REAL``: hidden 2560, n = 4, r = 320,
  16 attention heads of 256 / 2 KV, GatedDeltaNet 16 key / 32 value heads of 128, 32 experts of 512
  top-8 + a shared expert of 512, vocab 32768, PLE in layer 2 with a smaller n-gram table) with
  ``full_attention_interval`` 4:
  three GatedDeltaNet layers, then one indexed (QSA) attention layer. The QSA indexer's sizes are not
  in transformers' config (its defaults leave QSA off): ``QWEN4_EXP_INDEXER`` is our choice, one key
  head as QSA requires.

On CUDA the real-size experts run transformers' ``grouped_mm`` (``batched_mm`` gathers each token's expert
weights: 160 GiB at T = 8192 for qwen4_exp); elsewhere ``batched_mm``, which compiles as one graph on CPU.
A real-size model is built directly in ``dtype`` on ``device`` (an fp32 build on the CPU first would need
twice the memory of a real-size layer and minutes of CPU init), so unlike the tiny builders a bf16 model is
not the fp32 model cast. ``device="meta"`` builds the structure without values (for shape checks).

Implementation choices, made so that ``torch.compile`` sees as few graph breaks as possible:

- ``experts_implementation="batched_mm"`` (tiny models, and real-size ones off CUDA): the eager experts loop
  over the experts that were hit (``nonzero`` and a Python loop over its result: a data-dependent graph
  break per MoE layer); ``batched_mm`` gathers each token's expert weights and runs one ``bmm``, with no
  data-dependent shape.
- qwen4_exp uses ``attn_implementation="sdpa"``; deepseek_v4 supports only ``"eager"`` (its attention
  sinks have no SDPA kernel).

Weights that transformers initialises to a constant (RMSNorm weights at zero or one, the PLE conv at
zero, attention sinks, HC biases, compressor position biases, hash-routing tables) are re-drawn small and
random, so a test exercises them instead of multiplying by zero or one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, Qwen4ExpForCausalLM, Qwen4ExpTextConfig
from transformers.modeling_utils import PreTrainedModel

Device = str | torch.device

# Noise scale for re-drawn constant parameters: large enough to matter, small enough that norms
# (``x * (1 + w)`` or ``x * w`` around one) stay well conditioned.
CONSTANT_INIT_NOISE = 0.1

QWEN4_EXP_TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    # Three GatedDeltaNet layers then one indexed (QSA) attention layer, as full_attention_interval=4.
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "hc_count": 4,
    "hc_lowrank": 8,
    # PLE in the second layer (one-indexed id 2), like the real checkpoint's layers.1.
    "ple_layer_ids": [2],
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 257,
    "make_ngram_vocab_size_divisible_by": 8,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "eos_token_id": 1,
    "bos_token_id": 0,
    "pad_token_id": None,
    "use_cache": False,
}

DEEPSEEK_V4_TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 8,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 4,
    "num_nextn_predict_layers": 0,
    "use_cache": False,
}


def tiny_qwen4_exp(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> Qwen4ExpForCausalLM:
    """A tiny ``Qwen4ExpForCausalLM`` (text only) in eval mode; ``overrides`` replace config fields."""
    config = Qwen4ExpTextConfig(**{**QWEN4_EXP_TINY, **overrides})
    return build_model(Qwen4ExpForCausalLM, config, dtype, seed, "sdpa", via_fp32=True)


def tiny_deepseek_v4(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> DeepseekV4ForCausalLM:
    """A tiny ``DeepseekV4ForCausalLM`` in eval mode; ``overrides`` replace config fields."""
    config = DeepseekV4Config(**{**DEEPSEEK_V4_TINY, **overrides})
    return build_model(DeepseekV4ForCausalLM, config, dtype, seed, "eager", via_fp32=True)


def build_model(
    cls: type[PreTrainedModel],
    config: Any,
    dtype: torch.dtype,
    seed: int,
    attn_implementation: str,
    *,
    device: Device = "cpu",
    experts: str = "batched_mm",
    via_fp32: bool = False,
) -> Any:
    """Build ``cls`` from ``config`` on ``device`` under ``seed``, re-draw constant weights, in eval mode.

    ``via_fp32``: build in fp32 and cast to ``dtype`` (a bf16 model is the fp32 model cast); otherwise
    build in ``dtype`` directly. ``device="meta"``: the structure only (nothing to re-draw).
    """
    device = torch.device(device)
    # fork_rng: the caller's global RNG streams (CPU, and the device's) are left as they were.
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = cls._from_config(
            config,
            dtype=torch.float32 if via_fp32 else dtype,
            attn_implementation=attn_implementation,
            experts_implementation=experts,
        )
        if device.type != "meta":
            _redraw_constant_init(model)
    if via_fp32:
        _cast_parameters(model, dtype)
    return model.eval()


def _redraw_constant_init(model: nn.Module) -> None:
    """Add small noise to every floating parameter whose values are all equal, and randomise hash routes."""
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn_like(param) * CONSTANT_INIT_NOISE)
        for module in model.modules():
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):
                # A zero table sends every token to expert 0 top_k times; draw distinct experts per token.
                experts = module.num_experts
                table.copy_(torch.rand(table.shape[0], experts).argsort(dim=-1)[:, : table.shape[1]])


def _cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Cast parameters to ``dtype`` except those transformers keeps in fp32; buffers (RoPE) stay as built."""
    keep = model._keep_in_fp32_modules_strict or set()
    for name, param in model.named_parameters():
        if param.is_floating_point() and not any(pattern in name for pattern in keep):
            param.data = param.data.to(dtype)


QWEN4_EXP_REAL: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 2560,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    # A quarter of each head rotates (64 dims, as in Qwen3-Next), split over the 3 M-RoPE sections.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
    },
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [2],
    # transformers' default n-gram table has 20,000,000 rows of 2048 (41 B parameters, more than the rest of
    # a 4-layer model); a lookup costs the same per token at any row count, so the table is cut to 2^18.
    "ngram_vocab_size_base": 262144,
    "eos_token_id": 1,  # PLE needs one (the tiny config's too)
    "bos_token_id": 0,
    "full_attention_interval": 4,
    "use_cache": False,
}

QWEN4_EXP_INDEXER: dict[str, Any] = {
    "indexer_n_heads": 16,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
}


def real_qwen4_exp(
    num_layers: int = 4, dtype: torch.dtype = torch.bfloat16, device: Device = "cpu", seed: int = 0, **overrides: Any
) -> Qwen4ExpForCausalLM:
    """A real-size ``Qwen4ExpForCausalLM`` (text only) with ``num_layers`` layers, in eval mode."""
    fields = {**QWEN4_EXP_REAL, **QWEN4_EXP_INDEXER, "num_hidden_layers": _positive(num_layers), **overrides}
    return _build_real(Qwen4ExpForCausalLM, Qwen4ExpTextConfig(**fields), dtype, device, seed, "sdpa")


def real_deepseek_v4(
    num_layers: int = 1, dtype: torch.dtype = torch.bfloat16, device: Device = "cpu", seed: int = 0, **overrides: Any
) -> DeepseekV4ForCausalLM:
    """A real-size ``DeepseekV4ForCausalLM`` with the first ``num_layers`` layers, in eval mode."""
    published = DeepseekV4Config()
    count = _positive(num_layers)
    if count > published.num_hidden_layers:
        raise ValueError(f"num_layers = {count}: DeepSeek-V4-Flash has {published.num_hidden_layers} layers")
    fields = {
        "num_hidden_layers": count,
        "layer_types": published.layer_types[:count],
        "mlp_layer_types": published.mlp_layer_types[:count],
        "num_nextn_predict_layers": 0,
        "use_cache": False,
        **overrides,
    }
    return _build_real(DeepseekV4ForCausalLM, DeepseekV4Config(**fields), dtype, device, seed, "eager")


def _build_real(
    cls: type[PreTrainedModel], config: Any, dtype: torch.dtype, device: Device, seed: int, attn_implementation: str
) -> Any:
    """``build_model`` at real size: built directly in ``dtype`` on ``device``, with experts that fit there."""
    return build_model(cls, config, dtype, seed, attn_implementation, device=device, experts=experts_for(device))


def experts_for(device: Device) -> str:
    """transformers' experts implementation that fits at real size on ``device``."""
    return "grouped_mm" if torch.device(device).type == "cuda" else "batched_mm"


def _positive(num_layers: int) -> int:
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    return num_layers

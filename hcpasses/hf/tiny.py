"""Tiny, randomly initialised transformers HC models (qwen4_exp, deepseek_v4) for tests and demos.

Both builders keep the real structure at toy sizes: n = 4 HC streams, linear attention and (indexed /
compressed) attention layers, MoE with a shared expert, PLE (qwen4_exp), hash and top-k routing
(deepseek_v4). Nothing is downloaded. The same seed always gives the same weights, and a bf16 model is
the fp32 model cast (parameters that transformers keeps in fp32 stay fp32).

Implementation choices, made so that ``torch.compile`` sees as few graph breaks as possible:

- ``experts_implementation="batched_mm"``: the eager experts loop over the experts that were hit
  (``nonzero`` and a Python loop over its result: a data-dependent graph break per MoE layer);
  ``batched_mm`` gathers each token's expert weights and runs one ``bmm``, with no data-dependent shape.
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
    device: str | torch.device = "cpu",
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

"""Randomly initialised transformers HC models at real sizes, any layer count (nothing is downloaded).

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

On CUDA the experts run transformers' ``grouped_mm`` (``batched_mm`` gathers each token's expert weights:
160 GiB at T = 8192 for qwen4_exp); elsewhere ``batched_mm``, which compiles as one graph on CPU. The
model is built directly in ``dtype`` on ``device`` (an fp32 build on the CPU first would need twice the
memory of a real-size layer and minutes of CPU init), so unlike the tiny builders a bf16 model is not
the fp32 model cast. ``device="meta"`` builds the structure without values (for shape checks).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from hcpasses.hf.tiny import build_model

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
    num_layers: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> Qwen4ExpForCausalLM:
    """A real-size ``Qwen4ExpForCausalLM`` (text only) with ``num_layers`` layers, in eval mode."""
    fields = {**QWEN4_EXP_REAL, **QWEN4_EXP_INDEXER, "num_hidden_layers": _positive(num_layers), **overrides}
    config = Qwen4ExpTextConfig(**fields)
    return build_model(Qwen4ExpForCausalLM, config, dtype, seed, "sdpa", device=device, experts=experts_for(device))


def real_deepseek_v4(
    num_layers: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides: Any,
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
    config = DeepseekV4Config(**fields)
    return build_model(DeepseekV4ForCausalLM, config, dtype, seed, "eager", device=device, experts=experts_for(device))


def experts_for(device: str | torch.device) -> str:
    """transformers' experts implementation that fits at real size on ``device``."""
    return "grouped_mm" if torch.device(device).type == "cuda" else "batched_mm"


def _positive(num_layers: int) -> int:
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    return num_layers

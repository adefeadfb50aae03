"""transformers HC models (qwen4_exp, deepseek_v4) through hcpasses: tiny builders and model-side tooling."""

from hcpasses.hf.tiny import tiny_deepseek_v4, tiny_qwen4_exp

__all__ = ["tiny_deepseek_v4", "tiny_qwen4_exp"]

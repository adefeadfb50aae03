"""transformers HC models (qwen4_exp, deepseek_v4) through hcpasses: tiny and real-size builders, model-side tooling."""

from hcpasses.hf.fp8_swap import is_sublayer_input_projection, swap_fp8_linears
from hcpasses.hf.real import real_deepseek_v4, real_qwen4_exp
from hcpasses.hf.tiny import tiny_deepseek_v4, tiny_qwen4_exp
from hcpasses.hf.tp_shard import shard_for_tp

__all__ = [
    "is_sublayer_input_projection",
    "real_deepseek_v4",
    "real_qwen4_exp",
    "shard_for_tp",
    "swap_fp8_linears",
    "tiny_deepseek_v4",
    "tiny_qwen4_exp",
]

"""Model-side helpers for transformers' HC models (qwen4_exp, deepseek_v4): the FP8 linear swap, TP sharding, and
transformers' export check made true under ``torch.compile`` on torch 2.11.

Importing this package does not import transformers. The tiny and real-size model builders used by the tests
and benchmarks are :mod:`hcpasses.testing.hf_models`.
"""

from hcpasses.hf.export_check import export_check_read_from_flag
from hcpasses.hf.fp8_swap import is_sublayer_input_projection, swap_fp8_linears
from hcpasses.hf.tp_shard import shard_for_tp

__all__ = ["export_check_read_from_flag", "is_sublayer_input_projection", "shard_for_tp", "swap_fp8_linears"]

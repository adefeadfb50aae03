"""Model-side helpers for transformers' HC models (qwen4_exp, deepseek_v4): the FP8 linear swap, TP sharding, and
a context in which a compiled model runs the kernels eager runs (``eager_kernels_under_compile``).

Importing this package does not import transformers. The tiny and real-size model builders used by the tests
and benchmarks are :mod:`hcpasses.testing.hf_models`.
"""

from hcpasses.hf.delta_rule_op import delta_rule_as_one_op
from hcpasses.hf.eager_kernels import eager_kernels_under_compile
from hcpasses.hf.export_check import export_check_read_from_flag
from hcpasses.hf.fp8_swap import is_sublayer_input_projection, swap_fp8_linears
from hcpasses.hf.qsa_selection_op import qsa_selection_as_one_op
from hcpasses.hf.tp_shard import shard_for_tp

__all__ = [
    "delta_rule_as_one_op",
    "eager_kernels_under_compile",
    "export_check_read_from_flag",
    "is_sublayer_input_projection",
    "qsa_selection_as_one_op",
    "shard_for_tp",
    "swap_fp8_linears",
]

"""Swap a transformers model's sub-layer input projections for PTPC-FP8 linears (DESIGN §5).

PTPC-FP8 checkpoints (per-token activation scales, per-channel weight scales) quantise the sub-layer
input x once per token in front of its input projections. In an HC model x is the HC block's collapse
(qwen4_exp: the gated mean; deepseek_v4: the mHC collapse, then the sub-layer's RMSNorm), so after the
swap the compiled graph holds the collapse -> per-token quant chain that the ``gated_mean_quant`` fusion
matches. The quant is ``hcpasses.fp8.quantize_per_token``, whose constants (448, 1/(448*512)) are literals
so that the pattern still matches under dynamic shapes.

    model = tiny_qwen4_exp()                      # hcpasses.testing.hf_models; any qwen4_exp / deepseek_v4
    swapped = swap_fp8_linears(model)             # default selection, see ``is_sublayer_input_projection``
    swap_fp8_linears(model, lambda name, linear: name.endswith("q_proj"))
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from hcpasses.fp8 import Fp8Linear

LinearSelector = Callable[[str, nn.Linear], bool]

# Projections that read the sub-layer input (the HC collapse, or deepseek_v4's RMSNorm of it) and that ship
# in FP8. Left out on purpose: routers (not nn.Linear, and they pick experts), qwen4_exp's shared_expert_gate
# (one output column) and the attention indexers / compressors, whose scores pick tokens; the
# DeepSeek-V4 FP8 checkpoint ships those in BF16 too.
SUBLAYER_INPUT_PROJECTIONS = re.compile(
    r"(^|\.)("
    r"linear_attn\.in_proj_(qkv|z|a|b)"  # qwen4_exp GatedDeltaNet
    r"|self_attn\.(q_proj|k_proj|v_proj)"  # qwen4_exp indexed attention
    r"|self_attn\.(q_a_proj|kv_proj)"  # deepseek_v4 attention (low-rank q, shared kv)
    r"|mlp\.shared_experts?\.(gate_proj|up_proj)"  # both families' shared expert
    r")$"
)


class Fp8LinearWithBias(Fp8Linear):
    """:class:`~hcpasses.fp8.Fp8Linear` plus the original layer's bias, added in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__(weight)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out]`` in x's dtype."""
        return super().forward(x) + self.bias.to(x.dtype)


def is_sublayer_input_projection(name: str, linear: nn.Linear) -> bool:
    """The default selection: the sub-layer input projections listed in ``SUBLAYER_INPUT_PROJECTIONS``."""
    return SUBLAYER_INPUT_PROJECTIONS.search(name) is not None


def to_fp8_linear(linear: nn.Linear) -> Fp8Linear:
    """A PTPC-FP8 copy of ``linear``: weight quantised per output channel, x per token at each call."""
    weight = linear.weight.detach()
    if linear.bias is None:
        return Fp8Linear(weight)
    return Fp8LinearWithBias(weight, linear.bias)


def swap_fp8_linears(model: nn.Module, select: LinearSelector | None = None) -> list[str]:
    """Replace each ``nn.Linear`` of ``model`` that ``select(name, linear)`` picks by a PTPC-FP8 linear.

    ``select`` defaults to :func:`is_sublayer_input_projection`. Works in place and returns the swapped
    module names in ``named_modules`` order. Raises ``ValueError`` when nothing is selected (a typo in a
    selector should not silently leave the model in high precision).
    """
    select = is_sublayer_input_projection if select is None else select
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and select(name, module)  # exact type: an Fp8Linear is not swapped twice
    ]
    if not chosen:
        linears = [name for name, module in model.named_modules() if type(module) is nn.Linear]
        raise ValueError(f"no nn.Linear selected for FP8; the model's linears are: {linears[:12]} ...")
    for name, linear in chosen:
        model.set_submodule(name, to_fp8_linear(linear))
    return [name for name, _ in chosen]

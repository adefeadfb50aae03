"""Helpers shared by the transformers HC model tests (qwen4_exp, deepseek_v4 at toy sizes).

A plain module, not conftest.py: the rank functions of the multi-process tests import it by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from hcpasses.testing.hf_models import tiny_deepseek_v4, tiny_qwen4_exp

FAMILIES: dict[str, Callable[..., torch.nn.Module]] = {"qwen4_exp": tiny_qwen4_exp, "deepseek_v4": tiny_deepseek_v4}
SEQ = 16  # long enough for the deepseek_v4 compressors (rates 4 and 8) and the qwen4_exp QSA blocks (4)


def token_ids(batch: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """Fresh random ``input_ids [batch, SEQ]``, the same for every process that asks with the same seed."""
    return torch.randint(vocab, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``ids`` without autograd."""
    with torch.no_grad():
        return model(ids).logits


class GraphRecorder:
    """A Dynamo backend that keeps every FX graph Dynamo hands it (``graphs``) and runs each as traced."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        self.graphs.append(gm)
        return gm.forward


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in the Frobenius norm, computed in fp32."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


# One-layer variants for the tests that run Inductor, whose C++ codegen takes about a minute per thousand
# graph nodes on 2 cores. Both keep an HC-wrapped linear-time mixer or compressed attention, MoE, and
# (qwen4_exp) PLE; neither has qwen4_exp's QSA indexer, which breaks the graph per query outside
# ``eager_kernels_under_compile()`` (test_compile.py) and runs a Python loop per query inside it.
ONE_LAYER: dict[str, dict[str, object]] = {
    "qwen4_exp": {"num_hidden_layers": 1, "layer_types": ["linear_attention"], "ple_layer_ids": [1]},
    "deepseek_v4": {
        "num_hidden_layers": 1,
        "layer_types": ["compressed_sparse_attention"],
        "mlp_layer_types": ["moe"],
    },
}

"""Cheap checks of documented behaviour that the rest of the suite covers only loosely.

Each was added because a deliberate fault of ``tests/mutants/mutants.py`` survived every other test; each
checks a contract on the real code, not the fault: the fused op is in the graph the fusion reports (and
the graph then computes what the op computes), and ``shard_rows`` returns exactly this rank's block of
token rows, zero-padded to ``ceil(N/tp)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import capture_post_grad, count_calls

import hcpasses.rows  # noqa: F401  (registers torch.ops.hcpasses.shard_rows)
from hcpasses.config import HCPassesConfig
from hcpasses.kernels.contract import gated_mean_quant_reference
from hcpasses.manager import PassManager
from hcpasses.patterns.gated_mean import per_token_quant, transformers_gated_mean

aten = torch.ops.aten
N_STREAMS, HIDDEN = 4, 32


def gated_mean_then_quant(u: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_quant(transformers_gated_mean(u, xn, N_STREAMS, HIDDEN))


def test_fused_op_is_in_the_graph_and_the_graph_computes_the_op() -> None:
    """Where the report counts a fusion, the post-grad graph holds the op instead of the collapse, and the
    graph's q and scale are bit-identical to the op's CPU reference on the same inputs."""
    gen = torch.Generator().manual_seed(0)
    u = (torch.randn(13, N_STREAMS * HIDDEN, generator=gen) * 2).bfloat16()
    xn = torch.randn(13, N_STREAMS * HIDDEN, generator=gen).bfloat16()
    reports: list = []
    manager = PassManager(HCPassesConfig().with_passes(sp_rewrite=False), reports.append)
    [captured] = capture_post_grad(
        gated_mean_then_quant, (u, xn), codegen=False, config_patches={"post_grad_custom_pre_pass": manager}
    )
    gm = captured.gm
    assert reports[0].applied["gated_mean_quant"] == 1, reports[0]
    assert count_calls(gm, torch.ops.hcpasses.gated_mean_quant.default) == 1, gm.code
    assert count_calls(gm, aten.sigmoid.default) == 0, gm.code  # the collapse is gone, not kept beside the op
    q, scale = gm(*captured.inputs)
    _, q_ref, scale_ref = gated_mean_quant_reference(xn, u, N_STREAMS)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("token_shape", [(1,), (5,), (8,), (9,), (2, 7), (3, 4)], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shard_rows_is_this_ranks_block_zero_padded(token_shape: tuple[int, ...], tp: int) -> None:
    """Rank r gets token rows ``[r*R, (r+1)*R)`` (R = ceil(N/tp)) of x flattened over its token dims, pad
    rows are zeros, the token dims become ``[1, ..., 1, R]``, and the shards in rank order are x again."""
    tokens = 1
    for size in token_shape:
        tokens *= size
    x = torch.arange(1.0, tokens * 3 + 1).view(*token_shape, 3)  # no zero anywhere: pad rows stand out
    rows = -(-tokens // tp)
    padded = F.pad(x.reshape(tokens, 3), (0, 0, 0, rows * tp - tokens))
    shards = []
    for rank in range(tp):
        shard = torch.ops.hcpasses.shard_rows(x, rank, tp, len(token_shape))
        assert shard.shape == (*([1] * (len(token_shape) - 1)), rows, 3)
        assert torch.equal(shard.reshape(rows, 3), padded[rank * rows : (rank + 1) * rows])
        shards.append(shard.reshape(rows, 3))
    assert torch.equal(torch.cat(shards)[:tokens].view_as(x), x)

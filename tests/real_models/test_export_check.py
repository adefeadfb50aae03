"""``hcpasses.hf.export_check``: transformers' "exporting?" check under ``torch.compile``, on every torch.

On torch 2.11 Dynamo folds ``torch.compiler.is_exporting()`` to True under ``torch.compile`` (pytorch#176347),
so a compiled GatedDeltaNet takes its export path. These tests run on both torches: where Dynamo folds the
check (the GPU machine's 2.11) they check the real thing; on 2.13 the folding is simulated by pointing the
modelling module's check at ``lambda: True``, which is what 2.11's Dynamo traces.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hf_cases import FAMILIES, ONE_LAYER, GraphRecorder, token_ids
from torch import fx
from transformers.models.qwen4_exp import modeling_qwen4_exp

from hcpasses.hf import export_check
from hcpasses.hf.export_check import dynamo_folds_is_exporting, export_check_read_from_flag

FOLDS = torch.torch_version.TorchVersion(torch.__version__) < "2.13"  # pytorch#176499 landed in 2.13


def dynamo_graphs() -> list[fx.GraphModule]:
    """The FX graphs Dynamo makes for one call of the one-layer tiny qwen4_exp, compiled afresh."""
    recorder = GraphRecorder()
    torch._dynamo.reset()
    model = FAMILIES["qwen4_exp"](**ONE_LAYER["qwen4_exp"])
    compiled = torch.compile(model, backend=recorder, dynamic=False)
    with torch.no_grad():
        compiled(token_ids(1))
    return recorder.graphs


def solves_triangular(graphs: list[fx.GraphModule]) -> bool:
    """Whether the graphs take the eager branch of the delta rule (``solve_triangular``), not the export loop."""
    return any(
        node.op == "call_function" and node.target is torch.linalg.solve_triangular
        for gm in graphs
        for node in gm.graph.nodes
    )


def test_dynamo_folds_is_exporting_on_torch_before_2_13_only() -> None:
    """The probe's answer is the torch fact this module exists for (2.11: True, 2.13: False)."""
    assert dynamo_folds_is_exporting() is FOLDS


def test_the_flag_is_false_under_compile_and_true_under_export() -> None:
    """The internal flag the replacement check reads: torch's export sets it, ``torch.compile`` does not."""

    class Branches(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3 if export_check._is_exporting_per_flag() else x - 1

    x = torch.randn(4)
    assert not torch.compiler._is_exporting_flag
    torch.testing.assert_close(torch.compile(Branches(), backend="eager", fullgraph=True)(x), x - 1)
    exported = torch.export.export(Branches(), (x,), strict=False)
    torch.testing.assert_close(exported.module()(x), x * 3)


def test_compiled_delta_rule_takes_the_eager_branch_in_the_context() -> None:
    """No mocks: on 2.11 the context is what makes the compiled graph solve triangular systems; on 2.13 it
    changes nothing (the graph does so anyway)."""
    with export_check_read_from_flag() as patched:
        graphs = dynamo_graphs()
    assert solves_triangular(graphs)
    assert ("transformers.models.qwen4_exp.modeling_qwen4_exp" in patched) is FOLDS


def test_the_context_replaces_a_folded_check_and_restores_it() -> None:
    """2.11's folding simulated on any torch: the modelling module's check says True under compile. Outside the
    context the compiled delta rule takes the export loop; inside it the eager branch; on exit the check is
    the one the module had."""
    folded = mock.Mock(return_value=True)
    with (
        mock.patch.object(modeling_qwen4_exp, "is_torchdynamo_exporting", folded),
        mock.patch.object(export_check, "dynamo_folds_is_exporting", return_value=True),
    ):
        assert not solves_triangular(dynamo_graphs())
        with export_check_read_from_flag() as patched:
            assert modeling_qwen4_exp.is_torchdynamo_exporting is export_check._is_exporting_per_flag
            graphs = dynamo_graphs()
        assert modeling_qwen4_exp.is_torchdynamo_exporting is folded
    assert solves_triangular(graphs)
    assert "transformers.models.qwen4_exp.modeling_qwen4_exp" in patched
    assert "transformers.utils.import_utils" in patched


def test_the_context_restores_the_checks_when_the_body_raises() -> None:
    original = modeling_qwen4_exp.is_torchdynamo_exporting
    with mock.patch.object(export_check, "dynamo_folds_is_exporting", return_value=True):
        with pytest.raises(RuntimeError, match="body failed"), export_check_read_from_flag():
            assert modeling_qwen4_exp.is_torchdynamo_exporting is not original
            raise RuntimeError("body failed")
    assert modeling_qwen4_exp.is_torchdynamo_exporting is original

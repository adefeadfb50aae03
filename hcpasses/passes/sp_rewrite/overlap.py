"""Overlap: SP's all-gathers and reduce-scatters in the form Inductor's micro-pipeline TP fuses with their GEMMs.

Before (SP alone; R = ceil(N/tp) rows per rank, the gathered rows trimmed to N, the partial sums padded to R*tp)::

    x_r -> all_gather -> wait -> slice [:N] -> mm(., W_col)        mm(a, W_row) [N, S] -> pad -> reduce_scatter

After (``overlap`` on, the region's group NCCL on CUDA with more than one rank)::

    x_r -> all_gather -> wait -> mm(., W_col) -> slice [:N]        mm(pad(a), W_row) [R*tp, S] -> reduce_scatter

Row i of ``x @ W`` is row i of x times W, so the trim moves past the GEMM; zero rows times W are zero rows, so the
pad moves into the GEMM's left operand. Inductor's micro-pipeline TP pass (``_micro_pipeline_tp``, which the backend
turns on for these compiles only, after hcpasses' passes) then finds each gather that feeds GEMMs and each GEMM
that feeds a reduce-scatter, and fuses them into ``torch.ops.symm_mem`` ops (``fused_all_gather_matmul``,
``fused_all_gather_scaled_matmul`` for FP8 codes, ``fused_matmul_reduce_scatter``) over groups with symmetric
memory, which the backend enables. We write no fusion of our own: the shapes are what its matcher
(``torch._inductor.fx_passes.micro_pipeline_tp``, private; ``tests/test_sp_overlap.py`` runs it on our graphs)
needs: ``wait`` read directly by ``mm`` / ``_scaled_mm``, or by a reshape to 2-D that they read; the reduce-scatter
reading a GEMM's output directly. FP8 codes are gathered as FP8 here (NCCL sends FP8; SP alone sends bytes, for
gloo): from ``view.dtype(wait)`` of bytes Inductor would hand ``fused_all_gather_scaled_matmul`` uint8 codes, which
``_scaled_mm`` refuses (torch 2.13; the test propagates the fused graph's values to catch that).

A GEMM is shaped only where the rewrite is exact and costs nothing extra: the gathered rows are its left operand
(an FP8 ``_scaled_mm`` with row-wise scales reads the gathered scales untrimmed too); on the scatter side the GEMM's
only user is the all-reduce's input. Other readers of the gathered rows read the trimmed value as before.

Applies when: ``overlap`` is on, ``overlap_blocker`` finds nothing (CUDA, the group's backend NCCL, more than one
rank) and the token count is static: the fused ops' meta functions refuse symbolic sizes (torch 2.13), so a fused
graph with a symbolic T would not compile. Otherwise (CPU, gloo, one GPU under a fake group, symbolic T) the graph is
as SP alone makes it and the report says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from hcpasses.passes.sp_rewrite.tokens import same_size

aten = torch.ops.aten
GEMMS = (aten.mm.default, aten._scaled_mm.default)
SCALED_MM = aten._scaled_mm.default
RESHAPES = (aten.reshape.default, aten.view.default)


def overlap_blocker(group_name: str) -> str | None:
    """Why the collectives over the group named ``group_name`` cannot be fused as symmetric-memory ops, or None.

    Internal API: ``_resolve_process_group`` (as ``collectives.resolve_group``)."""
    if not torch.cuda.is_available():
        return "no CUDA device (symmetric memory needs GPUs)"
    group = _resolve_process_group(group_name)
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"group '{group_name}' runs on {backend} (symmetric memory needs NCCL)"
    if dist.get_world_size(group) < 2:
        return f"group '{group_name}' has one rank"
    return None


def symmetric_memory_groups() -> list[str]:
    """Enable symmetric memory for every group of this process that can fuse (``overlap_blocker``) and return their
    names: Inductor's micro-pipeline TP fuses only over such groups (``is_symm_mem_enabled_for_group``). Done
    before each compile that may fuse, so that a process loading a fused graph from Inductor's cache has it too.

    Internal API: ``distributed_c10d._world.pg_names`` (as ``hcpasses.manager``); ``enable_symm_mem_for_group`` is
    deprecated on torch 2.13 ("no need to call") yet still what ``is_symm_mem_enabled_for_group`` reads there."""
    import warnings

    from torch.distributed import _symmetric_memory

    if not (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()):
        return []
    names = [name for name in dist.distributed_c10d._world.pg_names.values() if overlap_blocker(name) is None]
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            _symmetric_memory.enable_symm_mem_for_group(name)
    return names


def feed_gemms_untrimmed(untrimmed: Mapping[fx.Node, tuple[fx.Node, Any]], tokens: Any) -> int:
    """Each GEMM whose left operand is a gathered ``[N, K]`` value (``untrimmed`` maps it to its untrimmed ``[R*tp,
    K]`` rows and K) reads the untrimmed rows, and its result is trimmed to the ``tokens`` rows instead. Returns how
    many GEMMs now read a gather's rows directly."""
    shaped = 0
    for trimmed, (rows, width) in untrimmed.items():
        for gemm in _gemms_reading(trimmed, width):
            scale = gemm.args[2] if gemm.target is SCALED_MM else None
            scale_rows = _source_rows(scale, untrimmed) if scale is not None else None
            if scale is not None and scale_rows is None and _row_wise(scale):
                continue  # row-wise scales that are not gathered here: they cannot grow to R*tp rows
            args = list(gemm.args)
            args[0] = rows
            if scale_rows is not None:
                args[2] = scale_rows
            with gemm.graph.inserting_after(gemm):
                trim = gemm.graph.call_function(aten.slice.Tensor, (gemm, 0, 0, tokens))
            gemm.replace_all_uses_with(trim, delete_user_cb=lambda user, trim=trim: user is not trim)
            gemm.args = tuple(args)
            shaped += 1
    return shaped


def gemm_of_partial(partial: fx.Node) -> fx.Node | None:
    """The GEMM whose ``[N, S]`` output is ``partial`` (itself, or behind a reshape to the token dims), when the
    all-reduce's input is its only use; None otherwise."""
    gemm = partial
    if partial.target in RESHAPES and isinstance(partial.args[0], fx.Node):
        gemm = partial.args[0]
        if len(gemm.users) != 1:
            return None
    if gemm.target not in GEMMS or len(partial.users) != 1:
        return None
    if gemm.target is SCALED_MM and _row_wise(gemm.args[2]):
        return None  # its row-wise scales would need padding too
    return gemm


def gemm_on_padded_rows(gemm: fx.Node, missing: Any) -> fx.Node:
    """The GEMM again, its left operand padded with ``missing`` zero rows (inserted before ``gemm``)."""
    graph = gemm.graph
    with graph.inserting_before(gemm):
        padded = graph.call_function(aten.constant_pad_nd.default, (gemm.args[0], [0, 0, 0, missing], 0.0))
        return graph.call_function(gemm.target, (padded, *gemm.args[1:]), dict(gemm.kwargs))


def _gemms_reading(trimmed: fx.Node, width: Any) -> list[fx.Node]:
    """The GEMMs that read ``trimmed`` (``[N, width]``) as their left operand, directly or through a reshape to
    ``[N, width]`` (the token dims of ``[batch, seq, width]`` flattened)."""
    gemms = [user for user in trimmed.users if user.target in GEMMS and user.args[0] is trimmed]
    for user in trimmed.users:
        if user.target in RESHAPES and _is_rows_of(user, width):
            gemms += [gemm for gemm in user.users if gemm.target in GEMMS and gemm.args[0] is user]
    return gemms


def _is_rows_of(reshape: fx.Node, width: Any) -> bool:
    """Whether ``reshape``'s result is 2-D with ``width`` columns: one row per token."""
    val = reshape.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 2 and same_size(val.shape[1], width)


def _source_rows(value: Any, untrimmed: Mapping[fx.Node, tuple[fx.Node, Any]]) -> fx.Node | None:
    """The untrimmed rows behind ``value`` (a gathered value, or its reshape to one row per token)."""
    if not isinstance(value, fx.Node):
        return None
    if value in untrimmed:
        return untrimmed[value][0]
    source = value.args[0] if value.target in RESHAPES else None
    if source in untrimmed and _is_rows_of(value, untrimmed[source][1]):
        return untrimmed[source][0]
    return None


def _row_wise(scale: Any) -> bool:
    """Whether a ``_scaled_mm`` scale has one value per row of the left operand (rather than one for all)."""
    if not isinstance(scale, fx.Node):
        return False
    val = scale.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() > 1

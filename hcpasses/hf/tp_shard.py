"""vLLM-style tensor parallelism for the transformers HC models (qwen4_exp, deepseek_v4), in place.

Every sub-layer is column-parallel in and row-parallel out, followed by one all-reduce of its output
(DESIGN §3): the partial sums of the row-parallel projections are summed across ranks exactly where vLLM
and ATOM reduce. Heads are divided by tp. Everything else is replicated: the HC blocks (their weights and
all their work), norms, embeddings, PLE, routers, the attention indexers and compressors, ``lm_head``.
In particular the HC down projection is *not* K-split (transformers' own ``tp_plan`` does that, which puts
an all-reduce inside every HC block and makes the HC output depend on a reduction order).

What is split, per sub-layer (rank r of tp keeps the r-th contiguous slice of heads / channels):

- qwen4_exp GatedDeltaNet: ``in_proj_qkv`` rows and ``conv1d`` channels per q / k / v head (the three parts
  are split separately, so each rank keeps whole heads and the k-head -> v-head grouping), ``in_proj_z``,
  ``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias`` per value head; ``out_proj`` columns.
  The gated RMSNorm is over one head's dim, so its weight is replicated.
- qwen4_exp attention: ``q_proj`` (query and gate interleaved per head), ``k_proj``, ``v_proj`` per head;
  ``o_proj`` columns. ``q_norm`` / ``k_norm`` (per head dim) and the QSA indexer are replicated.
- deepseek_v4 attention: ``q_b_proj`` rows and ``sinks`` per head; ``o_a_proj`` (grouped: whole groups of
  heads) rows; ``o_b_proj`` columns. ``q_a_proj``, the single shared KV head and the compressor /
  indexer are replicated.
- MoE (both): experts' ``gate_up_proj`` (gate and up halves split separately) and ``down_proj`` along the
  intermediate dim; the shared expert's gate / up rows and down columns. The routed and shared partial
  outputs are added before the single all-reduce of the MoE block's output.

Works on ``nn.Linear`` and on column-parallel :class:`~hcpasses.fp8.Fp8Linear` (after ``swap_fp8_linears``):
quantising per output channel commutes with a column split. A row-parallel projection must be a plain
``nn.Linear``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from hcpasses.fp8 import Fp8Linear
from hcpasses.tp import resolve_tp

HeadLayout = Sequence[tuple[int, int]]  # (number of heads, rows per head) for each part of a fused output


def shard_for_tp(
    model: nn.Module,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Shard ``model`` (a qwen4_exp or deepseek_v4 causal LM or base model) for tensor parallelism, in place.

    ``group`` is the TP group (default: the default process group; a DP x TP job passes the group it made with
    ``dist.new_group``): the all-reduces run on it, and ``tp_rank`` / ``tp_size`` default to this process's rank
    in it and its size. Returns ``model``. tp = 1 leaves it unchanged. Raises ``ValueError`` naming the size
    when a head count or width is not divisible by tp, or when the model has no sub-layer this knows.
    """
    rank, size = _resolve_tp(tp_rank, tp_size, group)
    if size == 1:
        return model
    group = dist.group.WORLD if group is None else group
    found = 0
    for name, module in list(model.named_modules()):
        sharder = _SHARDERS.get(type(module).__name__)
        if sharder is not None:
            sharder(module, rank, size, name)
            found += 1
        if type(module).__name__ in _REDUCED_OUTPUTS:
            module.register_forward_hook(_all_reduce_hook(group))
    if not found:
        raise ValueError(f"{type(model).__name__} has no sub-layer that shard_for_tp knows ({sorted(_SHARDERS)})")
    return model


def _resolve_tp(tp_rank: int | None, tp_size: int | None, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The explicit rank and size, or the TP group's (``hcpasses.tp.resolve_tp``); unlike the models, which run
    unsharded without a group, sharding without either is an error."""
    if (tp_rank is None or tp_size is None) and not dist.is_initialized():
        raise ValueError("pass tp_rank and tp_size, or initialise the default process group first")
    return resolve_tp(tp_rank, tp_size, group)


def _all_reduce_hook(group: Any) -> Any:
    """A forward hook that sums a module's output (a tensor, or the first item of a tuple) across ranks."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (funcol.all_reduce(output[0], "sum", group), *output[1:])
        return funcol.all_reduce(output, "sum", group)

    return hook


def _per_rank(total: int, size: int, what: str) -> int:
    """``total / size``, or a ``ValueError`` naming ``what`` when it does not divide."""
    if total % size:
        raise ValueError(f"{what} = {total} is not divisible by tp = {size}")
    return total // size


def _head_rows(layout: HeadLayout, rank: int, size: int, what: str) -> torch.Tensor:
    """Indices of the rows this rank keeps in a fused output made of ``layout``'s parts, one after another.

    Each part ``(heads, rows_per_head)`` is split by whole heads: rank r keeps heads
    ``[r * heads / size, (r + 1) * heads / size)`` of every part.
    """
    keep, offset = [], 0
    for heads, rows_per_head in layout:
        local = _per_rank(heads, size, what) * rows_per_head
        keep.append(torch.arange(offset + rank * local, offset + (rank + 1) * local))
        offset += heads * rows_per_head
    return torch.cat(keep)


def _slice_param(param: torch.Tensor, dim: int, index: torch.Tensor) -> nn.Parameter:
    """A new parameter holding ``param``'s entries at ``index`` along ``dim`` (same ``requires_grad``)."""
    data = param.detach().index_select(dim, index.to(param.device)).contiguous()
    return nn.Parameter(data, requires_grad=param.requires_grad)


def _column_parallel(linear: nn.Module, rows: torch.Tensor) -> None:
    """Keep output rows ``rows`` of an ``nn.Linear`` or ``Fp8Linear`` (and of its bias)."""
    if isinstance(linear, Fp8Linear):
        # Per-output-channel codes and scales: slicing them equals quantising the sliced weight.
        linear.weight_q = linear.weight_q.index_select(0, rows.to(linear.weight_q.device)).contiguous()
        linear.weight_scale = linear.weight_scale.index_select(0, rows.to(linear.weight_scale.device)).contiguous()
    elif isinstance(linear, nn.Linear):
        linear.weight = _slice_param(linear.weight, 0, rows)
        linear.out_features = len(rows)
    else:
        raise TypeError(f"cannot column-split a {type(linear).__name__}")
    if getattr(linear, "bias", None) is not None:
        linear.bias = _slice_param(linear.bias, 0, rows)


def _row_parallel(linear: nn.Module, cols: torch.Tensor, rank: int) -> None:
    """Keep input columns ``cols`` of an ``nn.Linear``; the bias stays on rank 0 only, so the sum adds it once."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"cannot row-split a {type(linear).__name__}: per-channel FP8 scales do not K-split")
    linear.weight = _slice_param(linear.weight, 1, cols)
    linear.in_features = len(cols)
    if linear.bias is not None and rank != 0:
        with torch.no_grad():
            linear.bias.zero_()


def _shard_mlp(mlp: nn.Module, rank: int, size: int, name: str) -> None:
    """A gated MLP (shared expert): gate / up rows and down columns by intermediate channel."""
    rows = _head_rows([(mlp.intermediate_size, 1)], rank, size, f"{name}.intermediate_size")
    _column_parallel(mlp.gate_proj, rows)
    _column_parallel(mlp.up_proj, rows)
    _row_parallel(mlp.down_proj, rows, rank)
    mlp.intermediate_size = len(rows)


def _shard_experts(experts: nn.Module, rank: int, size: int, name: str) -> None:
    """Routed experts stored as 3-D tensors: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    inter = experts.intermediate_dim
    if not experts.is_concatenated:
        raise ValueError(f"{name}: interleaved gate/up expert layout is not supported")
    rows = _head_rows([(inter, 1), (inter, 1)], rank, size, f"{name}.intermediate_dim")  # gate half, up half
    experts.gate_up_proj = _slice_param(experts.gate_up_proj, 1, rows)
    experts.down_proj = _slice_param(experts.down_proj, 2, rows[: len(rows) // 2])
    experts.intermediate_dim = len(rows) // 2


def _shard_gated_delta_net(gdn: nn.Module, rank: int, size: int, name: str) -> None:
    """qwen4_exp linear attention: per q / k / v head for the projections, conv channels and head params."""
    nk, nv, dk, dv = gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim
    what = f"{name}: linear_num_key_heads / linear_num_value_heads"
    qkv = _head_rows([(nk, dk), (nk, dk), (nv, dv)], rank, size, what)
    _column_parallel(gdn.in_proj_qkv, qkv)
    gdn.conv1d.weight = _slice_param(gdn.conv1d.weight, 0, qkv)
    gdn.conv1d.in_channels = gdn.conv1d.out_channels = gdn.conv1d.groups = len(qkv)
    z = _head_rows([(nv, dv)], rank, size, what)
    _column_parallel(gdn.in_proj_z, z)
    heads = _head_rows([(nv, 1)], rank, size, what)
    _column_parallel(gdn.in_proj_a, heads)
    _column_parallel(gdn.in_proj_b, heads)
    gdn.A_log = _slice_param(gdn.A_log, 0, heads)
    gdn.dt_bias = _slice_param(gdn.dt_bias, 0, heads)
    _row_parallel(gdn.out_proj, z, rank)
    gdn.num_k_heads, gdn.num_v_heads = nk // size, nv // size
    gdn.key_dim, gdn.value_dim = gdn.num_k_heads * dk, gdn.num_v_heads * dv
    gdn.conv_dim = len(qkv)


def _shard_qwen_attention(attn: nn.Module, rank: int, size: int, name: str) -> None:
    """qwen4_exp attention: q (with its per-head gate), k, v by head; o columns."""
    config, hd = attn.config, attn.head_dim
    what = f"{name}: num_attention_heads / num_key_value_heads"
    _column_parallel(attn.q_proj, _head_rows([(config.num_attention_heads, 2 * hd)], rank, size, what))
    kv = _head_rows([(config.num_key_value_heads, hd)], rank, size, what)
    _column_parallel(attn.k_proj, kv)
    _column_parallel(attn.v_proj, kv)
    _row_parallel(attn.o_proj, _head_rows([(config.num_attention_heads, hd)], rank, size, what), rank)


def _shard_deepseek_attention(attn: nn.Module, rank: int, size: int, name: str) -> None:
    """deepseek_v4 attention: q_b and sinks by head, o_a by whole head groups, o_b columns."""
    config, hd, heads = attn.config, attn.head_dim, attn.num_heads
    _column_parallel(attn.q_b_proj, _head_rows([(heads, hd)], rank, size, f"{name}: num_attention_heads"))
    attn.sinks = _slice_param(attn.sinks, 0, _head_rows([(heads, 1)], rank, size, f"{name}: num_attention_heads"))
    groups, o_rank = config.o_groups, config.o_lora_rank
    o_rows = _head_rows([(groups, o_rank)], rank, size, f"{name}: o_groups")
    _column_parallel(attn.o_a_proj, o_rows)
    attn.o_a_proj.n_groups = groups // size
    _row_parallel(attn.o_b_proj, o_rows, rank)
    # The forward reads the group count from its config: give this module its own, describing the shard.
    attn.config = copy.copy(config)
    attn.config.o_groups = groups // size
    attn.num_heads = attn.num_key_value_groups = heads // size  # one shared KV head, repeated per local head


_SHARDERS = {
    "Qwen4ExpTextGatedDeltaNet": _shard_gated_delta_net,
    "Qwen4ExpTextAttention": _shard_qwen_attention,
    "Qwen4ExpTextMLP": _shard_mlp,
    "Qwen4ExpTextExperts": _shard_experts,
    "DeepseekV4Attention": _shard_deepseek_attention,
    "DeepseekV4MLP": _shard_mlp,
    "DeepseekV4Experts": _shard_experts,
}

# Sub-layers whose output is a partial sum after sharding, and so gets the all-reduce. The MoE blocks
# reduce once, after the routed and shared experts' partial outputs are added.
_REDUCED_OUTPUTS = frozenset(
    {
        "Qwen4ExpTextGatedDeltaNet",
        "Qwen4ExpTextAttention",
        "Qwen4ExpTextSparseMoeBlock",
        "DeepseekV4Attention",
        "DeepseekV4SparseMoeBlock",
    }
)

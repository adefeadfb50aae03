"""The tensor-parallel rank and size a model is built or sharded for."""

from __future__ import annotations

import torch.distributed as dist


def resolve_tp(
    tp_rank: int | None = None, tp_size: int | None = None, group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """``(rank, size)`` of tensor parallelism: explicit values win, else ``group``'s (default: the default
    process group), else 1. A DP x TP job passes its TP group: rank and size are then the rank within it."""
    initialised = dist.is_available() and dist.is_initialized()
    if group is not None and not initialised:
        raise ValueError("a TP group needs torch.distributed to be initialised")
    if tp_size is None:
        tp_size = dist.get_world_size(group) if initialised else 1
    if tp_rank is None:
        tp_rank = dist.get_rank(group) if initialised and tp_size > 1 else 0
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size - 1}] and tp_size >= 1, got {tp_rank}, {tp_size}")
    return tp_rank, tp_size

"""The tensor-parallel rank and size a model is built or sharded for."""

from __future__ import annotations

import torch.distributed as dist


def resolve_tp(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """``(rank, size)`` of tensor parallelism: explicit values win, else the default process group, else 1."""
    initialised = dist.is_available() and dist.is_initialized()
    if tp_size is None:
        tp_size = dist.get_world_size() if initialised else 1
    if tp_rank is None:
        tp_rank = dist.get_rank() if initialised and tp_size > 1 else 0
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size - 1}] and tp_size >= 1, got {tp_rank}, {tp_size}")
    return tp_rank, tp_size

"""``torch.ops.hcpasses.shard_rows``: this rank's token rows of a replicated tensor, padded to ceil(N/tp).

The first ``token_dims`` dims of ``x`` hold the N tokens (``[T, ...]``, or ``[batch, seq, ...]`` with
``token_dims=2``: token i is row i of ``x`` flattened over those dims). The shard keeps the rank of
``x``: its token dims become ``[1, ..., 1, R]``, so every op written for the full tensor (reductions and
reshapes addressed by dim) still applies to the shard.

Slice first, then pad only the slice (padding the whole tensor first cost 2.5 GiB per rank at 131k
tokens in the seed). Pad rows are zeros. A custom op rather than slice + pad in ATen: its fake impl
states the padded size ``ceil(N/tp)`` directly, which the SP pass needs for symbolic sizes.

The row arithmetic below is the one place it is written: it works on ints, SymInts and ``fx.Proxy`` values (the
SP emission applies it to proxies of a symbolic N, which writes the same arithmetic into the graph).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rows_per_rank(tokens: Any, world_size: int) -> Any:
    """``R = ceil(tokens / world_size)``: the rows each rank holds."""
    return (tokens + world_size - 1) // world_size


def pad_rows(tokens: Any, world_size: int) -> Any:
    """``R * world_size - tokens``: the zero rows that make ``tokens`` rows split evenly across the ranks."""
    return rows_per_rank(tokens, world_size) * world_size - tokens


def shard_token_sizes(rows: Any, token_dims: int) -> list[Any]:
    """A shard's token dims: ``[1, ..., 1, rows]`` (it keeps the rank of the value it shards)."""
    return [*([1] * (token_dims - 1)), rows]


def shard_shape(shape: torch.Size, token_dims: int, world_size: int) -> list:
    """The shape of a shard: token dims ``[1, ..., 1, R]``, the other dims unchanged."""
    rows = rows_per_rank(math.prod(shape[:token_dims]), world_size)
    return [*shard_token_sizes(rows, token_dims), *shape[token_dims:]]


@torch.library.custom_op("hcpasses::shard_rows", mutates_args=())
def shard_rows(x: torch.Tensor, rank: int, world_size: int, token_dims: int = 1) -> torch.Tensor:
    """Token rows ``[rank*R, (rank+1)*R)`` of ``x`` (R = ceil(N/world_size)), zero-padded to R rows."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_rows: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not 1 <= token_dims <= x.dim():
        raise ValueError(f"shard_rows: token_dims must be in [1, {x.dim()}] for a {x.dim()}-D tensor, got {token_dims}")
    flat = x.flatten(0, token_dims - 1)
    rows = rows_per_rank(flat.shape[0], world_size)
    piece = flat[rank * rows : (rank + 1) * rows]
    out = flat.new_zeros((rows, *flat.shape[1:]))
    out[: piece.shape[0]] = piece
    return out.view(shard_shape(x.shape, token_dims, world_size))


@shard_rows.register_fake
def _(x: torch.Tensor, rank: int, world_size: int, token_dims: int = 1) -> torch.Tensor:
    return x.new_empty(shard_shape(x.shape, token_dims, world_size))

"""``torch.ops.hcpasses.shard_rows``: this rank's rows of a replicated tensor, padded to ceil(T/tp).

Slice first, then pad only the slice (padding the whole tensor first cost 2.5 GiB per rank at 131k
tokens in the seed). Pad rows are zeros. A custom op rather than slice + pad in ATen: its fake impl
states the padded size ``ceil(T/tp)`` directly, which the SP pass needs for symbolic T.
"""

from __future__ import annotations

import torch


def rows_per_rank(tokens: int, world_size: int) -> int:
    """``ceil(tokens / world_size)``; works on ints and SymInts."""
    return (tokens + world_size - 1) // world_size


@torch.library.custom_op("hcpasses::shard_rows", mutates_args=())
def shard_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows ``[rank*R, (rank+1)*R)`` of ``x`` (R = ceil(T/world_size)), zero-padded to R rows."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_rows: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    rows = rows_per_rank(x.shape[0], world_size)
    piece = x[rank * rows : (rank + 1) * rows]
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: piece.shape[0]] = piece
    return out


@shard_rows.register_fake
def _(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return x.new_empty((rows_per_rank(x.shape[0], world_size), *x.shape[1:]))

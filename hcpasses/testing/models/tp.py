"""Tensor-parallel linear layers and deterministic, TP-independent weight init.

Every rank builds each FULL weight from a generator seeded by ``(seed, name)`` and keeps its slice, so a
model built with tp=1 and one built with tp=k from the same seed hold the same weights, and replicated
weights are equal on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hcpasses.tp import resolve_tp


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from ``(seed, name)``, the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_normal(
    seed: int, name: str, shape: Sequence[int], std: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A full ``N(0, std^2)`` tensor drawn on CPU in fp32 from the generator seeded by ``(seed, name)``."""
    gen = torch.Generator().manual_seed(stable_seed(seed, name))
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std).to(dtype)


def replicated_parameter(seed: int, name: str, shape: Sequence[int], std: float, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter holding the whole seeded tensor (the same on every rank)."""
    return nn.Parameter(seeded_normal(seed, name, shape, std, dtype), requires_grad=False)


def take_shard(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The ``tp_rank``-th of ``tp_size`` equal contiguous slices of ``full`` along ``dim`` (a copy)."""
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is not divisible by the TP size {tp_size}")
    step = full.shape[dim] // tp_size
    return full.narrow(dim, tp_rank * step, step).clone()


def column_parallel_weight(
    in_features: int,
    out_features: Sequence[int],
    *,
    seed: int,
    name: str,
    dtype: torch.dtype,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """This rank's ``[sum(out_features)/tp, in_features]`` weight of a merged column-parallel projection.

    Each part (e.g. q, k, v) is drawn whole from ``(seed, f"{name}.{i}")`` and sharded on its own, then the
    shards are stacked, so rank r holds heads/channels r of every part.
    """
    std = in_features**-0.5
    shards = [
        take_shard(seeded_normal(seed, f"{name}.{i}", (out, in_features), std), 0, tp_rank, tp_size)
        for i, out in enumerate(out_features)
    ]
    return torch.cat(shards, dim=0).to(dtype)


class _ParallelLinear(nn.Module):
    """A frozen linear layer holding this rank's shard (``_local_weight``) of the weights seeded by ``(seed, name)``.

    Rank and size are ``group``'s (default: the default process group) unless given.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        seed: int,
        name: str,
        dtype: torch.dtype = torch.float32,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size, group)
        self.group = group  # the TP group; None: the default one
        weight = self._local_weight(in_features, out_features, seed=seed, name=name, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def _local_weight(
        self, in_features: int, out_features: int | Sequence[int], *, seed: int, name: str, dtype: torch.dtype
    ) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W_r^T`` with the output features sharded across ranks (no communication).

    ``out_features`` may be a sequence of parts (a merged projection such as qkv or gate_up): each part is
    sharded separately and the local output is the concatenation of this rank's shard of every part.
    """

    def _local_weight(
        self, in_features: int, out_features: int | Sequence[int], *, seed: int, name: str, dtype: torch.dtype
    ) -> torch.Tensor:
        parts = [out_features] if isinstance(out_features, int) else list(out_features)
        return column_parallel_weight(
            in_features, parts, seed=seed, name=name, dtype=dtype, tp_rank=self.tp_rank, tp_size=self.tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local output ``[T, sum(out_features)/tp]``."""
        return F.linear(x, self.weight)


class RowParallelLinear(_ParallelLinear):
    """``y = all_reduce(x_r @ W_r^T)`` over the TP group, with the input features sharded across its ranks
    (``out_features``: an int)."""

    def _local_weight(
        self, in_features: int, out_features: int | Sequence[int], *, seed: int, name: str, dtype: torch.dtype
    ) -> torch.Tensor:
        assert isinstance(out_features, int)
        full = seeded_normal(seed, name, (out_features, in_features), in_features**-0.5)
        return take_shard(full, 1, self.tp_rank, self.tp_size).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Full output ``[T, out_features]``, summed over the TP group's ranks in place when tp > 1."""
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y

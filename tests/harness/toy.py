"""Small tensor-parallel models for the harness tests, and the function real gloo ranks run.

Weights are drawn whole from a seeded generator on every rank and each rank keeps its slice, so the
models of every TP size compute the same function (up to the order of the sums).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

D_MODEL = 16
D_HIDDEN = 48  # divisible by 1, 2, 3 and 4


def full_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsharded ``w1 [D_HIDDEN, D_MODEL]`` and ``w2 [D_MODEL, D_HIDDEN]`` drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(D_HIDDEN, D_MODEL, generator=gen) * D_MODEL**-0.5
    w2 = torch.randn(D_MODEL, D_HIDDEN, generator=gen) * D_HIDDEN**-0.5
    return w1, w2


def _shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """The ``rank``-th of ``tp`` equal slices of ``full`` along ``dim`` (a copy)."""
    return full.chunk(tp, dim=dim)[rank].clone()


class _ToyBase(nn.Module):
    """Column-parallel ``w1`` (rows sharded) and row-parallel ``w2`` (columns sharded)."""

    def __init__(self, rank: int, tp: int, seed: int = 0) -> None:
        super().__init__()
        w1, w2 = full_weights(seed)
        self.w1 = nn.Parameter(_shard(w1, 0, rank, tp), requires_grad=False)
        self.w2 = nn.Parameter(_shard(w2, 1, rank, tp), requires_grad=False)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``relu(x @ w1_r^T) @ w2_r^T`` of the output, ``[T, D_MODEL]``."""
        return F.linear(F.relu(F.linear(x, self.w1)), self.w2)


class ToyMLP(_ToyBase):
    """Column-parallel linear, relu, row-parallel linear, in-place ``dist.all_reduce`` (if a group exists)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, D_MODEL] -> [T, D_MODEL]``."""
        y = self.partial(x)
        if dist.is_initialized():
            dist.all_reduce(y)
        return y


class ToySP(_ToyBase):
    """Sequence-parallel variant: reduce-scatter rows, a row-local op on the shard, all-gather, residual.

    Uses ``torch.distributed._functional_collectives`` and needs a default group; T divisible by tp.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, D_MODEL] -> [T, D_MODEL]``."""
        group = dist.group.WORLD
        rows = funcol.reduce_scatter_tensor(self.partial(x), "sum", 0, group)
        rows = F.silu(rows) * 2.0
        return funcol.all_gather_tensor(rows, 0, group) + x


def dense_reference(x: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """What ToyMLP and ToySP compute, from the unsharded weights, with no communication."""
    w1, w2 = full_weights(seed)
    y = F.linear(F.relu(F.linear(x, w1)), w2)
    return {"mlp": y, "sp": F.silu(y) * 2.0 + x}


def build_toy_mlp(rank: int, tp: int, seed: int = 0) -> nn.Module:
    """A :class:`ToyMLP` for ``rank`` of ``tp``."""
    return ToyMLP(rank, tp, seed)


def build_toy_sp(rank: int, tp: int, seed: int = 0) -> nn.Module:
    """A :class:`ToySP` for ``rank`` of ``tp``."""
    return ToySP(rank, tp, seed)


def build_hc_decoder(rank: int, tp: int, **config: Any) -> nn.Module:
    """``hcpasses.testing.models.HCDecoder(HCConfig.tiny(**config), tp_rank=rank, tp_size=tp)`` (imported lazily)."""
    from hcpasses.testing.models import HCConfig, HCDecoder

    return HCDecoder(HCConfig.tiny(**config), tp_rank=rank, tp_size=tp)


Job = tuple[str, Callable[[int, int], nn.Module], Sequence[Any]]


class JobError(str):
    """The traceback of a job of :func:`eager_outputs` that raised (returned instead of its output)."""


def eager_outputs(rank: int, tp: int, jobs: Sequence[Job]) -> dict[str, Any]:
    """Run each ``(name, build_fn, args)`` job eagerly on this rank without grad; results by name.

    Meant for :func:`hcpasses.testing.multiproc.run_ranks` (a real gloo group is initialised): one launch runs
    several models, since starting the processes costs seconds. A job that raises yields a
    :class:`JobError` so that the other jobs' results still come back. A job that hangs in a collective
    hangs the launch (run_ranks' deadline then fails it).
    """
    results: dict[str, Any] = {}
    with torch.no_grad():
        for name, build_fn, args in jobs:
            try:
                results[name] = build_fn(rank, tp)(*args)
            except Exception:
                results[name] = JobError(traceback.format_exc())
    return results


class HCStack(nn.Module):
    """The parts of the HC test models below: an embedding, ``2 * n_layers`` pairs of an HC block and a TP MLP, the
    final mixer and an LM head, all from ``cfg``'s seed (the TP rank and size from the default group)."""

    def __init__(self, cfg: Any) -> None:
        from hcpasses.testing.models.decoder import MLP
        from hcpasses.testing.models.hc import FinalMixer, HyperConnection
        from hcpasses.testing.models.tp import replicated_parameter

        super().__init__()
        self.cfg = cfg
        self.embed = replicated_parameter(cfg.seed, "embed", (cfg.vocab_size, cfg.hidden), 1.0, cfg.dtype)
        self.blocks = nn.ModuleList(
            nn.ModuleList([HyperConnection(cfg, name=f"hc.{i}"), MLP(cfg, name=f"mlp.{i}", tp_rank=None, tp_size=None)])
            for i in range(2 * cfg.n_layers)
        )
        self.final_mixer = FinalMixer(cfg, name="final_mixer")
        self.lm_head = replicated_parameter(cfg.seed, "lm_head", (cfg.vocab_size, cfg.hidden), 0.2, cfg.dtype)


class BatchedHCModel(HCStack):
    """HC blocks around TP MLPs in the transformers layout: ``ids [batch, seq] -> logits [batch, seq, vocab]``.

    Streams are ``[batch, seq, n*S]``. Layer ``seq_mix_layer`` starts by adding each token's predecessor
    in its sequence to it (an op along seq: not row-local). With ``return_state`` the HC state after the
    last combine is returned as well (the MTP exit).
    """

    def __init__(self, cfg: Any, seq_mix_layer: int | None = None, return_state: bool = False) -> None:
        super().__init__(cfg)
        self.seq_mix_layer, self.return_state = seq_mix_layer, return_state

    def forward(self, ids: torch.Tensor) -> Any:
        h = F.embedding(ids, self.embed).repeat(1, 1, self.cfg.n_streams)
        for i, (hc, mlp) in enumerate(self.blocks):
            if i == 2 * (self.seq_mix_layer if self.seq_mix_layer is not None else -1):
                h = h + 0.5 * F.pad(h, (0, 0, 1, 0))[:, :-1]
            x, logits = hc.mix(h)
            h = hc.combine(h, mlp(x), logits)
        out = F.linear(self.final_mixer(h), self.lm_head)
        return (out, h) if self.return_state else out


class SequencesHCModel(HCStack):
    """HC blocks around TP MLPs in the vLLM layout, ``ids [T], seqs -> logits [T, vocab]``: T rows of ``seqs`` equal
    sequences. Each MLP's input first adds to every token half its predecessor in the same sequence, through
    ``unflatten(0, (seqs, T // seqs))`` and back (under symbolic sizes the MLP's output has ``seqs*(T//seqs)`` rows).
    """

    def forward(self, ids: torch.Tensor, seqs: int) -> torch.Tensor:
        tokens = ids.shape[0]
        h = F.embedding(ids, self.embed).repeat(1, self.cfg.n_streams)
        for hc, mlp in self.blocks:
            x, logits = hc.mix(h)
            per_seq = x.unflatten(0, (seqs, tokens // seqs))
            per_seq = per_seq + 0.5 * F.pad(per_seq, (0, 0, 1, 0))[:, :-1]
            h = hc.combine(h, mlp(per_seq.flatten(0, 1)), logits)
        return F.linear(self.final_mixer(h), self.lm_head)


def with_sizes(inputs: list[Any], gm: torch.fx.GraphModule, ids: torch.Tensor, sizes: dict[int, int]) -> list[Any]:
    """A dynamic capture's inputs for other ids: the integer tensor input replaced by ``ids``, and each symbolic
    size by ``sizes[its captured value]`` (capture with example sizes that differ from each other)."""
    values = []
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs, strict=True):
        if isinstance(node.meta["val"], torch.SymInt):
            value = sizes[value]
        elif isinstance(value, torch.Tensor) and not value.is_floating_point():
            value = ids
        values.append(value)
    return values

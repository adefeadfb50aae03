"""The MTP drafter of an HC decoder (DESIGN §2): one extra HC decoder layer that drafts the token after next.

At position i the drafter reads the target's HC state ``h_i`` (the streams after the target's last combine)
and the embedding of the next token ``t_{i+1}``, and predicts ``t_{i+2}``:

    h = rms_norm_nS(h_i) + (E[t_{i+1}] @ W_proj^T) on every stream    # row-local: pointwise, last-dim reductions
    h = HCDecoderLayer(h)                                              # attention HC + MLP HC, no PLE
    logits = lm_head(final_norm(FinalMixer(h)))                        # its own mixer and norm, shared lm_head

and returns its output streams too: a second draft step reads them in place of the target's state.
Tensor-parallel like the target: the layer's attention and MLP are column/row-parallel with an all-reduce,
everything else is replicated, and every weight is seeded by its name, so any TP size computes the same
function. The embedding table and lm_head are the target's (shared tensors, or equal ones seeded by the
same names when no target is given).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .decoder import DecoderCache, HCDecoder, HCDecoderLayer, cache_length, rope_tables
from .hc import NORM_WEIGHT_STD, FinalMixer, grouped_rms_norm
from .tp import replicated_parameter


class MTPDrafter(nn.Module):
    """``forward(state, next_ids) -> (logits [T, vocab], streams [T, n*S])``; ``step`` does it with a KV cache.

    ``target``: the model whose embedding table and lm_head are shared (the same tensors). Without it the
    drafter seeds both from the target's parameter names, which gives equal values. ``group``: the TP group, as
    for :class:`HCDecoder`.
    """

    def __init__(
        self,
        cfg: HCConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        *,
        target: HCDecoder | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_rank, self.tp_size = cfg.tp_of(tp_rank, tp_size, group)
        seed, dtype, hidden = cfg.seed, cfg.dtype, cfg.hidden
        if target is not None:
            self.embed, self.lm_head = target.embed, target.lm_head
        else:
            self.embed = replicated_parameter(seed, "embed", (cfg.vocab_size, hidden), 1.0, dtype)
            self.lm_head = replicated_parameter(seed, "lm_head", (cfg.vocab_size, hidden), hidden**-0.5, dtype)
        self.input_norm_weight = replicated_parameter(
            seed, "mtp.input_norm_weight", (cfg.streams_width,), NORM_WEIGHT_STD, dtype
        )
        self.embed_proj = replicated_parameter(seed, "mtp.embed_proj", (hidden, hidden), hidden**-0.5, dtype)
        # Index n_layers names it "layers.{n_layers}": its own seeds, after the target's layers (DeepSeek's
        # MTP naming), and never a PLE layer (ple_layer < n_layers).
        self.layer = HCDecoderLayer(cfg, cfg.n_layers, tp_rank=self.tp_rank, tp_size=self.tp_size, group=group)
        self.final_mixer = FinalMixer(cfg, name="mtp.final_mixer")
        self.final_norm_weight = replicated_parameter(seed, "mtp.final_norm_weight", (hidden,), NORM_WEIGHT_STD, dtype)

    def streams_in(self, state: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """The layer's input streams ``[T, n*S]`` from a state ``[T, n, S]`` or ``[T, n*S]`` and ids ``[T]``.

        Row-local (pointwise ops and reductions over the last dim only), so a sequence-parallel pass can keep
        a row-sharded state sharded into the drafter.
        """
        cfg = self.cfg
        # Checking the widths also makes them constants under torch.compile(dynamic=True), which would else
        # trace the state's widths as symbols: HC patterns, matched at fixed widths, would then not be found.
        widths = tuple(state.shape[1:])
        if widths not in ((cfg.n_streams, cfg.hidden), (cfg.streams_width,)):
            raise ValueError(f"the HC state must be [T, {cfg.n_streams}, {cfg.hidden}] or [T, {cfg.streams_width}]")
        normed = grouped_rms_norm(state.flatten(1), self.input_norm_weight, cfg.streams_width, cfg.eps)
        embedded = F.linear(F.embedding(next_ids, self.embed), self.embed_proj)
        return normed + embedded.repeat(1, cfg.n_streams)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final mixer, final norm and the shared lm_head: ``h [T, n*S] -> [T, vocab]``."""
        x = grouped_rms_norm(self.final_mixer(h), self.final_norm_weight, self.cfg.hidden, self.cfg.eps)
        return F.linear(x, self.lm_head)

    def forward(self, state: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft over positions ``0..T-1``: row i reads ``state[i]`` and ``next_ids[i]`` (the token at i+1)."""
        h = self.streams_in(state, next_ids)
        rope = rope_tables(next_ids.shape[0], self.cfg.head_dim, h.device, h.dtype)
        h = self.layer(h, next_ids, rope)
        return self.logits(h), h

    def step(
        self, state: torch.Tensor, next_ids: torch.Tensor, cache: DecoderCache
    ) -> tuple[torch.Tensor, torch.Tensor, DecoderCache]:
        """:meth:`forward` on positions ``L..L+T-1`` after the L in ``cache``; returns the grown cache too."""
        h = self.streams_in(state, next_ids)
        rope = rope_tables(next_ids.shape[0], self.cfg.head_dim, h.device, h.dtype, start=cache_length(cache))
        h, layer_cache = self.layer.step(h, next_ids, rope, cache[0])
        return self.logits(h), h, (layer_cache,)

    def empty_cache(self) -> DecoderCache:
        """The cache before the first position, on the drafter's device."""
        return (self.layer.empty_cache(self.embed.device, self.embed.dtype),)


def prefill_target_and_drafter(
    target: HCDecoder, drafter: MTPDrafter, input_ids: torch.Tensor, next_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target and drafter over a prompt: ``(target_logits, drafter_logits, drafter_streams)``.

    ``next_ids[i]`` is the token after ``input_ids[i]``. Compile this one function to get both models in
    one graph, where the target's HC state goes straight into the drafter.
    """
    target_logits, state = target(input_ids, return_hc_state=True)
    drafter_logits, streams = drafter(state, next_ids)
    return target_logits, drafter_logits, streams

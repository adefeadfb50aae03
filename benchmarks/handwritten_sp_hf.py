"""Hand-written sequence parallelism (SP) of transformers' ``qwen4_exp`` and ``deepseek_v4``: the anchor for hcpasses'
SP (issue #27).

What a serving team writes by hand today (vLLM's ``--enable-hc-sp``, ATOM), for a model that
``hcpasses.hf.shard_for_tp`` has sharded for tensor parallelism: :func:`handwritten_sp` wraps a ``Qwen4ExpForCausalLM``
in :class:`HandwrittenSPQwen4Exp` and a ``DeepseekV4ForCausalLM`` in :class:`HandwrittenSPDeepseekV4`, which hold the
same modules (the same weights) and compute the same logits, but keep the n = 4 HC residual streams sharded by token
rows across the TP ranks for the whole forward (DESIGN §4):

    ids -> embed(L rows) -> streams[L, nS] -> per layer: PLE(L rows) -> HC pre(L rows) -> x[L, S] -> all-gather
    -> x[T, S] -> sub-layer shard -> partial[T, S] -> reduce-scatter -> y[L, S] -> HC post(L rows) -> ...
    -> mixer(L rows) -> gather the kept rows -> lm_head

Rank r owns token rows ``r*L : (r+1)*L`` with ``L = ceil(T / tp)``; the slice is taken first and only the slice is
padded with zero rows (the last ranks hold the padding; T < tp leaves some ranks only padding). Gathers trim back to T.

- Sharded from the start: the embedding is looked up for this rank's ids only, so nothing before the first HC block
  runs on all T rows.
- HC blocks (replicated weights): qwen4_exp's ``Qwen4ExpTextGatedResidual`` (the grouped norm, the low-rank GEMMs,
  the gated mean and the inject weights) and deepseek_v4's ``DeepseekV4HyperConnection`` (the norm over all nS, the
  projection to pre / post / comb, Sinkhorn, the collapse) run on the local rows; so does the write-back after the
  sub-layer (qwen4_exp: ``h + y * inject``; deepseek_v4: ``post * y + comb^T @ h``).
- Sub-layers (GatedDeltaNet, attention with its QSA indexer or its compressor, MoE) need every token: they take the
  all-gathered x (``[T, S]``: the n-times narrower collapsed input, never the streams). deepseek_v4's sub-layer norm
  (``input_layernorm`` / ``post_attention_layernorm``, fp32 weights over the model-dtype collapse) runs on the local
  rows before the gather, which then moves the norm's output in the model's dtype. Their output is reduce-scattered
  instead of all-reduced: the sub-layers' ``forward`` is called directly, so the all-reduce hook ``shard_for_tp`` put
  on them does not run, and the reduce-scatter here is the only reduction. deepseek_v4's hash-routed MoE reads the
  replicated ids of all T tokens, as its gathered rows are all T.
- qwen4_exp's PLE (``Qwen4ExpTextPLELayer``, one layer of the real checkpoint): its n-gram embedding reads the ids
  of the ``ngram_size - 1`` tokens before each row, which every rank has (the ids are replicated): each rank embeds
  its rows from a window of ids that starts that many tokens earlier. Its gate, values and norms are row-local. Its
  short causal conv (kernel k, dilation d) looks ``(k - 1) * d`` rows back: each rank all-gathers only the last
  ``min(L, (k - 1) * d)`` rows of the conv input from every rank (a halo, not the tensor) and takes the rows just
  before its own (zeros before the sequence start, as the conv's padding). Pad rows pass through the conv and are
  trimmed at the next gather.
- The end: the final mixer (qwen4_exp) or HC head and final norm (deepseek_v4) runs on the local rows. With
  ``logits_to_keep=1`` (serving's prefill) only the last token's row is needed: every rank contributes one row of the
  mixer output (the row at the last token's local index) to one small all-gather and keeps the owner's; only that
  row goes through ``lm_head`` (hcpasses does the same from the graph's slice: ``sp_rewrite.kept``). Any other
  ``logits_to_keep`` gathers the mixer output ``[T, S]`` and slices it as transformers does (0: every token).

Collectives per forward at tp > 1, with D decoder layers and P PLE layers: 2D all-gathers of x, 2D reduce-scatters,
P halo all-gathers, one final all-gather, and no all-reduce (the streams are never reduced nor gathered). At tp = 1
there are none. They are the ``torch.ops._c10d_functional`` ops that the functional collectives lower to, called
directly as ``hcpasses.testing.models.sp_handwritten`` does (the same ops in eager and in Dynamo's graph on torch 2.11
and 2.13, whereas 2.13 deprecates the ``all_gather_tensor`` / ``reduce_scatter_tensor`` wrappers with a warning per
eager call), on the TP group given (default: the default group, as ``shard_for_tp``), so simulated TP's stand-ins
serve them and real gloo / NCCL run them.

Not supported, each refused with a ``ValueError`` that names it: another model family, a batch of more than one
sequence, a model that ``shard_for_tp`` did not shard for the group's size, a ``logits_to_keep`` that is not an
int >= 0. The wrapper's forward takes ``input_ids`` and ``logits_to_keep`` only: no cache (prefill), no attention
mask (no padding), no ``inputs_embeds``. FP8 models (``swap_fp8_linears``) run, but x is gathered in the model's
dtype and each FP8 projection quantises the gathered rows; quantising before the gather (half the bytes, as
hcpasses' fusion does) would mean rewriting the sub-layers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutput

from hcpasses.rows import rows_per_rank
from hcpasses.tp import resolve_tp

c10d_functional = torch.ops._c10d_functional


def pad_rows(x: torch.Tensor, rows: int, front: bool = False) -> torch.Tensor:
    """``x [1, m, ...]`` with zero rows added up to ``rows`` rows, after its rows (or before them: ``front``)."""
    missing = rows - x.shape[1]
    widths = [0, 0] * (x.dim() - 2) + ([missing, 0] if front else [0, missing])
    return F.pad(x, widths)


@dataclass(frozen=True)
class TokenRows:
    """This rank's share of one sequence's T tokens: rows ``[start, start + local)``, ``local = ceil(T / size)``.

    Tensors are ``[1, rows, ...]`` (batch, tokens, features). ``size == 1`` communicates nothing.
    """

    tokens: int
    rank: int
    size: int
    group_name: str

    @property
    def local(self) -> int:
        return rows_per_rank(self.tokens, self.size)

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def real(self) -> int:
        """The rows of the sequence this rank holds (``local`` but at the end; 0 on a rank with padding only)."""
        return max(0, min(self.local, self.tokens - self.start))

    def mine(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a replicated ``x [1, T, ...]``, not padded."""
        return x[:, self.start : self.start + self.real]

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[1, local, ...]`` rows in order, trimmed to ``[1, T, ...]``."""
        return self._all_gather(x_local)[:, : self.tokens]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``partial [1, T, ...]``, this rank's ``[1, local, ...]`` rows of it (pad rows zero)."""
        if self.size == 1:
            return partial
        padded = pad_rows(partial, self.local * self.size)[0].contiguous()
        scattered = c10d_functional.reduce_scatter_tensor(padded, "sum", self.size, self.group_name)
        return c10d_functional.wait_tensor(scattered).unsqueeze(0)

    def preceding(self, x_local: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` rows of the sequence just before this rank's first row, ``[1, count, ...]``, zeros before
        the sequence start.

        One all-gather of every rank's last ``min(local, count)`` rows: when ``local >= count`` the previous rank's
        tail holds them all; when it is shorter, the tails are whole shards, which together hold every earlier row.
        """
        tail = min(self.local, count)
        tails = self._all_gather(x_local[:, self.local - tail :])
        before = self.rank * tail  # the gathered rows of the ranks before this one
        return pad_rows(tails[:, max(0, before - count) : before], count, front=True)

    def last_token(self, x_local: torch.Tensor) -> torch.Tensor:
        """Row T - 1 of the sequence, ``[1, 1, ...]``, from one all-gather of one row per rank."""
        index, owner = (self.tokens - 1) % self.local, (self.tokens - 1) // self.local
        rows = self._all_gather(x_local[:, index : index + 1])  # the owner's is the last token's row
        return rows[:, owner : owner + 1]

    def _all_gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """``[1, m, ...]`` of every rank, concatenated in rank order: ``[1, size * m, ...]``."""
        if self.size == 1:
            return x_local
        gathered = c10d_functional.all_gather_into_tensor(x_local[0].contiguous(), self.size, self.group_name)
        return c10d_functional.wait_tensor(gathered).unsqueeze(0)


@dataclass(frozen=True)
class Prefill:
    """What every layer of one forward reads: the rows, the replicated ids, and the full-sequence attention inputs
    as the family's attention takes them (``None`` when no layer is an attention layer)."""

    rows: TokenRows
    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    position_embeddings: Any
    causal_mask: torch.Tensor | None


class HandwrittenSP(nn.Module, ABC):
    """A ``shard_for_tp``-ed causal LM with hand-written SP: the same modules, the same logits. The forward both
    families share; a subclass says how its streams start, how a decoder layer runs on the local rows, what the exit
    computes before ``lm_head`` and which attention inputs its layers read.

    ``forward(input_ids [1, T], logits_to_keep)`` returns a ``CausalLMOutput`` whose ``logits`` are replicated on
    every rank. Build it with :func:`handwritten_sp`.
    """

    def __init__(self, causal_lm: nn.Module, rank: int, size: int, group_name: str) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.rank, self.size, self.group_name = rank, size, group_name

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> CausalLMOutput:
        check_call(input_ids, logits_to_keep)
        model = self.causal_lm.model
        rows = TokenRows(input_ids.shape[1], self.rank, self.size, self.group_name)
        embeds = pad_rows(model.embed_tokens(rows.mine(input_ids)), rows.local)
        # A view with the whole sequence's shape: the rotary tables and the masks read only its shape, dtype, device.
        whole = embeds[:, :1].expand(1, rows.tokens, -1)
        prefill = Prefill(rows, input_ids, *self.attention_inputs(whole))
        h_local = self.streams(embeds)
        for layer in model.layers[: model.config.num_hidden_layers]:
            h_local = self.decoder_layer(layer, h_local, prefill)
        x_local = self.exit(h_local)
        x = rows.last_token(x_local) if logits_to_keep == 1 else rows.gather(x_local)[:, -logits_to_keep:]
        return CausalLMOutput(logits=self.causal_lm.lm_head(x))

    @abstractmethod
    def streams(self, embeds: torch.Tensor) -> torch.Tensor:
        """The HC streams of the local rows from their embeddings ``[1, local, S]``."""

    @abstractmethod
    def decoder_layer(self, layer: nn.Module, h_local: torch.Tensor, prefill: Prefill) -> torch.Tensor:
        """One decoder layer on the local stream rows."""

    @abstractmethod
    def exit(self, h_local: torch.Tensor) -> torch.Tensor:
        """What ``lm_head`` reads, ``[1, local, S]``, from the last layer's local stream rows."""

    @abstractmethod
    def attention_inputs(self, whole: torch.Tensor) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The positions, rotary tables and mask of all T positions, from a view ``whole [1, T, S]``."""


# qwen4_exp


def hc_around(
    hc: nn.Module, h_local: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor], rows: TokenRows
) -> torch.Tensor:
    """One qwen4_exp HC block around a sub-layer: pre and post on the local rows, the sub-layer on all rows.

    ``hc`` returns the collapsed input, the streams and the inject weights; ``sublayer`` maps x ``[1, T, S]`` to
    this rank's un-reduced output ``[1, T, S]``.
    """
    x_local, streams, inject = hc(h_local)
    y_local = rows.reduce_scatter(sublayer(rows.gather(x_local)))
    return streams + (y_local.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def ple_embeddings(ple: nn.Module, prefill: Prefill) -> torch.Tensor:
    """The PLE layer's n-gram embeddings of this rank's rows, ``[1, local, E]`` (pad rows zero).

    Each row's n-grams read the ``ngram_size - 1`` ids before it: the window of ids starts that many tokens before
    this rank's first row (at the sequence start the module puts its own EOS context there, as for the whole
    sequence). A rank with only padding embeds the last ids and keeps none of them.
    """
    rows, ids = prefill.rows, prefill.input_ids
    begin = max(0, min(rows.start, rows.tokens - 1) - ple.ple_embedding.context_len)
    embedded = ple.ple_embedding(ids[:, begin : rows.start + rows.real], None)
    return pad_rows(embedded[:, embedded.shape[1] - rows.real :], rows.local)


def ple_on_rows(ple: nn.Module, h_local: torch.Tensor, prefill: Prefill) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer.forward`` (no cache, no mask) on the local rows: what it adds to the streams.

    Everything is row-local but the short causal conv, whose halo of earlier rows comes from
    :meth:`TokenRows.preceding`.
    """
    n, width = ple.hc_count, ple.hidden_size
    embeddings = ple_embeddings(ple, prefill)
    key = ple.norm_key(ple.key_proj(embeddings)).unflatten(-1, (n, width))
    query = ple.norm_query(h_local).unflatten(-1, (n, width))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(width)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * ple.value_proj(embeddings).unsqueeze(-2)).flatten(-2)
    normed = ple.norm_conv(gated)
    halo = ple.short_conv_state_len  # (kernel - 1) * dilation: the conv's reach, so no padding is needed
    window = torch.cat([prefill.rows.preceding(normed, halo), normed], dim=1)
    return gated + F.silu(ple.conv1d(window.transpose(1, 2))).transpose(1, 2)


def token_mixer(layer: nn.Module, prefill: Prefill) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's GatedDeltaNet or attention on all rows, without ``shard_for_tp``'s all-reduce hook."""
    if layer.layer_type == "linear_attention":
        return layer.linear_attn.forward
    return lambda x: layer.self_attn.forward(x, prefill.position_embeddings, prefill.causal_mask)[0]


class HandwrittenSPQwen4Exp(HandwrittenSP):
    """qwen4_exp (``Qwen4ExpForCausalLM``, text only) with hand-written SP."""

    def streams(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds.repeat(1, 1, self.causal_lm.model.config.hc_count)  # [1, local, n*S]

    def decoder_layer(self, layer: nn.Module, h_local: torch.Tensor, prefill: Prefill) -> torch.Tensor:
        """``Qwen4ExpTextDecoderLayer.forward`` on the local stream rows ``[1, local, nS]``."""
        if layer.ple is not None:
            h_local = h_local + ple_on_rows(layer.ple, h_local, prefill)
        h_local = hc_around(layer.attn_hyper_connection, h_local, token_mixer(layer, prefill), prefill.rows)
        return hc_around(layer.mlp_hyper_connection, h_local, layer.mlp.forward, prefill.rows)

    def exit(self, h_local: torch.Tensor) -> torch.Tensor:
        return self.causal_lm.model.hyper_connection_mixer(h_local)

    def attention_inputs(self, whole: torch.Tensor) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The positions, rotary tables and causal mask of all T positions, as the model makes them (attention layers
        only)."""
        model = self.causal_lm.model
        if all(layer.layer_type == "linear_attention" for layer in model.layers):
            return None, None, None
        positions = torch.arange(whole.shape[1], device=whole.device).view(1, 1, -1)
        mask = create_causal_mask(
            config=model.config,
            inputs_embeds=whole,
            attention_mask=None,
            cache=None,
            position_ids=positions[0],
            allow_is_causal_skip=False,  # the QSA indexer overlays its selection on a materialised mask
        )
        return positions[0], model.rotary_emb(whole, positions.expand(3, 1, -1)), mask


# deepseek_v4


def mhc_around(
    hc: nn.Module,
    norm: nn.Module,
    h_local: torch.Tensor,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    rows: TokenRows,
) -> torch.Tensor:
    """One deepseek_v4 mHC block around a sub-layer (``DeepseekV4DecoderLayer.forward``'s half): the collapse, the
    sub-layer's norm, the expand and the comb mix on the local rows ``[1, local, n, S]``, the sub-layer on all rows.

    The norm runs before the gather: its output (the model's dtype) is what the sub-layer reads, no wider than the
    collapse, and the norm is row-local.
    """
    dtype = h_local.dtype
    post, comb, collapsed = hc(h_local)
    y_local = rows.reduce_scatter(sublayer(rows.gather(norm(collapsed))))
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), h_local)
    return post.to(dtype).unsqueeze(-1) * y_local.unsqueeze(-2) + mixed


ROTARY_KINDS = ("main", "compress")  # DeepseekV4Model's two rotary tables: sliding layers, compressed layers


class HandwrittenSPDeepseekV4(HandwrittenSP):
    """deepseek_v4 (``DeepseekV4ForCausalLM``) with hand-written SP."""

    def streams(self, embeds: torch.Tensor) -> torch.Tensor:
        hc_mult = self.causal_lm.model.config.hc_mult
        return embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()  # [1, local, n, S]

    def decoder_layer(self, layer: nn.Module, h_local: torch.Tensor, prefill: Prefill) -> torch.Tensor:
        """``DeepseekV4DecoderLayer.forward`` (no cache) on the local stream rows."""

        def attention(x: torch.Tensor) -> torch.Tensor:
            return layer.self_attn.forward(
                x,
                position_embeddings=prefill.position_embeddings,
                position_ids=prefill.position_ids,
                attention_mask=prefill.causal_mask,
            )[0]

        def moe(x: torch.Tensor) -> torch.Tensor:
            return layer.mlp.forward(x, input_ids=prefill.input_ids)  # the hash router reads every token's id

        h_local = mhc_around(layer.attn_hc, layer.input_layernorm, h_local, attention, prefill.rows)
        return mhc_around(layer.ffn_hc, layer.post_attention_layernorm, h_local, moe, prefill.rows)

    def exit(self, h_local: torch.Tensor) -> torch.Tensor:
        model = self.causal_lm.model
        return model.norm(model.hc_head(h_local))

    def attention_inputs(self, whole: torch.Tensor) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The positions, both rotary tables (``main``, ``compress``) and the sliding-window causal mask of all T
        positions, as ``DeepseekV4Model.forward`` makes them without a cache."""
        model = self.causal_lm.model
        positions = torch.arange(whole.shape[1], device=whole.device).unsqueeze(0)
        mask = create_sliding_window_causal_mask(
            config=model.config, inputs_embeds=whole, attention_mask=None, cache=None, position_ids=positions
        )
        tables = {kind: model.rotary_emb(whole, position_ids=positions, layer_type=kind) for kind in ROTARY_KINDS}
        return positions, tables, mask


def check_call(input_ids: torch.Tensor, logits_to_keep: int) -> None:
    """``ValueError`` for a call the hand-written SP does not cover."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"handwritten SP takes one sequence, input_ids [1, T]; got shape {tuple(input_ids.shape)}")
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"handwritten SP takes logits_to_keep as an int >= 0; got {logits_to_keep!r}")


def qwen4_exp_shards(model: nn.Module) -> Iterator[tuple[str, int, int]]:
    """(what, held, full) for each sub-layer of a qwen4_exp model."""
    config = model.config
    for index, layer in enumerate(model.model.layers):
        if layer.layer_type == "linear_attention":
            heads = layer.linear_attn.num_v_heads
            yield f"layers.{index}: linear_attn value heads", heads, config.linear_num_value_heads
        else:
            width = config.num_attention_heads * layer.self_attn.head_dim
            yield f"layers.{index}: self_attn o_proj inputs", layer.self_attn.o_proj.in_features, width
        yield f"layers.{index}: mlp expert channels", layer.mlp.experts.intermediate_dim, config.moe_intermediate_size


def deepseek_v4_shards(model: nn.Module) -> Iterator[tuple[str, int, int]]:
    """(what, held, full) for each sub-layer of a deepseek_v4 model."""
    config = model.config
    for index, layer in enumerate(model.model.layers):
        yield f"layers.{index}: self_attn heads", layer.self_attn.num_heads, config.num_attention_heads
        yield f"layers.{index}: mlp expert channels", layer.mlp.experts.intermediate_dim, config.intermediate_size


# transformers' causal LM class name -> (wrapper, its sub-layers' shards)
FAMILIES: dict[str, tuple[type[HandwrittenSP], Callable[[nn.Module], Iterator[tuple[str, int, int]]]]] = {
    "Qwen4ExpForCausalLM": (HandwrittenSPQwen4Exp, qwen4_exp_shards),
    "DeepseekV4ForCausalLM": (HandwrittenSPDeepseekV4, deepseek_v4_shards),
}


def handwritten_sp(model: nn.Module, group: dist.ProcessGroup | None = None) -> HandwrittenSP:
    """``model`` (a ``Qwen4ExpForCausalLM`` or ``DeepseekV4ForCausalLM`` that ``shard_for_tp`` sharded for ``group``)
    with hand-written SP.

    ``group`` is the TP group ``shard_for_tp`` used (default: the default process group; none initialised: tp 1).
    The wrapper shares ``model``'s modules; ``model`` itself still runs as before. Raises ``ValueError`` for another
    model family or a model not sharded for the group's size.
    """
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise ValueError(f"handwritten_sp covers transformers' {' and '.join(FAMILIES)}; got {type(model).__name__}")
    wrapper, shards = family
    rank, size = resolve_tp(group=group)
    check_sharded(shards(model), size)
    name = (group or dist.group.WORLD).group_name if size > 1 else ""
    return wrapper(model, rank, size, name)


def check_sharded(shards: Iterable[tuple[str, int, int]], size: int) -> None:
    """``ValueError`` unless every sub-layer holds 1/size of its heads / channels, as ``shard_for_tp`` leaves it:
    the reduce-scatter sums the ranks' outputs, so an unsharded sub-layer would be counted size times."""
    for what, held, full in shards:
        if held * size != full:
            raise ValueError(
                f"{what} {held} of {full}: not sharded for tp = {size} (shard_for_tp it first, for the same group)"
            )

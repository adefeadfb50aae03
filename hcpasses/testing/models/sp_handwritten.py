"""Hand-written sequence parallelism for the HC decoder: what serving teams write by hand today (ATOM).

:class:`HandwrittenSPDecoder` holds exactly the weights of :class:`~.decoder.HCDecoder` (it is a
subclass with the same ``__init__``) and computes the same function, but keeps the residual streams
row-sharded across the TP ranks from layer to layer (DESIGN §4):

    streams[L, nS] -> mix(L rows) -> x[L, S] -> all_gather -> x[T, S] -> sub-layer shard -> partial[T, S]
    -> pad to L*tp rows -> reduce_scatter -> y[L, S] -> combine(L rows) -> streams[L, nS]

with ``L = ceil(T / tp)``. Edge cases, each handled here:

- Rows: rank r owns rows ``r*L : (r+1)*L`` of T; the slice is taken first and only the slice is padded
  with zero rows up to L (T < tp: some ranks own only padding). Gathers trim back to T.
- Pad rows stay zero and finite through every HC op (the norm of a zero row is zero; a zero row's
  per-token FP8 scale takes the floor ``1/(448*512)``).
- PLE (a causal conv over tokens, not row-local) at layer j: layers ``< j`` and the PLE itself run
  unsharded with the usual all-reduces; the streams are sharded right after the PLE, so layer j's own
  HC blocks already run on local rows. Without PLE the streams are sharded before layer 0.
- The sub-layers' row-parallel output projections do not all-reduce here (the reduce-scatter replaces
  the all-reduce): :func:`attention_partial` and :func:`mlp_partial` run the reference sub-layers from
  their input projection's output to the local, un-reduced output-projection product.
- FP8: x is quantised per token on local rows *before* the all-gather, and the codes (as ``uint8``) and
  the ``[L, 1]`` fp32 scales are gathered; the projection takes the gathered codes
  (:func:`fp8_linear_prequantized`). Half the bytes of gathering bf16 x, and bit-identical codes, since
  the quant is row-local.
- Exits gather: the final mixer output ``[L, S]`` before the final norm and lm_head, and the streams when
  the HC state is returned.

Collectives are the ``torch.ops._c10d_functional`` ops themselves (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``wait_tensor``): every collective API lowers to these under Dynamo in both
torch 2.11 and 2.13, so the captured graph is the same on both; the Python wrappers around them differ
between the two (2.13 deprecates ``all_gather_tensor`` / ``reduce_scatter_tensor`` in favour of
``*_single``), and the in-place ``dist.*_into_tensor`` forms would need a preallocated output that
Dynamo turns into an extra copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .decoder import MLP, Attention, HCDecoder, HCDecoderLayer, apply_rope, rope_tables
from .fp8 import FP8_DTYPE, Fp8Linear, quantize_per_token
from .hc import HyperConnection, grouped_rms_norm

c10d_functional = torch.ops._c10d_functional


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` rows."""
    return F.pad(x, (0, 0, 0, rows - x.shape[0]))


class RowShards:
    """This rank's share of the T token rows: rows ``rank*L : (rank+1)*L`` with ``L = ceil(T / size)``.

    ``size == 1`` needs no process group and communicates nothing.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.group_name = dist.group.WORLD.group_name if size > 1 else ""

    def local_rows(self, n_tokens: int) -> int:
        """``L = ceil(T / tp)``: the rows every rank holds, padding included."""
        return (n_tokens + self.size - 1) // self.size

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``x [T, ...]``, sliced first, then padded with zero rows to ``[L, ...]``."""
        rows = self.local_rows(x.shape[0])
        return pad_rows(x[self.rank * rows : (self.rank + 1) * rows], rows)

    def gather(self, x_local: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """All ranks' ``[L, ...]`` rows concatenated and trimmed to ``[T, ...]``."""
        if self.size == 1:
            return x_local[:n_tokens]
        gathered = c10d_functional.all_gather_into_tensor(x_local.contiguous(), self.size, self.group_name)
        return c10d_functional.wait_tensor(gathered)[:n_tokens]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' ``partial [T, ...]`` and keep this rank's ``[L, ...]`` rows (pad rows are zero)."""
        if self.size == 1:
            return partial
        padded = pad_rows(partial, self.local_rows(partial.shape[0]) * self.size)
        scattered = c10d_functional.reduce_scatter_tensor(padded.contiguous(), "sum", self.size, self.group_name)
        return c10d_functional.wait_tensor(scattered)


def fp8_linear_prequantized(
    layer: Fp8Linear, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """:class:`~.fp8.Fp8Linear`'s product from already quantised input (``q [T, in]``, ``scale [T, 1]``)."""
    out_features, in_features = layer.weight_q.shape
    if q.is_cuda and out_dtype == torch.bfloat16 and in_features % 16 == 0 and out_features % 16 == 0:
        return torch._scaled_mm(
            q, layer.weight_q.t(), scale_a=scale, scale_b=layer.weight_scale.t(), out_dtype=out_dtype
        )
    w = layer.weight_q.float() * layer.weight_scale
    return ((q.float() * scale) @ w.t()).to(out_dtype)


def gathered_projection(proj: nn.Module, x_local: torch.Tensor, shards: RowShards, n_tokens: int) -> torch.Tensor:
    """The input projection of all T rows, from this rank's ``x_local [L, S]``.

    FP8 projections gather the per-token codes (as ``uint8``) and scales; others gather x itself.
    """
    if isinstance(proj, Fp8Linear):
        q, scale = quantize_per_token(x_local)
        q_all = shards.gather(q.view(torch.uint8), n_tokens).view(FP8_DTYPE)
        return fp8_linear_prequantized(proj, q_all, shards.gather(scale, n_tokens), x_local.dtype)
    return proj(shards.gather(x_local, n_tokens))


def sharded_hc_sublayer(
    hc: HyperConnection,
    h_local: torch.Tensor,
    proj: nn.Module,
    finish: Callable[[torch.Tensor], torch.Tensor],
    shards: RowShards,
    n_tokens: int,
) -> torch.Tensor:
    """One HC block on local rows around a sub-layer on all rows: ``h_local [L, nS] -> [L, nS]``.

    ``proj`` is the sub-layer's input projection; ``finish`` maps its output to the sub-layer's local,
    un-reduced output ``[T, S]``, which is reduce-scattered here.
    """
    x_local, logits = hc.mix(h_local)
    partial = finish(gathered_projection(proj, x_local, shards, n_tokens))
    return hc.combine(h_local, shards.reduce_scatter(partial), logits)


def attention_partial(attn: Attention, qkv: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``Attention.forward`` from its qkv projection's output, ending in o_proj's un-reduced product."""
    q_width, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
    q = apply_rope(q.unflatten(-1, (attn.n_heads, attn.head_dim)).transpose(0, 1), rope)
    k = apply_rope(k.unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(0, 1), rope)
    v = v.unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(0, 1)
    group = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(0, 1).flatten(-2), attn.o_proj.weight)


def mlp_partial(mlp: MLP, gate_up: torch.Tensor) -> torch.Tensor:
    """``MLP.forward`` from its gate_up projection's output, ending in down's un-reduced product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down.weight)


class HandwrittenSPDecoder(HCDecoder):
    """:class:`~.decoder.HCDecoder` with hand-written sequence parallelism (same weights, same function).

    ``forward(input_ids [T], return_hc_state)`` returns what ``HCDecoder`` returns, replicated on every rank.
    """

    def __init__(self, cfg: HCConfig, tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__(cfg, tp_rank, tp_size)
        self.shards = RowShards(self.tp_rank, self.tp_size)

    def forward(
        self, input_ids: torch.Tensor, return_hc_state: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, vocab]``, or ``(logits, state [T, n, S])`` with the gathered streams."""
        cfg, n_tokens = self.cfg, input_ids.shape[0]
        h = F.embedding(input_ids, self.embed).repeat(1, cfg.n_streams)
        rope = rope_tables(n_tokens, cfg.head_dim, h.device, h.dtype)
        start = cfg.ple_layer or 0
        for layer in self.layers[:start]:
            h = layer(h, input_ids, rope)
        first = self.layers[start]
        if first.ple is not None:
            h = first.ple(h, input_ids)
        h = self.shards.shard(h)
        for layer in self.layers[start:]:
            h = self._sharded_layer(layer, h, rope, n_tokens)
        x = self.shards.gather(self.final_mixer(h), n_tokens)
        logits = F.linear(grouped_rms_norm(x, self.final_norm_weight, cfg.hidden, cfg.eps), self.lm_head)
        if return_hc_state:
            return logits, self.shards.gather(h, n_tokens).unflatten(-1, (cfg.n_streams, cfg.hidden))
        return logits

    def _sharded_layer(
        self, layer: HCDecoderLayer, h_local: torch.Tensor, rope: torch.Tensor, n_tokens: int
    ) -> torch.Tensor:
        """Both HC blocks of one layer (its PLE, if any, already ran) on local rows."""
        h_local = sharded_hc_sublayer(
            layer.attn_hc,
            h_local,
            layer.attn.qkv,
            lambda qkv: attention_partial(layer.attn, qkv, rope),
            self.shards,
            n_tokens,
        )
        return sharded_hc_sublayer(
            layer.mlp_hc, h_local, layer.mlp.gate_up, lambda gu: mlp_partial(layer.mlp, gu), self.shards, n_tokens
        )

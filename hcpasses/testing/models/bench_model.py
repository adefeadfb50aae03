"""The benchmark HC decoder: Qwen3-Next-like sub-layers with real per-token costs around the reference HC blocks.

Layers ``i % 4 == 3`` hold causal GQA attention (16 heads x 256, 2 KV heads at real size); the others a
linear-time token mixer with Gated DeltaNet (GDN) sized projections; every layer ends with a dense SwiGLU
MLP (intermediate 5632). The HC blocks, embedding, final mixer, final norm and lm_head are the reference
ones (``.hc``), replicated under TP. Sub-layers are Megatron-sharded as in ``.decoder``:
column-parallel in, row-parallel out plus an all-reduce; KV heads are replicated when tp > n_kv_heads.
With ``cfg.fp8`` the input projections are PTPC-FP8 (x quantised per token, ``set_input_projection``), the output
projections stay in the model's dtype.

T tokens are ``n_seqs`` equal-length causal sequences, concatenated (``[T, hidden]``, vLLM style): the
attention, the conv and the recurrence run per sequence. Logits are computed for the last token of each
sequence, as a prefill does (``all_logits=True``: every token).

Token mixer (``LinearMixer``), per token, with k = v = 16 heads x 128, hidden 2560 (FLOPs are 2 x MACs,
for the whole layer; each rank does 1/tp of them):

- projections: in 2560 -> q|k|v|z (4 x 2048) + beta (16), out 2048 -> 2560: 2*2560*8208 + 2*2048*2560
  = 52.5 MFLOP. GDN: the same q|k|v|z and out projections plus a 32-wide ``ba``: 52.6 MFLOP.
- causal depthwise conv (kernel 4) over q|k|v (6144 channels) and SiLU: 0.05 MFLOP, as in GDN.
- recurrence, chunked (chunk C = 64, d = 128) linear attention without decay, per head: intra-chunk
  ``QK^T`` and ``(QK^T)V`` 4*C*d, chunk state ``K^T V`` and ``Q S`` 4*d^2: 98 kFLOP, 1.6 MFLOP for 16
  heads. GDN's chunked delta rule (the FLA kernel's steps) adds ``KK^T``, the W = A K and U = A V
  products and the state correction ``U - W S``: about 180 kFLOP per head, 2.9 MFLOP.
- gated RMSNorm and gates: elementwise, as in GDN.

So the surrogate does about 54.1 MFLOP per token against GDN's 55.5 (within 3 %); the recurrence is 3 %
of the surrogate's FLOPs and 5 % of GDN's. Bytes: the same weights (26 M parameters, 50 MiB in bf16,
split over the ranks), the same projection outputs, and one ``[d, d]`` state per chunk and head (bf16,
with an fp32 prefix sum), as the FLA kernel stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .decoder import PLELayer, apply_rope, output_projection, rope_tables
from .fp8 import Fp8Linear
from .hc import NORM_WEIGHT_STD, FinalMixer, HyperConnection, grouped_rms_norm
from .sp_handwritten import RowShards, sharded_hc_sublayer
from .tp import (
    RowParallelLinear,
    column_parallel_weight,
    replicated_parameter,
    resolve_tp,
    seeded_normal,
    take_shard,
)

ATTENTION_PERIOD = 4
MIXER_CHUNK = 64
MIXER_CONV_KERNEL = 4


@dataclass(frozen=True)
class MixerSizes:
    """Head counts and sizes of the linear token mixer (Qwen3-Next GDN: 16 key and value heads x 128)."""

    heads: int = 16
    key_head_dim: int = 128
    value_head_dim: int = 128

    @property
    def key_dim(self) -> int:
        return self.heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.heads * self.value_head_dim


def bench_config(**overrides: Any) -> HCConfig:
    """Real sizes (S 2560, n 4, r 320, bf16, attention 16 x 256 with 2 KV heads, MLP 5632), 8 layers."""
    return HCConfig.real(**{"n_layers": 8, **overrides})


@dataclass(frozen=True)
class Sequences:
    """How the T rows split into ``n_seqs`` causal sequences of ``length`` tokens, and their RoPE tables."""

    n_seqs: int
    length: int
    rope: torch.Tensor

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...] -> [n_seqs, length, ...]``."""
        return x.unflatten(0, (self.n_seqs, self.length))


class LocalLinear(nn.Module):
    """``x @ W^T`` with this rank's already-sharded weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


FP8_ALIGN = 16  # the CUDA row-wise scaled GEMM (torch._scaled_mm) needs 16-aligned sizes


class ProjectedSublayer(nn.Module):
    """A TP sub-layer cut at its projections: ``in_proj`` (column-parallel) -> ``core`` -> ``out_proj``.

    ``forward`` all-reduces (plain TP); ``partial`` starts from ``in_proj``'s output and returns the local,
    un-reduced ``out_proj`` product, for hand-written sequence parallelism.
    """

    in_proj: nn.Module
    in_width: int  # in_proj's outputs that ``core`` reads (an FP8 in_proj has zero pad columns after them)
    out_proj: RowParallelLinear

    def set_input_projection(self, weight: torch.Tensor, fp8: bool) -> None:
        """``in_proj`` from this rank's weight ``[out, in]``: PTPC-FP8 when ``fp8`` (x quantised per token), else
        plain. An FP8 weight gets zero rows up to a multiple of 16 outputs (the mixer's beta heads make 8208 / tp),
        so that the scaled GEMM runs on every shard; ``forward`` and ``partial`` drop the pad columns."""
        self.in_width = weight.shape[0]
        if fp8:
            self.in_proj = Fp8Linear(F.pad(weight, (0, 0, 0, -self.in_width % FP8_ALIGN)))
        else:
            self.in_proj = LocalLinear(weight)

    def core(self, projected: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """``in_proj`` output ``[T, local in]`` -> ``out_proj`` input ``[T, local out]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """``x [T, S] -> [T, S]``, all-reduced."""
        return self.out_proj(self.core(self._unpadded(self.in_proj(x)), seqs))

    def partial(self, projected: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """This rank's un-reduced share of the output, ``[T, S]``."""
        return F.linear(self.core(self._unpadded(projected), seqs), self.out_proj.weight)

    def _unpadded(self, projected: torch.Tensor) -> torch.Tensor:
        """``in_proj``'s output without FP8 pad columns (no op where there are none)."""
        return projected if projected.shape[-1] == self.in_width else projected[..., : self.in_width]


def _local_kv_heads(n_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(kv heads per rank, ranks sharing a head)``: sharded when tp divides them, else replicated."""
    if n_kv_heads % tp_size == 0:
        return n_kv_heads // tp_size, 1
    return 1, tp_size // n_kv_heads


class BenchAttention(ProjectedSublayer):
    """Causal GQA attention with RoPE, per sequence; KV heads replicated over ranks when tp > n_kv_heads."""

    def __init__(self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.head_dim, self.n_heads = cfg.head_dim, cfg.n_heads // tp_size
        self.n_kv_heads, share = _local_kv_heads(cfg.n_kv_heads, tp_size)
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        std = cfg.hidden**-0.5

        def full(index: int, width: int) -> torch.Tensor:
            return seeded_normal(cfg.seed, f"{name}.qkv.{index}", (width, cfg.hidden), std)

        q = take_shard(full(0, q_width), 0, tp_rank, tp_size)
        k, v = (take_shard(full(i, kv_width), 0, tp_rank // share, tp_size // share) for i in (1, 2))
        self.set_input_projection(torch.cat([q, k, v]).to(cfg.dtype), cfg.fp8)
        self.out_proj = output_projection(cfg, q_width, name=f"{name}.o_proj", tp_rank=tp_rank, tp_size=tp_size)

    def core(self, projected: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """Per-sequence causal attention: ``[T, (H + 2 Hkv) D] -> [T, H D]``."""
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = seqs.batched(projected).split([q_width, kv_width, kv_width], dim=-1)
        q = apply_rope(q.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2), seqs.rope)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2), seqs.rope)
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).flatten(-2).flatten(0, 1)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of a causal depthwise conv over each sequence: ``x [B, L, C]``, ``weight [C, 1, K]``."""
    padded = F.pad(x.transpose(1, 2), (weight.shape[-1] - 1, 0))
    return F.silu(F.conv1d(padded, weight, groups=x.shape[-1])).transpose(1, 2)


def chunked_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """``o_t = sum_{s <= t} (q_t . k_s) v_s`` per sequence and head, in chunks: ``[B, L, H, d] -> [B, L, H, dv]``.

    Within a chunk the causal ``(QK^T) V`` product; across chunks an exclusive prefix sum of the chunk
    states ``K^T V`` (summed in at least fp32).
    """
    length = q.shape[1]
    pad = (-length) % chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, d] -> [B, H, N, C, d]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, chunk)).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    intra = (qb @ kb.transpose(-1, -2)).tril() @ vb
    kv = (kb.transpose(-1, -2) @ vb).to(torch.promote_types(q.dtype, torch.float32))
    states = (kv.cumsum(2) - kv).to(q.dtype)
    out = intra + qb @ states
    return out.permute(0, 2, 3, 1, 4).flatten(1, 2)[:, :length]


class LinearMixer(ProjectedSublayer):
    """GDN-sized linear-time token mixer (a chunked linear-attention surrogate; costs: module docstring).

    ``in_proj`` makes q | k | v | z (output gate) | beta (key gate per head); a causal depthwise conv
    and SiLU over q | k | v; L2-normed q and k; chunked linear attention; a gated RMSNorm per head.
    """

    def __init__(self, cfg: HCConfig, sizes: MixerSizes, *, name: str, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.heads = sizes.heads // tp_size
        self.key_head_dim, self.value_head_dim = sizes.key_head_dim, sizes.value_head_dim
        self.eps = cfg.eps
        kd, vd = sizes.key_dim, sizes.value_dim
        tp = dict(seed=cfg.seed, dtype=cfg.dtype, tp_rank=tp_rank, tp_size=tp_size)
        in_proj = column_parallel_weight(cfg.hidden, [kd, kd, vd, vd, sizes.heads], name=f"{name}.in_proj", **tp)
        self.set_input_projection(in_proj, cfg.fp8)
        conv = column_parallel_weight(MIXER_CONV_KERNEL, [kd, kd, vd], name=f"{name}.conv", **tp)
        self.conv_weight = nn.Parameter(conv.unsqueeze(1), requires_grad=False)
        norm = take_shard(seeded_normal(cfg.seed, f"{name}.norm_weight", (vd,), NORM_WEIGHT_STD), 0, tp_rank, tp_size)
        self.norm_weight = nn.Parameter(norm.to(cfg.dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(vd, cfg.hidden, name=f"{name}.out_proj", **tp)

    def core(self, projected: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """``[T, 2 kd + 2 vd + heads] (local) -> [T, vd] (local)``."""
        h, dk, dv = self.heads, self.key_head_dim, self.value_head_dim
        qkv, z, beta = projected.split([h * (2 * dk + dv), h * dv, h], dim=-1)
        q, k, v = causal_depthwise_conv(seqs.batched(qkv), self.conv_weight).split([h * dk, h * dk, h * dv], dim=-1)
        q = F.normalize(q.unflatten(-1, (h, dk)), dim=-1) * dk**-0.5
        k = F.normalize(k.unflatten(-1, (h, dk)), dim=-1) * torch.sigmoid(seqs.batched(beta)).unsqueeze(-1)
        out = chunked_linear_attention(q, k, v.unflatten(-1, (h, dv)), MIXER_CHUNK).flatten(0, 1).flatten(-2)
        return grouped_rms_norm(out, self.norm_weight, dv, self.eps) * F.silu(z)


class BenchMLP(ProjectedSublayer):
    """Dense SwiGLU MLP: column-parallel gate_up, row-parallel down."""

    def __init__(self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        tp = dict(seed=cfg.seed, dtype=cfg.dtype, tp_rank=tp_rank, tp_size=tp_size)
        self.set_input_projection(
            column_parallel_weight(cfg.hidden, [cfg.intermediate] * 2, name=f"{name}.gate_up", **tp), cfg.fp8
        )
        self.out_proj = RowParallelLinear(cfg.intermediate, cfg.hidden, name=f"{name}.down", **tp)

    def core(self, projected: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """``silu(gate) * up``."""
        gate, up = projected.chunk(2, dim=-1)
        return F.silu(gate) * up


class BenchLayer(nn.Module):
    """[PLE] -> HC around the token mixer (linear mixer, or attention every 4th layer) -> HC around the MLP."""

    def __init__(self, cfg: HCConfig, sizes: MixerSizes, index: int, *, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        name, tp = f"layers.{index}", dict(tp_rank=tp_rank, tp_size=tp_size)
        self.ple = PLELayer(cfg, name=f"{name}.ple") if cfg.ple_layer == index else None
        self.attn_hc = HyperConnection(cfg, name=f"{name}.attn_hc")
        if index % ATTENTION_PERIOD == ATTENTION_PERIOD - 1:
            self.mixer: ProjectedSublayer = BenchAttention(cfg, name=f"{name}.attn", **tp)
        else:
            self.mixer = LinearMixer(cfg, sizes, name=f"{name}.mixer", **tp)
        self.mlp_hc = HyperConnection(cfg, name=f"{name}.mlp_hc")
        self.mlp = BenchMLP(cfg, name=f"{name}.mlp", **tp)

    def blocks(self) -> tuple[tuple[HyperConnection, ProjectedSublayer], ...]:
        """``(HC, sub-layer)`` pairs in order."""
        return (self.attn_hc, self.mixer), (self.mlp_hc, self.mlp)

    def forward(self, h: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """Streams ``[T, n*S] -> [T, n*S]`` (a PLE layer, if any, has already run)."""
        for hc, sublayer in self.blocks():
            x, logits = hc.mix(h)
            h = hc.combine(h, sublayer(x, seqs), logits)
        return h


def check_bench_tp(cfg: HCConfig, sizes: MixerSizes, tp_size: int) -> None:
    """Raise ValueError unless every sharded size divides by ``tp_size`` (KV heads: or ``tp_size`` by them)."""
    for name, value in (("n_heads", cfg.n_heads), ("intermediate", cfg.intermediate), ("mixer heads", sizes.heads)):
        if value % tp_size != 0:
            raise ValueError(f"{name} ({value}) must be divisible by the TP size ({tp_size})")
    if cfg.n_kv_heads % tp_size != 0 and tp_size % cfg.n_kv_heads != 0:
        raise ValueError(f"n_kv_heads ({cfg.n_kv_heads}) and the TP size ({tp_size}) must divide one another")


class BenchDecoder(nn.Module):
    """The benchmark model: ``forward(input_ids [T], n_seqs) -> logits [n_seqs, vocab]`` (``[T, vocab]``
    with ``all_logits``).

    ``handwritten_sp=False``: plain TP (all-reduce after each sub-layer; what hcpasses rewrites).
    ``handwritten_sp=True``: the same weights and function with hand-written sequence parallelism
    (streams row-sharded from the PLE, or from layer 0, to the end; ``hcpasses.testing.models.sp_handwritten``).
    """

    def __init__(
        self,
        cfg: HCConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        *,
        handwritten_sp: bool = False,
        sizes: MixerSizes | None = None,
        all_logits: bool = False,
    ) -> None:
        super().__init__()
        self.cfg, self.sizes = cfg, sizes or MixerSizes()
        self.handwritten_sp, self.all_logits = handwritten_sp, all_logits
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        check_bench_tp(cfg, self.sizes, self.tp_size)
        self.shards = RowShards(self.tp_rank, self.tp_size)
        self.embed = replicated_parameter(cfg.seed, "embed", (cfg.vocab_size, cfg.hidden), 1.0, cfg.dtype)
        self.layers = nn.ModuleList(
            BenchLayer(cfg, self.sizes, i, tp_rank=self.tp_rank, tp_size=self.tp_size) for i in range(cfg.n_layers)
        )
        self.final_mixer = FinalMixer(cfg, name="final_mixer")
        self.final_norm_weight = replicated_parameter(
            cfg.seed, "final_norm_weight", (cfg.hidden,), NORM_WEIGHT_STD, cfg.dtype
        )
        self.lm_head = replicated_parameter(
            cfg.seed, "lm_head", (cfg.vocab_size, cfg.hidden), cfg.hidden**-0.5, cfg.dtype
        )

    def forward(self, input_ids: torch.Tensor, n_seqs: int = 1) -> torch.Tensor:
        """Logits of the last token of each of the ``n_seqs`` equal-length sequences in ``input_ids``."""
        cfg, n_tokens = self.cfg, input_ids.shape[0]
        h = F.embedding(input_ids, self.embed).repeat(1, cfg.n_streams)
        length = n_tokens // n_seqs
        seqs = Sequences(n_seqs, length, rope_tables(length, cfg.head_dim, h.device, h.dtype))
        run = self._sharded if self.handwritten_sp else self._plain
        x = run(h, input_ids, seqs)
        if not self.all_logits:
            x = seqs.batched(x)[:, -1]
        return F.linear(grouped_rms_norm(x, self.final_norm_weight, cfg.hidden, cfg.eps), self.lm_head)

    def _plain(self, h: torch.Tensor, input_ids: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """Plain TP: every rank runs every HC on all T rows; returns the final mixer output ``[T, S]``."""
        for layer in self.layers:
            if layer.ple is not None:
                h = layer.ple(h, input_ids)
            h = layer(h, seqs)
        return self.final_mixer(h)

    def _sharded(self, h: torch.Tensor, input_ids: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """Hand-written SP: unsharded through the PLE, then HCs on local rows; returns the gathered ``[T, S]``."""
        n_tokens, start = input_ids.shape[0], self.cfg.ple_layer or 0
        for layer in self.layers[:start]:
            h = layer(h, seqs)
        first = self.layers[start]
        if first.ple is not None:
            h = first.ple(h, input_ids)
        h = self.shards.shard(h)
        for layer in self.layers[start:]:
            for hc, sublayer in layer.blocks():
                h = sharded_hc_sublayer(hc, h, sublayer.in_proj, _partial_of(sublayer, seqs), self.shards, n_tokens)
        return self.shards.gather(self.final_mixer(h), n_tokens)


def _partial_of(sublayer: ProjectedSublayer, seqs: Sequences) -> Callable[[torch.Tensor], torch.Tensor]:
    """``projected -> sublayer.partial(projected, seqs)``."""
    return lambda projected: sublayer.partial(projected, seqs)

"""The reference HC decoder: plain eager PyTorch, tensor-parallel through ``torch.distributed``.

Activations are ``[T, hidden]``: the T tokens are one causal sequence (batch 1, flattened, vLLM style).
Attention and MLP are Megatron-sharded (column-parallel in, row-parallel out plus an all-reduce); the
embedding, HC blocks, PLE layer, final norm and lm_head are replicated (DESIGN §3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .fp8 import Fp8ColumnParallelLinear
from .hc import NORM_WEIGHT_STD, FinalMixer, HyperConnection, grouped_rms_norm
from .tp import ColumnParallelLinear, RowParallelLinear, replicated_parameter, resolve_tp

ROPE_BASE = 10000.0
PLE_KERNEL = 4
PLE_DILATION = 3
PLE_LEFT_PAD = (PLE_KERNEL - 1) * PLE_DILATION


def rope_tables(n_tokens: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``cos|sin`` stacked ``[2, T, head_dim]`` for positions ``0..T-1`` (rotate-half layout)."""
    pos = torch.arange(n_tokens, device=device, dtype=torch.float32)
    inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(pos, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([angles.cos(), angles.sin()]).to(dtype)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [H, T, D]`` by the tables from :func:`rope_tables`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * rope[0] + torch.cat([-x2, x1], dim=-1) * rope[1]


def _input_projection(cfg: HCConfig, out_features: list[int], *, name: str, tp_rank: int, tp_size: int) -> nn.Module:
    """The sub-layer input projection: FP8 (x quantised per token) when ``cfg.fp8``, else plain."""
    cls = Fp8ColumnParallelLinear if cfg.fp8 else ColumnParallelLinear
    return cls(cfg.hidden, out_features, seed=cfg.seed, name=name, dtype=cfg.dtype, tp_rank=tp_rank, tp_size=tp_size)


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE; q, k and v heads sharded across ranks."""

    def __init__(self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads // tp_size
        self.n_kv_heads = cfg.n_kv_heads // tp_size
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv = _input_projection(
            cfg, [q_width, kv_width, kv_width], name=f"{name}.qkv", tp_rank=tp_rank, tp_size=tp_size
        )
        self.o_proj = RowParallelLinear(
            q_width,
            cfg.hidden,
            seed=cfg.seed,
            name=f"{name}.o_proj",
            dtype=cfg.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """``x [T, S] -> [T, S]`` (all-reduced)."""
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)
        q = apply_rope(q.unflatten(-1, (self.n_heads, self.head_dim)).transpose(0, 1), rope)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1), rope)
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(0, 1).flatten(-2))


class MLP(nn.Module):
    """SwiGLU MLP: column-parallel gate_up, row-parallel down."""

    def __init__(self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        parts = [cfg.intermediate, cfg.intermediate]
        self.gate_up = _input_projection(cfg, parts, name=f"{name}.gate_up", tp_rank=tp_rank, tp_size=tp_size)
        self.down = RowParallelLinear(
            cfg.intermediate,
            cfg.hidden,
            seed=cfg.seed,
            name=f"{name}.down",
            dtype=cfg.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, S] -> [T, S]`` (all-reduced)."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class PLELayer(nn.Module):
    """Per-layer embedding plus a causal depthwise conv over tokens (kernel 4, dilation 3: 9 tokens back).

    ``z = mean_s(h_s) + E[ids]``; ``c = conv(z)``; ``h + c`` added to every stream. Replicated, not row-local.
    """

    def __init__(self, cfg: HCConfig, *, name: str) -> None:
        super().__init__()
        self.n, self.hidden = cfg.n_streams, cfg.hidden
        self.embedding = replicated_parameter(
            cfg.seed, f"{name}.embedding", (cfg.vocab_size, cfg.hidden), 1.0, cfg.dtype
        )
        self.conv_weight = replicated_parameter(
            cfg.seed, f"{name}.conv_weight", (cfg.hidden, 1, PLE_KERNEL), PLE_KERNEL**-0.5, cfg.dtype
        )

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``h [T, n*S] -> [T, n*S]``; row t depends on rows t, t-3, t-6, t-9."""
        z = h.unflatten(-1, (self.n, self.hidden)).mean(-2) + F.embedding(input_ids, self.embedding)
        padded = F.pad(z.t().unsqueeze(0), (PLE_LEFT_PAD, 0))
        conv = F.conv1d(padded, self.conv_weight, dilation=PLE_DILATION, groups=self.hidden)
        return h + conv.squeeze(0).t().repeat(1, self.n)


class HCDecoderLayer(nn.Module):
    """[PLE] -> attention HC (mix, attention, combine) -> MLP HC (mix, MLP, combine)."""

    def __init__(self, cfg: HCConfig, index: int, *, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        name = f"layers.{index}"
        self.ple = PLELayer(cfg, name=f"{name}.ple") if cfg.ple_layer == index else None
        self.attn_hc = HyperConnection(cfg, name=f"{name}.attn_hc")
        self.attn = Attention(cfg, name=f"{name}.attn", tp_rank=tp_rank, tp_size=tp_size)
        self.mlp_hc = HyperConnection(cfg, name=f"{name}.mlp_hc")
        self.mlp = MLP(cfg, name=f"{name}.mlp", tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Streams ``[T, n*S] -> [T, n*S]``."""
        if self.ple is not None:
            h = self.ple(h, input_ids)
        x, logits = self.attn_hc.mix(h)
        h = self.attn_hc.combine(h, self.attn(x, rope), logits)
        x, logits = self.mlp_hc.mix(h)
        return self.mlp_hc.combine(h, self.mlp(x), logits)


class HCDecoder(nn.Module):
    """The whole model: ``input_ids [T] -> logits [T, vocab]`` (and optionally the HC state).

    TP rank and size come from the default process group unless given. Weights depend only on ``cfg``
    (and the rank's slice), so every TP size computes the same function. Another HC family reuses the
    rest of the model by overriding ``layer_class`` and ``make_final_mixer``.
    """

    layer_class: type[nn.Module] = HCDecoderLayer

    def __init__(self, cfg: HCConfig, tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        cfg.check_tp(self.tp_size)
        self.embed = replicated_parameter(cfg.seed, "embed", (cfg.vocab_size, cfg.hidden), 1.0, cfg.dtype)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, tp_rank=self.tp_rank, tp_size=self.tp_size) for i in range(cfg.n_layers)
        )
        self.final_mixer = self.make_final_mixer(cfg)
        self.final_norm_weight = replicated_parameter(
            cfg.seed, "final_norm_weight", (cfg.hidden,), NORM_WEIGHT_STD, cfg.dtype
        )
        self.lm_head = replicated_parameter(
            cfg.seed, "lm_head", (cfg.vocab_size, cfg.hidden), cfg.hidden**-0.5, cfg.dtype
        )

    def make_final_mixer(self, cfg: HCConfig) -> nn.Module:
        """The collapse that ends the model: ``h [T, n*S] -> x [T, S]``."""
        return FinalMixer(cfg, name="final_mixer")

    def forward(
        self, input_ids: torch.Tensor, return_hc_state: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, vocab]``, or ``(logits, state [T, n, S])`` with the streams after the last combine."""
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed).repeat(1, cfg.n_streams)
        rope = rope_tables(input_ids.shape[0], cfg.head_dim, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, input_ids, rope)
        x = grouped_rms_norm(self.final_mixer(h), self.final_norm_weight, cfg.hidden, cfg.eps)
        logits = F.linear(x, self.lm_head)
        if return_hc_state:
            return logits, h.unflatten(-1, (cfg.n_streams, cfg.hidden))
        return logits

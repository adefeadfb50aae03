"""The reference HC decoder: plain eager PyTorch, tensor-parallel through ``torch.distributed``.

Activations are ``[T, hidden]``: the T tokens are one causal sequence (batch 1, flattened, vLLM style).
Attention and MLP are Megatron-sharded (column-parallel in, row-parallel out plus an all-reduce); the
embedding, HC blocks, PLE layer, final norm and lm_head are replicated (DESIGN §3).

Incremental decoding: ``HCDecoder.step(input_ids, cache)`` runs new tokens after the ``L`` already in a
:data:`DecoderCache` (explicit tensors in and out, so a step can be compiled) and returns the grown cache;
:func:`truncate_cache` rolls rejected tokens back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import HCConfig
from .fp8 import Fp8ColumnParallelLinear
from .hc import NORM_WEIGHT_STD, FinalMixer, HyperConnection, grouped_rms_norm
from .tp import ColumnParallelLinear, RowParallelLinear, replicated_parameter

ROPE_BASE = 10000.0
PLE_KERNEL = 4
PLE_DILATION = 3
PLE_LEFT_PAD = (PLE_KERNEL - 1) * PLE_DILATION


def rope_tables(n_tokens: int, head_dim: int, device: torch.device, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """``cos|sin`` stacked ``[2, T, head_dim]`` for positions ``start..start+T-1`` (rotate-half layout)."""
    pos = torch.arange(start, start + n_tokens, device=device, dtype=torch.float32)
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


def output_projection(
    cfg: HCConfig, in_features: int, *, name: str, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None = None
) -> RowParallelLinear:
    """The sub-layer output projection ``[in_features] -> [S]``: row-parallel, all-reduced over ``group`` (default:
    the default process group)."""
    return RowParallelLinear(
        in_features,
        cfg.hidden,
        seed=cfg.seed,
        name=name,
        dtype=cfg.dtype,
        tp_rank=tp_rank,
        tp_size=tp_size,
        group=group,
    )


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE; q, k and v heads sharded across ranks."""

    def __init__(
        self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads // tp_size
        self.n_kv_heads = cfg.n_kv_heads // tp_size
        self.head_dim = cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv = _input_projection(
            cfg, [q_width, kv_width, kv_width], name=f"{name}.qkv", tp_rank=tp_rank, tp_size=tp_size
        )
        self.o_proj = output_projection(
            cfg, q_width, name=f"{name}.o_proj", tp_rank=tp_rank, tp_size=tp_size, group=group
        )

    def heads(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rotated ``q [H, T, D]``, rotated ``k [H_kv, T, D]`` and ``v [H_kv, T, D]`` of ``x [T, S]``."""
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)
        q = apply_rope(q.unflatten(-1, (self.n_heads, self.head_dim)).transpose(0, 1), rope)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1), rope)
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention of ``q [H, T, D]`` over ``k, v [H_kv, L, D]`` -> ``[T, S]`` (all-reduced).

        ``mask [T, L]`` (True: attend) or None for plain causal attention with ``L == T``.
        """
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(0, 1).flatten(-2))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """``x [T, S] -> [T, S]`` (all-reduced)."""
        return self.attend(*self.heads(x, rope), None)

    def step(
        self, x: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New tokens ``x [T, S]`` at positions ``L..L+T-1`` after a cache of L keys and values.

        Caches are ``[L, H_kv * D]``, token-major and 2-D: a truncated cache is a contiguous prefix whose strides
        do not depend on L, and no dim has size 1 (one KV head per rank), whose stride a compiled step would
        guard on. Returns ``(y [T, S], k, v)`` with the caches grown to ``L+T`` rows; ``rope`` must be for
        positions ``L..L+T-1``.
        """
        q, k, v = self.heads(x, rope)
        k = torch.cat([k_cache, k.transpose(0, 1).flatten(1)])
        v = torch.cat([v_cache, v.transpose(0, 1).flatten(1)])
        past, total = k_cache.shape[0], k.shape[0]
        # SDPA's is_causal aligns the mask top-left; new tokens sit at the bottom-right of [T, L+T].
        query_pos = torch.arange(past, total, device=x.device).unsqueeze(-1)
        mask = torch.arange(total, device=x.device) <= query_pos
        return self.attend(q, self.split_heads(k), self.split_heads(v), mask), k, v

    def split_heads(self, cache: torch.Tensor) -> torch.Tensor:
        """``[L, H_kv * D] -> [H_kv, L, D]``."""
        return cache.unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(0, 1)


class MLP(nn.Module):
    """SwiGLU MLP: column-parallel gate_up, row-parallel down."""

    def __init__(
        self, cfg: HCConfig, *, name: str, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        parts = [cfg.intermediate, cfg.intermediate]
        self.gate_up = _input_projection(cfg, parts, name=f"{name}.gate_up", tp_rank=tp_rank, tp_size=tp_size)
        self.down = output_projection(
            cfg, cfg.intermediate, name=f"{name}.down", tp_rank=tp_rank, tp_size=tp_size, group=group
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

    def conv_input(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``z = mean_s(h_s) + E[ids]``, ``[T, S]``: the rows the conv runs over."""
        return h.unflatten(-1, (self.n, self.hidden)).mean(-2) + F.embedding(input_ids, self.embedding)

    def add_conv(self, h: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        """``h + conv(padded)`` on every stream; ``padded [1, S, PLE_LEFT_PAD + T]`` holds the conv input."""
        conv = F.conv1d(padded, self.conv_weight, dilation=PLE_DILATION, groups=self.hidden)
        return h + conv.squeeze(0).t().repeat(1, self.n)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``h [T, n*S] -> [T, n*S]``; row t depends on rows t, t-3, t-6, t-9."""
        padded = F.pad(self.conv_input(h, input_ids).t().unsqueeze(0), (PLE_LEFT_PAD, 0))
        return self.add_conv(h, padded)

    def step(self, h: torch.Tensor, input_ids: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows after a conv window (the conv input rows ``[W >= PLE_LEFT_PAD, S]`` that end where h starts).

        Returns ``(h', window')`` with ``window' = [last PLE_LEFT_PAD rows of window; z]``: ``PLE_LEFT_PAD + T``
        rows, so that :func:`truncate_cache` can roll back up to T of them.
        """
        window = torch.cat([window[window.shape[0] - PLE_LEFT_PAD :], self.conv_input(h, input_ids)])
        return self.add_conv(h, window.t().unsqueeze(0)), window


class LayerCache(NamedTuple):
    """One decoder layer's decode state after L tokens (positions ``0..L-1``).

    ``k``, ``v``: this rank's rotated keys and values ``[L, n_kv_heads/tp * head_dim]`` (token-major). ``conv``: the PLE
    layer's last conv input rows ``[W, S]`` (``W >= PLE_LEFT_PAD``, ending at position L; rows before
    position 0 are zero, the conv's own padding), or None in a layer without PLE.
    """

    k: torch.Tensor
    v: torch.Tensor
    conv: torch.Tensor | None


DecoderCache = tuple[LayerCache, ...]  # one LayerCache per layer


def cache_length(cache: DecoderCache) -> int:
    """L: how many tokens the cache holds, which is also the position of the next token."""
    return cache[0].k.shape[0]


def truncate_cache(cache: DecoderCache, length: int) -> DecoderCache:
    """The cache after only the first ``length`` tokens: rolls back rejected tokens.

    A PLE conv window can roll back at most the tokens of the step that made it (its rows beyond the
    last ``PLE_LEFT_PAD``); the result keeps exactly ``PLE_LEFT_PAD`` rows.
    """
    drop = cache_length(cache) - length
    if drop < 0 or length < 0:
        raise ValueError(f"cannot truncate a cache of {cache_length(cache)} tokens to {length}")
    return tuple(LayerCache(layer.k[:length], layer.v[:length], _roll_back_window(layer.conv, drop)) for layer in cache)


def _roll_back_window(window: torch.Tensor | None, drop: int) -> torch.Tensor | None:
    """The ``PLE_LEFT_PAD`` rows of a conv window that end ``drop`` rows before its end."""
    if window is None:
        return None
    end = window.shape[0] - drop
    if end < PLE_LEFT_PAD:
        raise ValueError(f"a PLE conv window of {window.shape[0]} rows cannot roll back {drop} tokens")
    return window[end - PLE_LEFT_PAD : end]


class HCDecoderLayer(nn.Module):
    """[PLE] -> attention HC (mix, attention, combine) -> MLP HC (mix, MLP, combine).

    ``hc_class`` is the HC block: ``mix(h) -> (x, *weights)`` and ``combine(h, y, *weights)``; another HC
    family (mHC) reuses the layer by overriding it.
    """

    hc_class: type[nn.Module] = HyperConnection

    def __init__(
        self, cfg: HCConfig, index: int, *, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        name, tp = f"layers.{index}", dict(tp_rank=tp_rank, tp_size=tp_size, group=group)
        self.ple = PLELayer(cfg, name=f"{name}.ple") if cfg.ple_layer == index else None
        self.attn_hc = self.hc_class(cfg, name=f"{name}.attn_hc")
        self.attn = Attention(cfg, name=f"{name}.attn", **tp)
        self.mlp_hc = self.hc_class(cfg, name=f"{name}.mlp_hc")
        self.mlp = MLP(cfg, name=f"{name}.mlp", **tp)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Streams ``[T, n*S] -> [T, n*S]``."""
        if self.ple is not None:
            h = self.ple(h, input_ids)
        x, *weights = self.attn_hc.mix(h)
        h = self.attn_hc.combine(h, self.attn(x, rope), *weights)
        x, *weights = self.mlp_hc.mix(h)
        return self.mlp_hc.combine(h, self.mlp(x), *weights)

    def step(
        self, h: torch.Tensor, input_ids: torch.Tensor, rope: torch.Tensor, cache: LayerCache
    ) -> tuple[torch.Tensor, LayerCache]:
        """:meth:`forward` on new rows after the tokens in ``cache``; returns the streams and the grown cache."""
        window = cache.conv
        if self.ple is not None:
            h, window = self.ple.step(h, input_ids, cache.conv)
        x, *weights = self.attn_hc.mix(h)
        y, k, v = self.attn.step(x, rope, cache.k, cache.v)
        h = self.attn_hc.combine(h, y, *weights)
        x, *weights = self.mlp_hc.mix(h)
        return self.mlp_hc.combine(h, self.mlp(x), *weights), LayerCache(k, v, window)

    def empty_cache(self, device: torch.device, dtype: torch.dtype) -> LayerCache:
        """The cache before the first token: no keys, and a zero PLE window (the conv's left padding)."""
        kv = torch.zeros(0, self.attn.n_kv_heads * self.attn.head_dim, device=device, dtype=dtype)
        window = None
        if self.ple is not None:
            window = torch.zeros(PLE_LEFT_PAD, self.ple.hidden, device=device, dtype=dtype)
        return LayerCache(kv, kv.clone(), window)


class HCDecoder(nn.Module):
    """The whole model: ``input_ids [T] -> logits [T, vocab]`` (and optionally the HC state).

    TP rank and size come from ``group`` (the TP group; default: the default process group) unless given, and the
    sub-layers all-reduce over it (a DP x TP job passes its TP group). Weights depend only on ``cfg``
    (and the rank's slice), so every TP size computes the same function. Another HC family reuses the
    rest of the model by overriding ``layer_class`` and ``make_final_mixer``.
    """

    layer_class: type[nn.Module] = HCDecoderLayer

    def __init__(
        self,
        cfg: HCConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_rank, self.tp_size = cfg.tp_of(tp_rank, tp_size, group)
        self.embed = replicated_parameter(cfg.seed, "embed", (cfg.vocab_size, cfg.hidden), 1.0, cfg.dtype)
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size, group=group)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, **tp) for i in range(cfg.n_layers))
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
        logits = self.logits(h)
        if return_hc_state:
            return logits, h.unflatten(-1, (cfg.n_streams, cfg.hidden))
        return logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's end: final mixer, final norm and lm_head, ``h [T, n*S] -> [T, vocab]``."""
        x = grouped_rms_norm(self.final_mixer(h), self.final_norm_weight, self.cfg.hidden, self.cfg.eps)
        return F.linear(x, self.lm_head)

    def step(self, input_ids: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, torch.Tensor, DecoderCache]:
        """New tokens ``input_ids [T]`` after the L tokens in ``cache`` (positions ``L..L+T-1``).

        Returns ``(logits [T, vocab], state [T, n, S], cache of L+T tokens)``: what
        ``forward(all ids, return_hc_state=True)`` gives for the new rows. Layers must have ``step``.
        """
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed).repeat(1, cfg.n_streams)
        rope = rope_tables(input_ids.shape[0], cfg.head_dim, h.device, h.dtype, start=cache_length(cache))
        grown = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h, layer_cache = layer.step(h, input_ids, rope, layer_cache)
            grown.append(layer_cache)
        return self.logits(h), h.unflatten(-1, (cfg.n_streams, cfg.hidden)), tuple(grown)

    def empty_cache(self) -> DecoderCache:
        """The cache before the first token, on the model's device."""
        return tuple(layer.empty_cache(self.embed.device, self.embed.dtype) for layer in self.layers)

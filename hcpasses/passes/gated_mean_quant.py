"""Fusion pass: HC stream collapse + per-token FP8 quant -> one ``hcpasses`` op.

Before (Qwen3.8-Flash-Next as transformers writes it; bf16 shown)::

    s  = sigmoid(u)                              u, xn: [T, n*S]
    g  = reshape(s, [T, n, S]) * reshape(xn, [T, n, S])
    x  = mean(g, [-2])                           [T, S]   (the sub-layer input)
    xf = convert(x, f32); a = amax(abs(xf), [-1], keepdim)
    scale = clamp_min(a / 448, 1/(448*512))      [T, 1]
    q  = convert(clamp(xf / scale, -448, 448), f8e4m3)

After::

    x, q, scale = hcpasses.gated_mean_quant(xn, u, n)     # one pass over xn and u
    (x kept only when something other than the quant uses it)

With more than one token dim (``[batch, seq, n*S]``, transformers), the op reads the streams and the
gate reshaped to ``[batch*seq, width]`` and its outputs are reshaped back.

The same for ATOM's fp32 mean (``(sum_s sigmoid(u_s) * xn_s) / n``, one rounding) and for the
DeepSeek-V4 mHC collapse (``sum_s w_s * h_s``, scalar fp32 gates) -> ``hcpasses.weighted_sum_quant``.

Applies when: the collapse is exactly one of the patterns in ``hcpasses.patterns.gated_mean`` in
fp32, bf16 or fp16 (both inputs of that dtype; mHC gates fp32) whose values the fused op gives (a bf16
``sum / n`` is the mean only when n is a power of two), on ``[..., n*S]`` (or stacked
``[..., n, S]``) streams with static n and S, and the quant that follows is the DESIGN §5 convention
to the constant. Bails out (leaves the collapse alone and says so in the report) when no quant
follows, when the quant differs in any constant or dtype, or when the collapse reduces over another dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_graph_pattern

from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.patterns.collapse import (
    FUSED_GATED_MEAN,
    FUSED_WEIGHTED_SUM,
    Collapse,
    CollapseFinder,
    FoundCollapse,
    fusion_check,
    stream_split,
    traced_patterns,
)

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig


class GatedMeanQuantFusion(GraphPass):
    """Replaces each HC collapse followed by a per-token FP8 quant with one fused op."""

    name = "gated_mean_quant"

    def __init__(self) -> None:
        self._finder = CollapseFinder()
        # Patterns are traced on first use, not at import: tracing ~30 small functions takes a second.
        self._fuser: PatternMatcherPass | None = None

    def _build_fuser(self) -> PatternMatcherPass:
        fuser = PatternMatcherPass(pass_name="hcpasses_gated_mean_quant")
        for kind in ("quant", "quant_keep_x"):
            for collapse, dtype, pattern in traced_patterns(kind):
                check = fusion_check(collapse, dtype)
                register_graph_pattern(pattern, extra_check=check, pass_dict=fuser)(
                    _fuse_handler(collapse, dtype, kind)
                )
        return fuser

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if self._fuser is None:
            self._fuser = self._build_fuser()
        found = sum(1 for c in self._finder.find(graph) if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM))
        fused = self._fuser.apply(graph)
        notes: tuple[str, ...] = (f"HC stream collapses found: {found}", f"fused with a per-token FP8 quant: {fused}")
        if lookalikes := self._finder.lookalike_note():
            notes += (lookalikes,)
        if not found:
            return PassResult(0, "no HC stream collapse (gated mean / mHC collapse) in this graph", notes)
        left = [c for c in self._finder.find(graph) if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]
        reason = f"not fused: {'; '.join(map(why_not_fused, left))}" if left else None
        return PassResult(applied=fused, reason=reason, notes=notes)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SEARCH_LIMIT = 200  # nodes visited downstream of a collapse when looking for an FP8 cast


def _is_fp8_cast(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in FP8_DTYPES


def why_not_fused(collapse: FoundCollapse) -> str:
    """The truth about a collapse that was not fused: its form would change numerics, no FP8 cast is
    downstream of it, or the ops that stand between it and the nearest one (a norm, a reshape, another quant
    convention: the fused op quantises the collapse output itself, with the DESIGN §5 convention, so anything
    else is left alone)."""
    root = collapse.root
    if collapse.refusal is not None:
        return f"{root.name}: {collapse.refusal}"
    parents: dict[fx.Node, fx.Node | None] = {root: None}
    frontier = [root]
    while frontier and len(parents) < _SEARCH_LIMIT:
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in parents:
                    continue
                parents[user] = node
                if _is_fp8_cast(user):
                    return (
                        f"{root.name}: an FP8 cast follows ({user.name}, through {_path_ops(user, parents)}) "
                        "but not as the per-token quant of the collapse output itself (DESIGN §5 convention)"
                    )
                nxt.append(user)
        frontier = nxt
    return f"{root.name}: no FP8 quant after it"


def _path_ops(cast: fx.Node, parents: dict[fx.Node, fx.Node | None]) -> str:
    ops = []
    node = parents[cast]
    while node is not None and parents[node] is not None:
        ops.append(getattr(node.target, "__name__", str(node.target)).split(".")[0])
        node = parents[node]
    return " -> ".join(reversed(ops)) or "nothing"


def _fuse_handler(collapse: Collapse, dtype: torch.dtype, kind: str) -> Callable[..., None]:
    def handler(match: Match, *args: Any, **kwargs: Any) -> None:
        split = stream_split(match, collapse, dtype)
        assert split is not None  # extra_check passed on this very match
        n, hidden = split

        def replacement(gate: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tokens = gate.shape[:-1]  # [T] or [batch, seq]: the fused op wants them flat, streams [tokens, n*S]
            flat = None
            if len(tokens) > 1 or streams.dim() > 2:  # several token dims, or stacked streams [..., n, S]
                flat = (streams.reshape(-1, n * hidden), gate.reshape(-1, gate.shape[-1]))
            x, q, scale = collapse.fused_op(*(flat or (streams, gate)), n)
            if flat:
                x, q, scale = (t.reshape(*tokens, t.shape[-1]) for t in (x, q, scale))
            return (x, q, scale) if kind == "quant_keep_x" else (q, scale)

        match.replace_by_example(replacement, [kwargs["gate"], kwargs["streams"]])

    return handler

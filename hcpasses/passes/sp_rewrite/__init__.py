"""SP rewrite pass: the HC residual streams are sharded by tokens across the TP ranks.

Before (every rank computes the HC work of all T tokens)::

    h[T,nS] -> mix -> x[T,S] -> sub-layer shard -> p[T,S] -> all_reduce -> y[T,S] -> combine(h, y) -> h'[T,nS]

After (rank r works on its R = ceil(T/tp) token rows; rows padded with zeros up to R)::

    hs = h[rR : rR+R][R,nS] -> mix -> x[R,S] -> all_gather, trim -> x[T,S] -> sub-layer shard
       -> p[T,S] -> pad to R*tp rows -> reduce_scatter -> y[R,S] -> combine(hs, y) -> h'[R,nS] -> next mix ...

(``h[rR : rR+R]``: ``pad(h, R*tp - T zero rows)[rR : rR+R]``, no pad where a static T splits evenly. Inductor
fuses both views into their readers, so a pointwise h such as the embedding is computed for this rank's rows
alone. Where a size after the token dims is symbolic, the ``shard_rows`` op: a copy, zero rows past T, which
Inductor cannot see into.)

All-reduce = reduce-scatter + all-gather, so the bytes on the wire are unchanged while each rank does
1/tp of the HC work. When the fusion pass ran first, the fused op is part of the region and the
gather moves FP8 codes (as uint8) and per-token scales instead of x.

How the region is found:

- HC blocks come from the collapse patterns (``hcpasses.patterns.collapse``): each collapse marks a
  mix; its stream value is the input of the grouped norm (gated mean) or the collapsed streams (mHC).
- The region is every node reachable from the first sharded stream value and from the outputs of the
  all-reduces that feed later HC blocks, without passing through a collapse (the sub-layer starts
  there) or an all-reduce, and that leads to a later collapse. Values the region computes but others
  use (the sub-layer input, the final mixer output, a returned HC state) are gathered.
- Kept rows (``kept``): a value read only by slices that keep a few of its token rows (``logits_to_keep=1``:
  ``hidden[:, -1:]`` before the LM head; a select, ``hidden[:, -1]``) is gathered in those rows alone, ``tp * K``
  rows instead of N; nodes after the HC blocks that lead only to such slices (a final norm) join the region as its
  tail, and one the checks refuse goes back outside with what feeds it (the gather moves back before it; no block
  is cut)::

      h[R] -> final mixer -> norm -> all_gather(row r % R of each kept row r) -> the holders' rows [K] -> lm_head

  Only where the tp * K rows are fewer than N (with a symbolic N: than ``sp_min_tokens``, which must also leave the
  slice its rows; the graph asserts it). One kept row of a static N (``logits_to_keep=1`` at prefill) is sent and
  picked by two slices (views: the GEMM reads the gathered row in place); several, or a symbolic N, by an index.
  The report names the slices that read every row all the same, and why,
  and so a tensor index that picks a few rows (``hidden[arange(B), lengths - 1]``): its rows are a run-time value.
- Prologues (``region._prologue``): row-local steps between a region value and the sub-layer's GEMMs (an RMS norm
  and its cast to the GEMM's dtype, after an mHC collapse summed in fp32) run on the shards where that leaves fewer
  bytes per token to gather, and the gather moves their narrower result (a norm on the shards, as in Megatron's
  sequence parallelism)::

      x[R] fp32 -> norm -> cast -> all_gather -> x'[T] bf16 -> GEMMs      (was: all_gather(x) fp32 -> norm -> cast)

  Pointwise steps, reductions and views alone, reading region values and values without tokens (the norm's
  weight); never a GEMM (its weight may be a TP shard). A step the checks refuse stays outside with what it feeds.
- Tokens are the leading dims of the values a region shards, reduce-scatters and gathers: ``[T, ...]``
  (vLLM style) or ``[batch, seq, ...]`` (transformers); token i is row i of the value flattened over
  them. N = batch*seq is what is sharded; a shard keeps the rank, its token dims become ``[1, ..., 1,
  R]``, so the model's dim-addressed ops still apply. Inside a region a value may hold its tokens
  elsewhere (``tokens.Layout``): behind a stream axis (``torch.stack`` of per-stream values: ``[n*T, S]``,
  ``[n, T, S]``) or merged with a hidden dim (an einsum's per-token bmm: ``[T*S, 1, n]``). Each node's
  layout follows from its operands' by what the op does, never from its shape alone; a reshape's size
  argument is rewritten to the shard's (``[n, R, S]``, ``[R*S, 1, n]``).
- Every region node must be row-local (pointwise, reductions and dim ops away from the token dims,
  views, permutes that keep the token dims together and in order, a ``cat`` of per-stream values,
  ``mm`` with a weight, ``bmm`` batched over tokens, the fused collapse ops, a causal token window), and every
  operand from outside the region must carry no tokens (a weight or constant broadcast over rows, the right-hand
  side of a GEMM, a conv's weight) or be read row for row. An ``mm`` is row-local whatever its weight (an HC
  weight, replicated by construction, or a TP shard of a projection reading the streams): row i of ``x @ W``
  reads row i of x only.
- A value from outside that a pointwise region node reads row for row (same token dims, not broadcast) is
  sharded where it is read: an MTP drafter's projected next-token embedding (``streams = norm(state) + e``: a
  target's HC state flows into its drafter still sharded when both are in one graph), a PLE's features of the
  token ids. Sound whatever the value is: what the region passes on is replicated (DESIGN §3), the same
  whichever rank's copy computed which rows.
- Features of the token ids that only the region reads (descendants of integer inputs, after the region start:
  a PLE's n-gram embedding lookup, its key and value projections and their norm) are computed on this rank's
  rows instead of all T (``region._hoistable``): the values they read from outside are sharded where read (the
  hashed id window, a slice of replicated ids). A hoisted node the checks refuse goes back to all rows.
- A causal token window, a front zero pad of the one token dim read by a stride-1 ``convolution`` (no padding
  of its own) that reaches exactly that far back (a PLE's or a short conv's ``conv1d(pad(x, (k-1)*d, 0))``),
  runs on the shard: the pad becomes the rows of the ranks before (one all-gather of every rank's last
  min(R, reach) rows; zeros before the sequence start)::

      x[R rows] -> all_gather(last rows) -> rows before rank r -> cat(before, x)[reach + R] -> conv -> [R rows]

  With a symbolic T only where every rank holds >= reach rows for T >= ``sp_min_tokens`` (the graph asserts it).
- Regions are cut block by block: a node that fails a check (e.g. a conv with its own padding, or a block
  whose norm the analysis cannot read) ends the region before it, the values it reads are gathered
  there, and the next HC block after it starts a new region. So one unfamiliar piece costs only the
  blocks it touches; the report lists every cut with its node and reason::

      h -> [HC blocks, sharded] -> all_gather(h) -> unknown op (full rows) -> shard -> [HC blocks, sharded]

Groups: a region shards over the group of the all-reduces it replaces, whichever group that is (the default one,
or a TP group a DP x TP job made with ``dist.new_group``): rank r and tp above are this process's rank in that
group and its size, read off the group the graph names (``collectives.resolve_group``), and the collectives it
emits name the same group. A region's all-reduces sum over one group: where the group changes, the region is
cut (the first node reading the other group's sum ends it) and the next HC block starts a region over the
other group. An all-reduce over a group of size 1 sums nothing: no region replaces it, and the report says so.

Applies when: torch.distributed is initialised, the all-reduces are sums over groups of this process, T >=
``sp_min_tokens`` (static T; with symbolic T the graph is correct for every T and the backend dispatches small T
to an unsharded variant), and some HC block has an all-reduce over a group of size > 1 feeding a later HC block
with only row-local nodes in between. Otherwise the graph is left untouched and the report says why.

Overlap (``overlap``, ``sp_rewrite.overlap``): where the group is NCCL on CUDA with more than one rank and T is
static, the emission also moves each gather's trim past the GEMMs that read it and each scatter's pad into the
row-parallel GEMM's left operand, the form in which Inductor's micro-pipeline TP fuses them into symmetric-memory
ops; the report says per region whether it did and why not.

Code: analysis first, emission second. ``collectives`` finds the all-reduces (typed matches), ``tokens`` reads
token dims and stream values, ``rules`` holds the row-locality checks, ``region`` builds the frozen ``Plan`` of
``Region``s (every check and every size resolved there; a refusal is a ``NotShardable`` value, ``verdict``),
``kept`` judges the slices that keep a few rows, ``emit`` only inserts nodes; this file gates, runs them in that
order and builds the report from the plan. The manager re-propagates the fake values afterwards
(``resizes_values``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.fx as fx

from hcpasses.graph_pass import GraphPass, PassResult, ShardedTokens
from hcpasses.passes.sp_rewrite.collectives import AllReduceMatch, find_all_reduces
from hcpasses.passes.sp_rewrite.emit import Emitted, rewrite_region
from hcpasses.passes.sp_rewrite.overlap import overlap_blocker
from hcpasses.passes.sp_rewrite.region import Plan, Region, find_regions
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.collapse import CollapseFinder

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig


class SPRewrite(GraphPass):
    """Shards the HC streams by tokens: all-reduce -> reduce-scatter + all-gather around HC blocks."""

    name = "sp_rewrite"
    resizes_values = True

    def __init__(self) -> None:
        self._finder = CollapseFinder()

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if not (dist.is_available() and dist.is_initialized()):
            return PassResult(0, "not distributed (tp = 1): nothing to shard")
        collapses = self._finder.find(graph)
        if not collapses:
            return PassResult(0, "no HC block (stream collapse) in this graph", self._finder.evaluation_notes(0))
        reduces = find_all_reduces(graph)
        notes = [f"HC blocks (collapses) found: {len(collapses)}", *self._finder.evaluation_notes(len(collapses))]
        notes += [f"all-reduces: {0 if isinstance(reduces, NotShardable) else len(reduces)}"]
        lookalikes = self._finder.lookalike_note()
        if lookalikes:
            notes.append(lookalikes)
        if isinstance(reduces, NotShardable):
            return PassResult(0, str(reduces), tuple(notes))
        reduces, alone = _over_groups_of_tp(reduces)
        notes += alone
        if not reduces:
            return PassResult(
                0, "every all-reduce sums over a group of size 1 (tp = 1): nothing to shard", tuple(notes)
            )
        plan = find_regions(graph, collapses, reduces, config.sp_min_tokens)
        if not plan.regions:
            return PassResult(0, "no shardable region: " + "; ".join(map(str, plan.cuts)), tuple(notes))
        if isinstance(plan.tokens, int) and plan.tokens < config.sp_min_tokens:
            return PassResult(0, f"T={plan.tokens} < sp_min_tokens={config.sp_min_tokens}", tuple(notes))
        overlap_notes, shaped = [], [0, 0]
        for region in plan.regions:  # in graph order; the regions share no node
            blocker = _overlap_blocker(config, region, plan.tokens)
            emitted = rewrite_region(graph, region, overlap=blocker is None)
            shaped = [shaped[0] + emitted.gemms_after_gathers, shaped[1] + emitted.gemms_before_scatters]
            overlap_notes.append(_overlap_note(region, blocker, emitted))
        tokens = plan.tokens if isinstance(plan.tokens, int) else str(plan.tokens)
        sharded = sum(len(region.collapses) for region in plan.regions)
        facts = _plan_facts(plan) | {"gemms_after_gathers": shaped[0], "gemms_before_scatters": shaped[1]}
        return PassResult(
            sharded,
            None,
            (*notes, *_plan_notes(plan, len(collapses)), *overlap_notes),
            facts,
            ShardedTokens(tokens, config.sp_min_tokens),
        )


def _over_groups_of_tp(reduces: tuple[AllReduceMatch, ...]) -> tuple[tuple[AllReduceMatch, ...], list[str]]:
    """The all-reduces over groups of size > 1, and a note naming the others (they sum nothing: left alone)."""
    alone = [match for match in reduces if match.group.size == 1]
    names = ", ".join(f"{match.all_reduce.name} over {match.group}" for match in alone)
    notes = [f"all-reduces over a group of size 1, left alone: {names}"] if alone else []
    return tuple(match for match in reduces if match.group.size > 1), notes


def _plan_notes(plan: Plan, found: int) -> list[str]:
    notes = []
    for region in plan.regions:
        gathered = ", ".join(exit_.value.name for exit_ in region.exits)
        notes += [
            f"region starts at {region.start.name}: {region.why_start}",
            f"  sharded over {region.group}",
            f"  HC blocks sharded: {len(region.collapses)}; region nodes: {len(region.nodes)}; "
            f"{len(region.reduces)} all-reduce -> reduce-scatter; {len(region.exits)} all-gathers: {gathered}",
        ]
    exits = [exit_ for region in plan.regions for exit_ in region.exits]
    streams = [exit_.value.name for exit_ in exits if exit_.stream_wide]
    entries = sorted({entry.operand.name for region in plan.regions for entry in region.entries})
    halos = [f"{halo.pad.name} ({halo.rows} rows)" for region in plan.regions for halo in region.halos]
    gathers = sum(len(exit_.kept) or 1 for exit_ in exits)
    kept = [
        f"{exit_.value.name} -> {kept.slice.name} ({kept.rows} of {plan.tokens} rows)"
        for exit_ in exits
        for kept in exit_.kept
    ]
    unkept = [why for region in plan.regions for why in region.unkept]
    narrowed = [value for region in plan.regions for value in region.prologue]
    return [
        *notes,
        *(f"region cut at {cut}" for cut in plan.cuts),
        f"HC blocks sharded: {sum(len(r.collapses) for r in plan.regions)} of {found} in {len(plan.regions)} region(s)",
        f"collectives: {sum(len(r.reduces) for r in plan.regions)} all-reduce -> reduce-scatter; "
        f"{gathers + len(halos)} all-gathers added",
        f"stream-wide values gathered (n*S wide, e.g. a returned HC state): {', '.join(streams) or 'none'}",
        f"values from outside sharded where the region reads them row for row (an MTP drafter's embedding, "
        f"features of the ids): {', '.join(entries) or 'none'}",
        f"token windows fed by the rows of the ranks before (a causal conv's halo): {', '.join(halos) or 'none'}",
        f"nodes computing features of the token ids moved onto the shards: {sum(r.hoisted for r in plan.regions)}",
        f"values gathered only in the rows a token slice keeps (logits_to_keep): {', '.join(kept) or 'none'}",
        f"nodes after the HC blocks run on the shards, before those slices (a final norm): "
        f"{sum(r.tail for r in plan.regions)}",
        f"sub-layer inputs gathered past their row-local prologue, no wider (a norm and its cast before the GEMMs): "
        f"{', '.join(narrowed) or 'none'}",
        *(
            [f"slices along the tokens that read every row all the same (gathered): {'; '.join(unkept)}"]
            if unkept
            else []
        ),
        *(f"rows per rank: ceil({plan.tokens}/{size})" for size in sorted({r.group.size for r in plan.regions})),
    ]


def _overlap_blocker(config: HCPassesConfig, region: Region, tokens: Any) -> str | None:
    """Why the region's collectives are not shaped for fusion (``overlap``), or None."""
    if not config.overlap:
        return "flag overlap=False"
    blocker = overlap_blocker(region.group.name)
    if blocker is None and not isinstance(tokens, int):
        # Fused into symm_mem ops, the graph would not compile: their meta functions need static sizes (torch 2.13,
        # tests/test_sp_overlap.py). Unshaped, a symbolic trim and pad keep Inductor's pass from fusing anything.
        return f"symbolic token count {tokens} (the fused symmetric-memory ops need static sizes)"
    return blocker


def _overlap_note(region: Region, blocker: str | None, emitted: Emitted) -> str:
    if blocker is not None:
        return f"overlap over {region.group}: off: {blocker}"
    return (
        f"overlap over {region.group}: {emitted.gemms_after_gathers} GEMM(s) read gathered rows, "
        f"{emitted.gemms_before_scatters} reduce-scatter(s) read a GEMM's rows (for Inductor's micro-pipeline TP)"
    )


def _plan_facts(plan: Plan) -> dict[str, int]:
    exits = [exit_ for region in plan.regions for exit_ in region.exits]
    return {
        "streams_gathered": sum(exit_.stream_wide for exit_ in exits),
        "entries_sharded": len({entry.operand for region in plan.regions for entry in region.entries}),
        "halos": sum(len(region.halos) for region in plan.regions),
        "hoisted": sum(region.hoisted for region in plan.regions),
        "kept_rows_gathers": sum(len(exit_.kept) for exit_ in exits),
        "tail": sum(region.tail for region in plan.regions),
        "prologue_gathers": sum(len(region.prologue) for region in plan.regions),
        "cuts": len(plan.cuts),
    }

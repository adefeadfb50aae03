"""SP region analysis: which stretches of a post-grad graph can run on token-row shards, and why not.

Reads the graph, never changes it. ``find_regions`` returns a frozen ``Plan``: the ``Region``s to shard, each
with everything the emission (``emit``) needs already resolved (token dims of every value it touches, the sizes
it must spell, the values to gather), and every cut (a ``NotShardable`` naming the node and why). The rules are
those of the pass's docstring: every region node row-local or a causal token window (``rules``), every outside
operand free of tokens or read row for row (sharded where it is read), token dims the leading dims of each value
that enters or leaves (``tokens``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from hcpasses.passes.sp_rewrite.collectives import ALL_REDUCE, WAIT, AllReduceMatch, TPGroup
from hcpasses.passes.sp_rewrite.graph import ancestors, descendants, node_order, tensor_operands
from hcpasses.passes.sp_rewrite.kept import ROW_PICKS, KeptRows, indexed_rows, kept_rows
from hcpasses.passes.sp_rewrite.rules import ELEMENTWISE, REDUCTIONS, SIZE_OPS, RowRules, dim_arg, is_pointwise
from hcpasses.passes.sp_rewrite.tokens import (
    Layout,
    Size,
    collapse_tokens,
    first_tensor,
    leading_layout,
    resolve_size,
    same_size,
    stream_value,
)
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.patterns.collapse import FoundCollapse
from hcpasses.patterns.tracing import value_of
from hcpasses.rows import rows_per_rank

aten = torch.ops.aten
SYM_SIZE = torch.ops.aten.sym_size.int
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PROLOGUE_OPS = {*REDUCTIONS, *SIZE_OPS, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default}


@dataclasses.dataclass(frozen=True)
class Entry:
    """A value from outside that a pointwise region node reads row for row (``RowRules.read_by_rows``): sharded
    there."""

    user: fx.Node
    operand: fx.Node


@dataclasses.dataclass(frozen=True)
class Halo:
    """A causal token window's front zero pad (``pad``, ``rows`` rows in front of the token dim ``dim`` of its
    sharded input): on a shard the rows of the ranks before take the zeros' place."""

    pad: fx.Node
    dim: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Exit:
    """A region value that nodes outside the region read: all-gathered for them (``value`` is a region node, or
    the wait of an all-reduce, whose reduce-scatter then stands for it)."""

    value: fx.Node
    users: tuple[fx.Node, ...]
    sizes: tuple[Size, ...]  # its token sizes, to restore several token dims after the gather
    as_bytes: bool  # FP8 codes travel as uint8
    stream_wide: bool  # as wide per token as the streams (n*S): the streams themselves or an HC state
    kept: tuple[KeptRows, ...] = ()  # every user is a slice keeping a few token rows: only those are gathered


@dataclasses.dataclass(frozen=True)
class Region:
    """One stretch of the graph that runs on this rank's token rows, and all that its rewrite needs.

    ``nodes`` run on shards (``start`` and the waits of ``reduces`` are not among them: the start stays full for
    its users outside, the waits are replaced). ``dims`` holds the token dims of every value the region shards,
    reduce-scatters or gathers (they lead with their tokens); ``reshapes`` the layout of every reshape in it.
    ``start_sizes`` are the start's token sizes (what ``Size`` values refer to); ``tokens`` is N. Its all-reduces
    sum over one group, ``group``, which its rows are sharded over (the planner cuts where the group changes).
    """

    start: fx.Node
    why_start: str
    nodes: frozenset[fx.Node]
    reduces: tuple[AllReduceMatch, ...]
    collapses: tuple[FoundCollapse, ...]
    entries: tuple[Entry, ...]
    exits: tuple[Exit, ...]
    tokens: Any
    dims: Mapping[fx.Node, int]
    reshapes: tuple[tuple[fx.Node, Layout], ...]  # region nodes whose size argument gets a shard's token dims
    token_size_reads: tuple[tuple[fx.Node, Size], ...]  # sym_size of a region value's token dim, and its value
    halos: tuple[Halo, ...] = ()
    identity_slices: tuple[fx.Node, ...] = ()  # slices that keep every row of a token dim: dropped on shards
    hoisted: int = 0  # nodes on features of the token ids that run on the shards instead of all rows
    tail: int = 0  # nodes after the HC blocks that lead only to kept rows (a final norm) and run on the shards
    prologue: tuple[str, ...] = ()  # sub-layer inputs gathered narrower, past the row-local steps before their GEMMs
    unkept: tuple[str, ...] = ()  # slices along the tokens after the region that read every row, and why

    def __post_init__(self) -> None:
        groups = {match.group for match in self.reduces}
        if len(groups) != 1:
            raise ValueError(f"a region reduces over exactly one group, got {sorted(map(str, groups))}")

    @property
    def group(self) -> TPGroup:
        return self.reduces[0].group

    @property
    def start_sizes(self) -> tuple[Any, ...]:
        return tuple(value_of(self.start).shape[: self.dims[self.start]])


@dataclasses.dataclass(frozen=True)
class Plan:
    """The regions to shard in graph order (they share no node), every cut, and the token count N."""

    regions: tuple[Region, ...]
    cuts: tuple[NotShardable, ...]
    tokens: Any


def find_regions(
    graph: fx.Graph, collapses: list[FoundCollapse], reduces: Iterable[AllReduceMatch], min_tokens: int
) -> Plan:
    """Every region to shard, block by block.

    A region starts at an HC block's stream value and takes the later blocks it can: a node that cannot run
    on row shards ends it before that node (the values the node reads are gathered there) and the next HC
    block after the node starts the next region. So does the first node that reads an all-reduce over another
    group than the region's earlier ones: a region shards over the one group its all-reduces sum over. A block
    whose stream value cannot be found, or after which no all-reduce feeds an HC block, starts none. One
    unfamiliar piece costs only the blocks it touches. ``min_tokens``: the fewest tokens a sharded graph runs on
    (with a symbolic count, the backend runs fewer unsharded): a token window needs as many rows per rank as it
    reaches back.
    """
    reduces = tuple(reduces)
    order = node_order(graph)
    tokens = collapse_tokens(collapses[0])
    from_ids = descendants(graph, [n for n in graph.nodes if n.op == "placeholder" and _is_integer_tensor(n)])
    carriers = from_ids | descendants(graph, [m.all_reduce for m in reduces])
    builder = _RegionBuilder(graph, order, RowRules(tokens, carriers), reduces, min_tokens, from_ids)
    regions: list[Region] = []
    cuts: list[NotShardable] = []
    first, why_start = 0, "first HC block of the graph"
    while first < len(collapses):
        region, cut = builder.longest_from(collapses[first:], why_start)
        if region is not None:
            regions.append(region)
        if cut is None:
            break
        cuts.append(cut)
        after = [i for i in range(first + 1, len(collapses)) if order[collapses[i].root] > order[cut.node]]
        if not after:
            break
        first, why_start = after[0], f"first HC block after {cut}"
    return Plan(tuple(regions), tuple(cuts), tokens)


class _RegionBuilder:
    """Finds and checks candidate regions of one graph; every check returns its verdict, none raises."""

    def __init__(
        self,
        graph: fx.Graph,
        order: dict[fx.Node, int],
        rules: RowRules,
        reduces: tuple[AllReduceMatch, ...],
        min_tokens: int,
        from_ids: set[fx.Node],
    ) -> None:
        self.graph, self.order, self.rules, self.reduces = graph, order, rules, reduces
        self.min_tokens, self.from_ids = min_tokens, from_ids  # from_ids: the integer inputs and what they feed

    def longest_from(self, blocks: list[FoundCollapse], why_start: str) -> tuple[Region | None, NotShardable | None]:
        """The longest region starting at ``blocks[0]``'s stream value, and the cut that ended it (None when it
        takes every block). Each failed attempt drops the blocks from the failing node on and runs the region up
        to that node's inputs instead (the last sub-layer's reduce-scatter and write-back stay in the region)."""
        start = stream_value(blocks[0])
        if isinstance(start, NotShardable):
            return None, start
        cut: NotShardable | None = None
        end, sinks = len(blocks), []
        tried: set[tuple[int, tuple[fx.Node, ...]]] = set()
        while end > 0 and (end, tuple(sinks)) not in tried:  # an attempt that would repeat itself fails again
            tried.add((end, tuple(sinks)))
            feeding = ancestors([*(c.root for c in blocks[:end]), *sinks])
            used = tuple(m for m in self.reduces if self.order[m.all_reduce] > self.order[start] and m.wait in feeding)
            if not used:
                return None, cut or NotShardable("no all-reduce feeds an HC block after this point", start)
            other = next((match for match in used if match.group != used[0].group), None)
            if other is not None:
                new_cut, sinks = self._group_change(used[0].group, other, feeding)
            else:
                region = self._region(blocks[:end], start, used, sinks, why_start)
                if isinstance(region, Region):
                    return region, cut
                new_cut, sinks = region, region.node.all_input_nodes
            # A retry that fails too says what it was for: the first refusal is the real reason.
            cut = (
                new_cut
                if cut is None
                else NotShardable(f"{new_cut.why}; the region was to end before {cut}", new_cut.node)
            )
            # Keep the blocks before the failing node and run the region up to it: each retry fails, if at all,
            # at a node before this one (the failing node is in the region), so the loop ends.
            end = sum(1 for c in blocks[:end] if self.order[c.root] < self.order[cut.node])
        return None, cut

    def _group_change(
        self, group: TPGroup, other: AllReduceMatch, feeding: set[fx.Node]
    ) -> tuple[NotShardable, list[fx.Node]]:
        """The cut where the region's all-reduces change group: the first node on the region's way that reads
        ``other``'s sum. The region runs up to that node's other inputs (gathered over ``group`` for it); the sum
        stays an all-reduce over its own group, and the next HC block starts a region over that one."""
        readers = [user for user in other.wait.users if user in feeding] or list(other.wait.users)
        reader = min(readers, key=self.order.__getitem__)
        why = (
            f"reads {other.all_reduce.name}, a sum over {other.group}, while the region's all-reduces sum over "
            f"{group}: a region shards over one group"
        )
        return NotShardable(why, reader), [node for node in reader.all_input_nodes if node is not other.wait]

    def _region(
        self,
        collapses: list[FoundCollapse],
        start: fx.Node,
        reduces: tuple[AllReduceMatch, ...],
        sinks: Iterable[fx.Node],
        why_start: str,
        with_tail: bool = True,
    ) -> Region | NotShardable:
        """The region from ``start`` to the ``collapses`` and to ``sinks`` (the inputs of the node that cuts it:
        the region runs up to that node, which reads them gathered), checked node by node. Its tail (``_tail``) and
        its sub-layers' prologues (``_prologue``) never cut it: a region that fails with them is tried again without
        (``with_tail``)."""
        live = [start, *(m.wait for m in reduces)]  # values the region reads in full (start) or replaces (waits)
        sinks = list(sinks)
        reached = self._reach(collapses, live, sinks)
        hoisted = self._hoistable(reached, live)
        refused_tail: set[fx.Node] = set()
        tail, unkept = self._tail(reached, refused_tail, reduces[0].group.size) if with_tail else (set(), ())
        refused_prologue: set[fx.Node] = set()
        prologue = self._prologue(reached | hoisted | tail, refused_prologue) if with_tail else set()
        while True:
            nodes = reached | hoisted | tail | prologue
            sources = self._sources(hoisted, nodes)
            layouts: dict[fx.Node, Layout] = {}
            entries = [Entry(user, source) for source in sources for user in source.users if user in nodes]
            verdicts = itertools.chain(  # lazy: the first refusal is the region's, in this order
                (self._check_live(node, layouts) for node in [*live, *sources]),
                (self._check(node, layouts, entries) for node in sorted(nodes, key=self.order.__getitem__)),
                (self._check_partial_sum(match, nodes) for match in reduces),
            )
            verdict = next((verdict for verdict in verdicts if verdict), None)
            unhoisted = _left_out(verdict, hoisted) if verdict else set()
            untailed = _left_out(verdict, tail) if verdict else set()
            unprologued = _left_out(verdict, prologue) if verdict else set()
            if not (unhoisted or untailed or unprologued):
                break
            # Computed on all rows again, outside the region; each retry drops at least one node, so the loop ends.
            hoisted -= unhoisted
            if with_tail:
                refused_tail |= untailed
                tail, unkept = self._tail(reached, refused_tail, reduces[0].group.size)
                refused_prologue |= unprologued
                prologue = self._prologue(reached | hoisted | tail, refused_prologue)
        entries.sort(key=lambda entry: self.order[entry.user])
        region = verdict or self._resolve(
            start, why_start, frozenset(nodes), reduces, collapses, tuple(entries), layouts
        )
        if isinstance(region, NotShardable) and (tail or prologue):  # neither cuts a region: try again without
            return self._region(collapses, start, reduces, sinks, why_start, with_tail=False)
        if isinstance(region, NotShardable):
            return region
        return dataclasses.replace(
            region, hoisted=len(hoisted), tail=len(tail), unkept=unkept, prologue=self._narrowed(region, prologue)
        )

    def _hoistable(self, region: set[fx.Node], live: list[fx.Node]) -> set[fx.Node]:
        """Nodes outside ``region`` that compute features of the token ids (descendants of integer inputs) for it
        alone: every user is in the region or hoisted, and the value leads with its tokens. Run on this rank's
        rows instead of all (a PLE's key and value projections of its n-gram embedding, and their norm), their
        inputs from outside sharded where they read them (``_sources``). Ids are replicated, so is what they
        feed. Only nodes after the start (``live[0]``; their shards need the row count, computed from it), never a
        collective. Nodes the checks refuse are dropped again (``_left_out``)."""
        inside = region | set(live)
        candidates = {
            node
            for node in self.from_ids - inside
            if self.order[node] > self.order[live[0]]
            and isinstance(value_of(node), torch.Tensor)
            and self.rules.dims(node) is not None
        }
        return self._leading_to(candidates, inside.__contains__)

    def _tail(self, region: set[fx.Node], refused: set[fx.Node], tp: int) -> tuple[set[fx.Node], tuple[str, ...]]:
        """Nodes after the ``region`` that lead only to slices keeping a few token rows (``kept_rows``): a final norm
        before ``hidden[:, -1:]``, the LM head's input. On the shards, they leave only the kept rows to gather
        instead of every row for them. Nodes the checks ``refused`` and what they feed stay outside. Also why the
        slices along the tokens that read the region (directly or through such nodes) read every row all the same
        (they keep too many rows to gain, or rows a symbolic N may not have)."""
        after = descendants(self.graph, region) - region
        candidates = after - descendants(self.graph, refused) if refused else after
        slices = {node: verdict for node in after if (verdict := self._pick_verdict(node, tp)) is not None}
        tail = self._leading_to(candidates, lambda user: isinstance(slices.get(user), KeptRows))
        reading = region | self._leading_to(candidates, lambda user: slices.get(user) is not None)
        unkept = tuple(
            f"{node.name} {verdict}"
            for node, verdict in sorted(slices.items(), key=lambda item: self.order[item[0]])
            if isinstance(verdict, str) and node.args[0] in reading
        )
        return tail, unkept

    def _leading_to(self, candidates: set[fx.Node], ends: Callable[[fx.Node], bool]) -> set[fx.Node]:
        """The ``candidates`` (computations, not collectives) all of whose users are among them or ``ends``."""
        found: set[fx.Node] = set()
        for node in reversed(self.graph.nodes):  # users before producers
            if node not in candidates or node.op != "call_function" or _is_collective(node):
                continue
            if node.users and all(user in found or ends(user) for user in node.users):
                found.add(node)
        return found

    def _prologue(self, region: set[fx.Node], refused: set[fx.Node]) -> set[fx.Node]:
        """Row-local steps after the ``region`` that its values flow through before the sub-layers' GEMMs read them
        (an RMS norm and its cast to the GEMM's dtype: deepseek_v4 sums its mHC collapse in fp32), taken into the
        region where that leaves no more bytes per token to gather: on the shards they run on 1/tp of the rows, and
        the gather moves the value they leave, narrower or as wide (Megatron's sequence parallelism runs its norms
        on the shards too). As wide counts: a bf16 norm of a bf16 x left on the gathered rows ran on all T rows of
        every rank (deepseek_v4's bf16 input norms: a kernel over T rows per sub-layer that the hand-written SP runs
        on T/tp).

        A step is pointwise, a reduction, a view or a dim op of the leading dims (no GEMM, no token index: a GEMM's
        weight may be a TP shard, whose rows would differ between ranks), reading region values and values without
        tokens alone (a norm's weight: replicated like the HC weights, DESIGN §3). From every such step, steps are
        dropped while one that outside nodes read is wider than what gathering its inputs instead would cost, or as
        wide and no arithmetic (``_narrows``; with what it feeds); then all, unless the gather leaves more bytes per
        token. Nodes the checks ``refused`` and what they feed stay outside."""
        grown: set[fx.Node] = set()
        for node in self.graph.nodes:
            if node in region or node in refused or not _is_prologue_step(node):
                continue
            operands = tensor_operands(node.args)
            inside = [arg for arg in operands if arg in region or arg in grown]
            if inside and all(arg in inside or self._without_tokens(arg) for arg in operands):
                grown.add(node)
        while True:  # a drop only makes more values gathered, so dropping all that fail at once is the same
            inside = region | grown
            drops = {node for node in grown if not self._narrows(node, inside)}
            if not drops:
                break
            grown -= self._fed_by(drops, grown)
        feeding = {arg for node in grown for arg in node.all_input_nodes if arg in region}  # gathered today
        inside = region | grown
        after = [_row_bytes(node, self.rules) for node in feeding | grown if _read_outside(node, inside)]
        before = sum(_row_bytes(node, self.rules) for node in feeding)
        return grown if sum(after) <= before else set()

    def _fed_by(self, nodes: set[fx.Node], steps: set[fx.Node]) -> set[fx.Node]:
        """``nodes`` and the ``steps`` that read them through steps (not the later blocks' steps, which read them
        through the region)."""
        fed = set(nodes)
        for step in self._ordered(steps):
            if any(arg in fed for arg in step.all_input_nodes):
                fed.add(step)
        return fed

    def _narrows(self, node: fx.Node, inside: set[fx.Node]) -> bool:
        """A prologue step that nodes outside read (it would be gathered) moves fewer bytes per token than the
        inputs that would be gathered in its place (those not gathered anyway), or as many and computes (pointwise
        arithmetic: a norm's weight; it then runs on the shards); one read inside only is kept. A view or a copy of
        as many bytes is dropped and its input gathered in its place: once for all the views of it that several
        GEMMs read, and a copy of a broadcast (``clone`` of an ``expand``) is wider than what it copies."""
        if not _read_outside(node, inside):
            return True
        instead = [arg for arg in node.all_input_nodes if arg in inside and not _read_outside(arg, inside)]
        moved, kept = _row_bytes(node, self.rules), sum(_row_bytes(arg, self.rules) for arg in instead)
        return moved < kept or (moved == kept and is_pointwise(node) and node.target not in ELEMENTWISE)

    def _narrowed(self, region: Region, prologue: set[fx.Node]) -> tuple[str, ...]:
        """Each gathered prologue value, as the report names it: ``name (dtype [per-token shape])``."""
        values = [(exit.value, value_of(exit.value)) for exit in region.exits if exit.value in prologue]
        return tuple(f"{node.name} ({val.dtype} {list(val.shape[region.dims[node] :])})" for node, val in values)

    def _without_tokens(self, node: fx.Node) -> bool:
        """A value outside the region that carries no tokens by what it is computed from (a weight, a constant; its
        shape is no guide: a norm weight [S] looks like tokens where S = N). That the step broadcasts it over the
        rows is checked with the region (``RowRules.check_operand``)."""
        return node not in self.rules.token_carriers

    def _ordered(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        return sorted(nodes, key=self.order.__getitem__)

    def _pick_verdict(self, node: fx.Node, tp: int) -> KeptRows | str | None:
        """``kept_rows`` of a slice or select, ``indexed_rows`` of a tensor index, read off its input's value (its
        leading token dims); None for any other node."""
        if node.target not in (*ROW_PICKS, aten.index.Tensor):
            return None
        val = value_of(node.args[0])
        if not isinstance(val, torch.Tensor):
            return None
        k = self.rules.dims(node.args[0])
        if node.target is aten.index.Tensor:
            return indexed_rows(node, k, val.shape, self.rules.tokens, tp)
        return kept_rows(node, k, val.shape, self.rules.tokens, tp, self.min_tokens)

    def _kept(self, users: tuple[fx.Node, ...], k: int, shape: Any, tp: int) -> tuple[KeptRows, ...]:
        """The slices keeping a few token rows of an exit of ``shape`` (``k`` token dims), when every user of it is
        one: only their rows are gathered. Otherwise none: the exit is gathered in full."""
        verdicts = [kept_rows(user, k, shape, self.rules.tokens, tp, self.min_tokens) for user in users]
        kept = tuple(verdict for verdict in verdicts if isinstance(verdict, KeptRows))
        return kept if len(kept) == len(users) else ()

    def _sources(self, hoisted: set[fx.Node], nodes: set[fx.Node]) -> list[fx.Node]:
        """What the hoisted nodes read from outside that carries the ids' tokens: sharded where it is read."""
        found = {
            arg
            for node in hoisted
            for arg in tensor_operands(node.args)
            if arg not in nodes and arg in self.from_ids and self.rules.dims(arg) is not None
        }
        return sorted(found, key=self.order.__getitem__)

    def _check_live(self, node: fx.Node, layouts: dict[fx.Node, Layout]) -> NotShardable | None:
        """The start, a reduce's wait or a hoisted node's source: it leads with the tokens (it is sharded or
        reduce-scattered)."""
        verdict = self.rules.check_leading(node)
        if verdict is None:
            layouts[node] = leading_layout(first_tensor(value_of(node)), self.rules.tokens)
        return verdict

    def _reach(self, collapses: list[FoundCollapse], live: Iterable[fx.Node], sinks: Iterable[fx.Node]) -> set[fx.Node]:
        """Every node reachable from the ``live`` values (the start, the reduces' waits) without passing through a
        collapse output (the sub-layer starts there) or a collective, that leads to one of the ``collapses`` or
        ``sinks``, and the items of its multi-output nodes (a split's other part, such as the inject logits of a
        block whose combine is past the region's end, is read outside through its getitem: that item is the value
        gathered for it, never the list)."""
        stops = {out for c in collapses for out in c.outputs}
        live = set(live)
        reached: set[fx.Node] = set()
        for node in self.graph.nodes:
            if node in live or node.op != "call_function" or node.target in (ALL_REDUCE, WAIT, SYM_SIZE):
                continue
            if any((arg in reached or arg in live) and arg not in stops for arg in node.all_input_nodes):
                reached.add(node)
        wanted = ancestors([*(c.root for c in collapses), *sinks]) | stops
        nodes = {node for node in reached if node in wanted}
        items = {
            user
            for node in nodes
            if not isinstance(value_of(node), torch.Tensor)
            for user in node.users
            if user.target is operator.getitem and user in reached
        }
        return nodes | items

    def _check(self, node: fx.Node, layouts: dict[fx.Node, Layout], entries: list[Entry]) -> NotShardable | None:
        """``node`` runs on row shards: its layout follows from its region operands' (``layouts``, filled in
        graph order), and every operand from outside carries no tokens or is read row for row (an ``Entry``)."""
        layout = self.rules.layout(node, layouts)
        if isinstance(layout, NotShardable):
            return layout
        layouts[node] = layout
        for position, arg in enumerate(node.args):
            for operand in tensor_operands(arg):
                if operand in layouts:
                    continue
                if self.rules.read_by_rows(node, operand, layouts):
                    entries.append(Entry(node, operand))
                    continue
                verdict = self.rules.check_operand(node, position, operand, layout)
                if verdict:
                    return verdict
        return None

    def _check_partial_sum(self, match: AllReduceMatch, region: set[fx.Node]) -> NotShardable | None:
        """An all-reduce's input is a TP partial sum: each rank's share of every row. Computed in the region it
        would hold this rank's share of this rank's rows only, which no collective can sum (nor may it be
        gathered: ranks' shares differ). That happens when the sub-layer input comes from a block whose
        collapse was not recognised (so not gathered there): the region must end where the streams branch
        into that block, which then runs on all rows."""
        partial = match.partial
        if partial not in region:
            return None
        feeding = ancestors([partial]) & region
        branches = [n for n in feeding if any(user in region and user not in feeding for user in n.users)]
        # No branch point: end the region at its first node on the way (it reads only replicated values).
        where = min(branches or feeding, key=self.order.__getitem__)
        return NotShardable(
            f"feeds the TP partial sum {partial.name} of {match.all_reduce.name} through no recognised HC collapse "
            "(an unrecognised block's sub-layer must read all rows)",
            where,
        )

    def _resolve(
        self,
        start: fx.Node,
        why_start: str,
        nodes: frozenset[fx.Node],
        reduces: tuple[AllReduceMatch, ...],
        collapses: list[FoundCollapse],
        entries: tuple[Entry, ...],
        layouts: Mapping[fx.Node, Layout],
    ) -> Region | NotShardable:
        """Everything the emission needs, read off the unsharded graph: token dims, sizes to spell, exits."""
        dims = {start: self.rules.dims(start)}
        for node in [*(m.partial for m in reduces), *(e.operand for e in entries)]:
            dims[node] = self.rules.dims(node)
        for match in reduces:
            dims[match.wait] = dims[match.partial]
        start_sizes = tuple(value_of(start).shape[: dims[start]])
        reads = []
        for node in self.graph.nodes:  # sym_size of a token dim of a region value: read off the unsharded start
            if node.target is SYM_SIZE and node.args[0] in nodes and layouts[node.args[0]].holds(node.args[1]):
                size = resolve_size(value_of(node.args[0]).shape[node.args[1]], start_sizes, self.rules.tokens)
                if size is None:
                    return NotShardable(f"token size {value_of(node)} is neither N nor one of the start's sizes", node)
                reads.append((node, size))
        halos = self._halos(nodes, layouts, reduces[0].group.size)
        if isinstance(halos, NotShardable):
            return halos
        identity_slices = tuple(
            node
            for node in nodes
            if node.target is aten.slice.Tensor and layouts[node].holds(dim_arg(node) % value_of(node).dim())
        )
        read_nodes = {node for node, _ in reads}
        exits = []
        stream_width = math.prod(value_of(start).shape[dims[start] :])
        for value in sorted([*nodes, *(m.wait for m in reduces)], key=self.order.__getitem__):
            users = tuple(u for u in value.users if u not in nodes and u not in read_nodes)
            val = value_of(value)
            if not users or not isinstance(val, torch.Tensor):
                continue
            k = layouts[value].leading_dims(val.shape)
            if k is None:
                why = f"read outside the region, but holds its tokens as {layouts[value]}, not as its leading dims"
                return NotShardable(why, value)
            verdict = self.rules.check_leading(value)
            if verdict:
                return verdict
            dims[value] = k
            sizes = tuple(resolve_size(size, start_sizes, self.rules.tokens) for size in val.shape[:k])
            if None in sizes:
                return NotShardable(f"token sizes {tuple(val.shape[:k])} are not the start's sizes nor N", value)
            wide = same_size(math.prod(val.shape[k:]), stream_width)
            kept = self._kept(users, k, val.shape, reduces[0].group.size)
            exits.append(Exit(value, users, sizes, val.dtype in FP8_DTYPES, wide, kept))
        return Region(
            start=start,
            why_start=why_start,
            nodes=nodes,
            reduces=reduces,
            collapses=tuple(collapses),
            entries=entries,
            exits=tuple(exits),
            tokens=self.rules.tokens,
            dims=dims,
            reshapes=tuple((node, layouts[node]) for node in nodes if node.target in SIZE_OPS),
            token_size_reads=tuple(reads),
            halos=halos,
            identity_slices=identity_slices,
        )

    def _halos(
        self, nodes: frozenset[fx.Node], layouts: Mapping[fx.Node, Layout], tp: int
    ) -> tuple[Halo, ...] | NotShardable:
        """The token windows' front pads. Each rank's halo comes from the ranks before it: the last min(R, rows)
        rows of each (static N), or the last ``rows`` rows (symbolic N: a static gather size), which every rank
        holds only when R >= rows for every N the sharded graph runs on (N >= ``min_tokens``)."""
        halos = []
        for node in sorted(nodes, key=self.order.__getitem__):
            layout = layouts[node]
            if node.target is aten.constant_pad_nd.default and layout.halo and not layouts[node.args[0]].halo:
                halos.append(Halo(node, layout.first, layout.halo))
                fewest = rows_per_rank(self.min_tokens, tp)
                if not isinstance(self.rules.tokens, int) and fewest < layout.halo:
                    why = (
                        f"a token window {layout.halo} rows back needs as many rows per rank; with a symbolic "
                        f"token count, sharded graphs run from sp_min_tokens={self.min_tokens} tokens: {fewest} "
                        f"rows at tp {tp}"
                    )
                    return NotShardable(why, node)
        return tuple(halos)


def _left_out(verdict: NotShardable, optional: set[fx.Node]) -> set[fx.Node]:
    """The nodes the region took on top of its own (``optional``: hoisted ones, its tail) to compute outside it
    again after ``verdict``: the refused node if optional, else the optional nodes next to it (the readers of a
    refused source or outside value, the operands of a refused region node); and the optional nodes feeding them
    (an optional node is taken only if all its users are). Empty when the refusal has nothing to do with them."""
    node = verdict.node
    if node is None:
        return set()
    refused = {node} if node in optional else {*node.users, *node.all_input_nodes} & optional
    return (ancestors(refused) & optional) | refused


def _is_prologue_step(node: fx.Node) -> bool:
    """A step a sub-layer's prologue may take on the shards: pointwise, a reduction, a view, a dim op of the
    leading dims (the checks decide which dims)."""
    if node.op != "call_function" or _is_collective(node) or not isinstance(value_of(node), torch.Tensor):
        return False
    return node.target in PROLOGUE_OPS or is_pointwise(node)


def _read_outside(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether a node outside ``inside`` reads ``node``'s value (a token size read excepted: it is no gather)."""
    return any(user not in inside and user.target is not SYM_SIZE for user in node.users)


def _row_bytes(node: fx.Node, rules: RowRules) -> float:
    """Bytes per token of ``node``'s value (its sizes after the leading token dims); infinite where they are not
    known (tokens not leading, a symbolic size): such a value is never chosen to be gathered instead."""
    val = value_of(node)
    k = rules.dims(node) if isinstance(val, torch.Tensor) else None
    if k is None or not all(isinstance(size, int) for size in val.shape[k:]):
        return math.inf
    return math.prod(val.shape[k:]) * val.element_size()


def _is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def _is_integer_tensor(node: fx.Node) -> bool:
    val = value_of(node)
    return isinstance(val, torch.Tensor) and not val.is_floating_point()

"""What every hcpasses graph pass is: a name, a ``run`` that rewrites an FX graph in place, a result.

A pass mutates the post-grad graph it is given and returns how many rewrites it applied; when it
applies none it says why. It must keep the graph's inputs (placeholders) as they are. The manager
times it, brings fake values up to date or checks them (see ``GraphPass.resizes_values``), and rolls
it back if it raises or leaves a graph that does not verify.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch.fx as fx

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig


@dataclasses.dataclass(frozen=True)
class ShardedTokens:
    """A pass sharded the graph's ``tokens`` rows across the TP ranks (the SP rewrite's decision).

    The backend reads it: a sharded graph is never captured as a CUDA graph, and when ``tokens`` is symbolic
    (an expression in the graph's size symbols, ``"s0"`` or ``"s0*s1"``; an int when static) it compiles the
    graph again without that pass and runs the sharded graph for ``tokens >= min_tokens`` only.
    """

    tokens: int | str
    min_tokens: int

    @property
    def symbolic(self) -> bool:
        return isinstance(self.tokens, str)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass did to one graph.

    Attributes:
        applied: number of rewrites applied (0: the graph is unchanged).
        reason: why nothing (or not everything) was rewritten; ``None`` when there is nothing to say.
        notes: facts worth showing in the report (what was found, where a region starts and ends).
        facts: counts worth a machine-readable name in the report (e.g. ``cuts`` of the SP regions).
        sharded: set by a pass that sharded the graph's token rows; the backend acts on it.
    """

    applied: int
    reason: str | None = None
    notes: tuple[str, ...] = ()
    facts: dict[str, int] = dataclasses.field(default_factory=dict)
    sharded: ShardedTokens | None = None


class GraphPass(abc.ABC):
    """Base class of the passes the manager runs. ``name`` is also the pass's config flag.

    ``resizes_values``: the pass changes the sizes of values it keeps (the SP rewrite: T rows become R). After
    it the manager re-propagates the fake values of what it touched (a value that cannot be propagated rolls
    it back) instead of checking them against the records from before the pass, which it does for the others.
    """

    name: ClassVar[str]
    resizes_values: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        """Rewrite ``graph`` in place and say what was done."""

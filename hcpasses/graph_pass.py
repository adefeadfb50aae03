"""What every hcpasses graph pass is: a name, a ``run`` that rewrites an FX graph in place, a result.

A pass mutates the post-grad graph it is given and returns how many rewrites it applied; when it
applies none it says why. It must keep the graph's inputs (placeholders) as they are and give every
node it creates a ``meta["val"]``. The manager times it, verifies the graph after it and rolls it
back if it raises or leaves a graph that does not verify.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch.fx as fx

from hcpasses.config import HCPassesConfig

if TYPE_CHECKING:
    from hcpasses.verify import GraphState


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass did to one graph.

    Attributes:
        applied: number of rewrites applied (0: the graph is unchanged).
        reason: why nothing (or not everything) was rewritten; ``None`` when there is nothing to say.
        notes: facts worth showing in the report (what was found, where a region starts and ends).
        facts: machine-readable facts for the backend (e.g. the symbolic token count SP sharded over).
        propagated: the graph's state right after the pass brought every fake value up to date
            (``hcpasses.verify.refresh_fake_values``), if it did: the manager verifies only what changed since.
    """

    applied: int
    reason: str | None = None
    notes: tuple[str, ...] = ()
    facts: dict[str, str] = dataclasses.field(default_factory=dict)
    propagated: GraphState | None = None


class GraphPass(abc.ABC):
    """Base class of the passes the manager runs. ``name`` is also the pass's config flag."""

    name: ClassVar[str]

    @abc.abstractmethod
    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        """Rewrite ``graph`` in place and say what was done."""

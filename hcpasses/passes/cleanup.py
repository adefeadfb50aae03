"""Cleanup pass: erase pure nodes whose results nothing uses.

Before::

    %a = aten.mul(%x, 2)        # no users
    %b = aten.add(%x, 1)
    return (%b,)

After::

    %b = aten.add(%x, 1)
    return (%b,)

Applies to every graph. Bails out of nothing: it only erases nodes FX reports as pure
(``Node.is_impure()`` is false: no in-place ops, no collectives, no RNG that must run), so the graph's
outputs and side effects are unchanged. The other passes leave such nodes behind when they replace a
chain whose intermediate values had other uses that also got replaced. Inductor erases them too, but
only after our passes ran, and they would show up in every dump.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from hcpasses.graph_pass import GraphPass, PassResult

if TYPE_CHECKING:
    from hcpasses.config import HCPassesConfig


class DeadCodeCleanup(GraphPass):
    name = "cleanup"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        before = len(graph.nodes)
        graph.eliminate_dead_code()  # FX's own DCE keeps impure nodes; no need for our own walk
        removed = before - len(graph.nodes)
        return PassResult(applied=removed, reason=None if removed else "no unused pure nodes")

"""The one bail-out convention of the SP analysis: a ``NotShardable`` value, returned (never raised)."""

from __future__ import annotations

import dataclasses

import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class NotShardable:
    """Why the rewrite cannot reach ``node`` (or, with no node, the graph): the report prints it as is."""

    why: str
    node: fx.Node | None = None

    def __str__(self) -> str:
        return self.why if self.node is None else f"{self.node.name} ({self.node.target}): {self.why}"

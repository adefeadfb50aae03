"""The session's tally of rewritten graphs checked against eager (the reliability budget, ``tests/conftest.py``).

Kept apart from ``reference.py``: the conftest imports it, and it must not import ``hcpasses`` (the mutant
runner's canary breaks that import on purpose and expects tests to fail, not the conftest to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .reference import RankGraphs


class CheckedGraphs:
    """Tally of the distinct rewritten graphs (a pass applied) whose outputs a test checked against eager.

    The CI profile must check at least ``HCPASSES_MIN_CHECKED_GRAPHS`` of them per run (``tests/conftest.py``);
    a rank's graph counts once however many inputs it ran (a cached capture is one graph).
    """

    MARK = "hcpasses_checked_against_eager"

    def __init__(self) -> None:
        self.graphs = 0

    def add(self, graphs: RankGraphs) -> None:
        """Count each rank's graph of ``graphs`` that a pass rewrote; call once its checks passed."""
        per_rank = len(graphs.reports) // len(graphs.graphs)
        for rank, gm in enumerate(graphs.graphs):
            rewritten = any(graphs.reports[rank * per_rank].applied.values())
            if rewritten and not gm.meta.get(self.MARK):
                gm.meta[self.MARK] = True
                self.graphs += 1

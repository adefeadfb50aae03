"""The registry: every pass, in the order the manager runs them. ``PASSES`` is the only list of passes.

Everything that names the passes is derived from it: the config's pass flags (their names, defaults and
validation, the names ``HCPASSES_DISABLE`` accepts, ``HCPassesConfig.describe()``), the manager's pipeline,
``python -m hcpasses passes`` and the README's flags table (``python -m hcpasses flags --markdown``).

Adding a pass: write a ``GraphPass`` subclass in ``hcpasses/passes/<name>.py`` whose ``name`` is its flag, and put
its ``PassSpec`` into ``PASSES`` where it should run. A pass reads the options its spec lists in ``reads`` from the
config it is handed (``tests/test_registry.py`` checks the list against the pass's source).
"""

from __future__ import annotations

import dataclasses
import functools

from hcpasses.graph_pass import GraphPass
from hcpasses.passes.blocked_scans import BlockedScans
from hcpasses.passes.canonical_forms import CanonicalForms
from hcpasses.passes.cleanup import DeadCodeCleanup
from hcpasses.passes.gated_mean_quant import GatedMeanQuantFusion
from hcpasses.passes.sp_rewrite import SPRewrite


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One pass of the pipeline.

    Attributes:
        graph_pass: the ``GraphPass`` class; its ``name`` is the pass's flag (``backend(sp_rewrite=False)``).
        default: whether the pass runs when its flag is not given.
        summary: what it does, in one line (the CLI and the README's flags table show it).
        reads: the config options the pass reads (``sp_min_tokens``), besides its own flag, which it never reads.
    """

    graph_pass: type[GraphPass]
    default: bool
    summary: str
    reads: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.graph_pass.name


PASSES: tuple[PassSpec, ...] = (
    PassSpec(
        CanonicalForms,
        True,
        "rewrite equivalent spellings of the per-token quant and the stream collapse into the forms the fusion and "
        "SP match (exact rewrites only)",
    ),
    PassSpec(GatedMeanQuantFusion, True, "fuse the HC gated mean with the per-token FP8 quant that follows it"),
    PassSpec(
        SPRewrite,
        True,
        "shard the HC residual streams by tokens across the TP ranks",
        reads=("sp_min_tokens", "overlap"),
    ),
    PassSpec(
        BlockedScans,
        True,
        "run a long cummax / cummin whose indices nothing reads as a blocked scan, which Inductor lowers "
        "to Triton instead of ATen's kernel (CUDA)",
    ),
    PassSpec(DeadCodeCleanup, True, "erase the pure ops whose results nothing uses"),
)


def names() -> tuple[str, ...]:
    """The pass names (flags) in pipeline order."""
    return tuple(spec.name for spec in PASSES)


def pipeline() -> tuple[GraphPass, ...]:
    """The pass objects of ``PASSES`` in pipeline order, one object per class in a process (the fusion traces its
    patterns on its first graph, once)."""
    return tuple(_instance(spec.graph_pass) for spec in PASSES)


@functools.cache
def _instance(graph_pass: type[GraphPass]) -> GraphPass:
    return graph_pass()

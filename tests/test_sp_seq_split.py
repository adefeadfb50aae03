"""The SP rewrite where sub-layers split the token rows into equal sequences, with symbolic sizes, on the simulator.

vLLM-style activations ``[T, hidden]`` hold ``seqs`` sequences of ``T // seqs`` tokens; a sub-layer that works per
sequence views its input as ``x.unflatten(0, (seqs, T // seqs))`` and flattens its output back, so under a dynamic
capture its output has ``seqs*(T//seqs)`` rows, which sympy cannot cancel with the ``T`` rows of the streams it is
added to. Dynamo guarded ``Eq(T, seqs*(T//seqs))`` when it traced the view; the SP pass must read that from the shape
env and keep one region, not cut it at every write-back and gather the whole streams (the benchmark model,
``BenchDecoder``, under ``prefill_sp.py --dynamic`` lost its region so: 16 all-gathers, 7 of them n*S wide).
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import simulate
from harness.reference import RankGraphs, assert_same_as_sp_off, capture_with_passes, collective_counts
from harness.tally import CheckedGraphs
from harness.toy import SequencesHCModel, with_sizes
from hypothesis import given
from hypothesis import strategies as st

from hcpasses.config import HCPassesConfig
from hcpasses.testing.models import HCConfig

EXAMPLE = (3, 5)  # (seqs, tokens per sequence): T = 15; sizes that the drawn shapes map from (distinct values)
LAYERS = 2


def model_config() -> HCConfig:
    return HCConfig.tiny(n_layers=LAYERS, intermediate=96, seed=11)


@functools.lru_cache(maxsize=8)
def captured(tp: int) -> RankGraphs:
    """The dynamic capture for ``tp`` (one serves every shape)."""
    seqs, length = EXAMPLE
    ids = torch.randint(0, 64, (seqs * length,), generator=torch.Generator().manual_seed(3))
    return capture_with_passes(
        lambda rank, tp: SequencesHCModel(model_config()),
        lambda rank, tp: (ids, seqs),
        tp,
        HCPassesConfig(sp_min_tokens=1),
        dynamic=True,
        one_trace=True,
    )


def run(graphs: RankGraphs, ids: torch.Tensor, seqs: int) -> list[list[torch.Tensor]]:
    ranks = range(len(graphs.graphs))
    sizes = {EXAMPLE[0] * EXAMPLE[1]: ids.shape[0], EXAMPLE[0]: seqs}  # the symbolic T and seqs
    return simulate(graphs.graphs, [with_sizes(graphs.inputs[r], graphs.graphs[r], ids, sizes) for r in ranks])


@pytest.mark.parametrize("tp", [2, 3])
def test_one_region_through_sequence_views_with_symbolic_sizes(tp: int) -> None:
    sharded = captured(tp)
    sp = sharded.report.record("sp_rewrite")
    blocks = 2 * LAYERS + 1  # every sub-layer's HC block and the final mixer
    assert sp.applied == blocks, sharded.report
    assert "region cut" not in str(sharded.report), sharded.report
    # one gather per sub-layer input and one of the final mixer's output; none of the n*S-wide streams
    want = {"all_reduce": 0, "reduce_scatter": 2 * LAYERS, "all_gather": 2 * LAYERS + 1}
    assert collective_counts(sharded.graphs[0]) == want, sharded.report


@pytest.mark.parametrize("tp", [2, 3])
@given(seqs=st.integers(2, 4), length=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_sequence_views_sharded_match_sp_off_and_eager(
    tp: int, seqs: int, length: int, seed: int, checked_graphs: CheckedGraphs
) -> None:
    sharded = captured(tp)
    ids = torch.randint(0, 64, (seqs * length,), generator=torch.Generator().manual_seed(seed))
    outputs = run(sharded, ids, seqs)
    for got, want in zip(outputs, run(sharded.sp_off(), ids, seqs), strict=True):
        assert_same_as_sp_off(got, want)
    with torch.no_grad():
        expected = SequencesHCModel(model_config())(ids, seqs)  # no process group: one device
    for (got,) in outputs:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    checked_graphs.add(sharded)

"""SP over the group of the all-reduces a region replaces (DP x TP jobs make their TP group with ``new_group``).

In process: fake worlds whose TP group is a subset (the virtual ranks play one TP group's members, each its global
rank), two groups in one graph, a group of size 1, the internal torch APIs the pass and the cache key read. Over
gloo (thorough): 4 processes as 2 TP groups of 2, each DP replica on its own inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from harness import GroupLayout, fake_process_group, fake_tp_group, simulate, tp_group_name
from harness.reference import assert_same_as_sp_off, capture_with_passes, collective_groups
from harness.tally import CheckedGraphs
from torch.distributed.distributed_c10d import _resolve_process_group

import hcpasses
from hcpasses.config import HCPassesConfig
from hcpasses.manager import PassManager, process_group_layout
from hcpasses.passes.sp_rewrite.collectives import TPGroup, resolve_group
from hcpasses.passes.sp_rewrite.verdict import NotShardable
from hcpasses.testing.models import HCConfig, HCDecoder, RowParallelLinear
from hcpasses.testing.models.decoder import HCDecoderLayer
from hcpasses.testing.multiproc import run_ranks

c10d = torch.ops._c10d_functional
CFG = HCConfig.tiny(n_layers=2, n_heads=12, n_kv_heads=12, intermediate=96, seed=7)
SP_ON = HCPassesConfig(sp_min_tokens=1)


def token_ids(tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))


def eager(ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return HCDecoder(CFG, tp_rank=0, tp_size=1)(ids)


def test_internal_group_apis_pinned() -> None:
    """``_resolve_process_group`` (the pass: group name -> ProcessGroup) and ``_world.pg_names`` (the cache key:
    this process's groups) behave as the code relies on, on torch 2.11 and 2.13."""
    with fake_process_group(3, 4):
        first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
        assert first is dist.GroupMember.NON_GROUP_MEMBER  # rank 3 is not in it
        assert _resolve_process_group(second.group_name) is second
        assert _resolve_process_group(dist.group.WORLD.group_name) is dist.group.WORLD
        with pytest.raises(RuntimeError):
            _resolve_process_group("no such group")
        assert set(dist.distributed_c10d._world.pg_names.values()) == {dist.group.WORLD.group_name, second.group_name}
        assert resolve_group(second.group_name) == TPGroup(second.group_name, second.group_name, 1, 2)
        assert resolve_group(second) == TPGroup(second, second.group_name, 1, 2)
        assert isinstance(resolve_group("no such group"), NotShardable)


def test_cache_key_tells_apart_ranks_in_a_group_of_the_same_name() -> None:
    """Global rank 2 of 4 is rank 0 of group '2' in one layout and rank 1 of group '2' in another: the graphs name
    the same group, so the pass manager's uuid (part of Inductor's cache key) must differ."""
    layouts = (GroupLayout(4, ((0, 1), (2, 3)), played=1), GroupLayout(4, ((0, 3), (1, 2)), played=1))
    keys, names = [], []
    for layout, tp_rank in zip(layouts, (0, 1), strict=True):  # global rank 2 in both
        with fake_tp_group(tp_rank, 2, layout) as group:
            assert dist.get_rank() == 2 and dist.get_rank(group) == tp_rank
            names.append(group.group_name)
            keys.append(PassManager(SP_ON, lambda report: None).uuid())
            assert f"{group.group_name}:{tp_rank}/2" in process_group_layout()
    assert names[0] == names[1] and keys[0] != keys[1]


def build_decoder(rank: int, tp: int, group: dist.ProcessGroup | None = None) -> HCDecoder:
    return HCDecoder(CFG, group=group)


@pytest.mark.parametrize(
    "layout",
    [GroupLayout.strided(dp=2, tp=2, played=1), GroupLayout(6, ((0, 1, 2), (3, 4, 5)), played=1)],
    ids=["dp2_tp2_strided", "dp2_tp3_blocks"],
)
def test_region_shards_over_the_tp_group_of_a_larger_world(layout: GroupLayout, checked_graphs: CheckedGraphs) -> None:
    """The played TP group's members (global ranks != TP ranks): the rewritten graph names that group, shards
    with its rank and size, and computes eager's logits."""
    ids = token_ids(13, seed=1)
    args = lambda rank, tp: (ids,)  # noqa: E731
    graphs = capture_with_passes(build_decoder, args, layout.tp, SP_ON, one_trace=True, layout=layout)
    name = tp_group_name(layout.tp, layout)
    assert name != tp_group_name(layout.tp)  # not the default group's
    for rank, (gm, report) in enumerate(zip(graphs.graphs, graphs.reports, strict=True)):
        sp = report.record("sp_rewrite")
        assert sp.status == "applied" and sp.applied == 2 * CFG.n_layers + 1, sp
        assert f"  sharded over group '{name}' (rank {rank} of {layout.tp})" in sp.notes, sp.notes
        assert collective_groups(gm) == {name}
        # T = 13 splits unevenly: the streams' rows padded to R*tp, then this TP rank's R rows sliced out
        rows = -(-13 // layout.tp)
        shards = [
            n.args[1:] for n in gm.graph.nodes
            if n.target is torch.ops.aten.slice.Tensor and n.args[0].target is torch.ops.aten.constant_pad_nd.default
        ]  # fmt: skip
        assert shards == [(0, rank * rows, (rank + 1) * rows)], gm.code
    outputs = simulate(graphs.graphs, graphs.inputs)
    unsharded = graphs.sp_off()
    for got, want in zip(outputs, simulate(unsharded.graphs, unsharded.inputs), strict=True):
        assert_same_as_sp_off(got, want)
    for rank_outputs in outputs:
        torch.testing.assert_close(rank_outputs[0], eager(ids), rtol=1e-4, atol=1e-4)
    checked_graphs.add(graphs)


class TwoGroupDecoder(HCDecoder):
    """Layer 0 all-reduces over the default group, layer 1 over another group of the same ranks: one graph,
    two groups (the function is the decoder's: every weight is seeded by its name)."""

    def __init__(self, other: dist.ProcessGroup) -> None:
        super().__init__(CFG)
        self.layers[1] = HCDecoderLayer(CFG, 1, tp_rank=self.tp_rank, tp_size=self.tp_size, group=other)


def build_two_groups(rank: int, tp: int) -> TwoGroupDecoder:
    return TwoGroupDecoder(dist.new_group(list(range(tp))))


def test_two_groups_in_one_graph_cut_the_region(checked_graphs: CheckedGraphs) -> None:
    ids = token_ids(11, seed=2)
    graphs = capture_with_passes(build_two_groups, lambda rank, tp: (ids,), 2, SP_ON, codegen=False)
    world, other = "0", "1"  # the default group, then the first group made
    sp = graphs.report.record("sp_rewrite")
    assert sp.status == "applied" and sp.facts["cuts"] == 1, sp
    [cut] = [note for note in sp.notes if note.startswith("region cut at")]
    assert f"a sum over group '{other}'" in cut and f"sum over group '{world}'" in cut, cut
    assert [n for n in sp.notes if n.startswith("  sharded over")] == [
        f"  sharded over group '{world}' (rank 0 of 2)",
        f"  sharded over group '{other}' (rank 0 of 2)",
    ]
    # Layer 0's two sums and layer 1's MLP sum become reduce-scatters, each over its own group; layer 1's attention
    # sum, read where the region over the default group ends, stays an all-reduce over the other group.
    gm = graphs.graphs[0]
    by_op = {
        op: sorted(n.args[-1] for n in gm.graph.nodes if n.target is op)
        for op in (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)
    }
    assert by_op == {c10d.reduce_scatter_tensor.default: [world, world, other], c10d.all_reduce.default: [other]}
    outputs = simulate(graphs.graphs, graphs.inputs)
    for rank_outputs in outputs:
        torch.testing.assert_close(rank_outputs[0], eager(ids), rtol=1e-4, atol=1e-4)
    checked_graphs.add(graphs)


def test_all_reduces_over_a_group_of_size_one_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 1 inside a world of 2 (DP 2), with a model that all-reduces anyway (over its TP group of one rank)."""

    def reduced_anyway(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)

    monkeypatch.setattr(RowParallelLinear, "forward", reduced_anyway)
    layout = GroupLayout.strided(dp=2, tp=1)
    ids = token_ids(9, seed=3)
    graphs = capture_with_passes(build_decoder, lambda rank, tp: (ids,), 1, SP_ON, codegen=False, layout=layout)
    sp = graphs.report.record("sp_rewrite")
    assert sp.status == "unchanged", sp
    assert sp.reason == "every all-reduce sums over a group of size 1 (tp = 1): nothing to shard"
    name = tp_group_name(1, layout)
    assert any(f"over group '{name}' (rank 0 of 1)" in note for note in sp.notes), sp.notes
    assert collective_groups(graphs.graphs[0]) == {name}


DP, TP = 2, 2


def dp_tp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """One rank of DP 2 x TP 2 over gloo: TP groups {0, 1} and {2, 3}, each DP replica on its own tokens."""
    groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(DP)]
    replica = rank // TP
    model = HCDecoder(CFG, group=groups[replica])
    be = hcpasses.backend(sp_min_tokens=1)
    with torch.no_grad():
        logits = torch.compile(model, backend=be)(token_ids(13, seed=10 + replica))
    sp = be.reports[-1].record("sp_rewrite")
    return {"logits": logits, "status": sp.status, "applied": sp.applied, "notes": sp.notes}


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_dp2_tp2_over_gloo_each_group_matches_its_own_eager_model() -> None:
    results = run_ranks(dp_tp_rank, DP * TP, timeout_s=900)
    references = [eager(token_ids(13, seed=10 + replica)) for replica in range(DP)]
    for rank, result in enumerate(results):
        replica = rank // TP
        assert result["status"] == "applied" and result["applied"] == 2 * CFG.n_layers + 1, result["notes"]
        assert any(f"(rank {rank % TP} of {TP})" in note for note in result["notes"]), result["notes"]
        torch.testing.assert_close(result["logits"], references[replica], rtol=1e-4, atol=1e-4)
        # the other replica's tokens give other logits: a group that mixed in the other group's rows would fail here
        assert not torch.allclose(result["logits"], references[1 - replica], atol=1e-2)


def test_shard_for_tp_shards_over_the_given_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Global rank 3 of 4 in TP group {2, 3}: rank 1 of 2's slices, and the sub-layer sums run over that group."""
    pytest.importorskip("transformers")
    from hcpasses.hf import shard_for_tp
    from hcpasses.testing.hf_models import tiny_qwen4_exp

    with fake_tp_group(1, 2, GroupLayout(4, ((0, 1), (2, 3)), played=1)) as group:
        sharded = shard_for_tp(tiny_qwen4_exp(seed=1), group=group)
        expected = shard_for_tp(tiny_qwen4_exp(seed=1), tp_rank=1, tp_size=2)
        for (name, got), (_, want) in zip(sharded.state_dict().items(), expected.state_dict().items(), strict=True):
            assert torch.equal(got, want), name
        summed_over = []

        def recording_all_reduce(x: torch.Tensor, op: str, over: Any) -> torch.Tensor:
            summed_over.append(over)
            return x

        monkeypatch.setattr("hcpasses.hf.tp_shard.funcol.all_reduce", recording_all_reduce)
        with torch.no_grad():
            sharded(torch.randint(0, 64, (1, 5)))
        assert summed_over and all(over is group for over in summed_over)

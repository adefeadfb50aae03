"""Reports on Inductor cache hits: a graph served from the cache comes with the report of the compile that made
that very artefact. Variants that share a cache directory but not an artefact (each TP rank bakes its rank into
its rows; a symbolic-T compile has a sharded and an unsharded variant; grad mode: ``test_grad_mode.py``) must
each get their own report back, never another variant's, and never an empty one."""

from __future__ import annotations

import tempfile

import torch
from corpus.gated_residual import UserHC
from harness import fake_process_group

import hcpasses
from hcpasses.report import GraphReport

# (tp, rank, dynamic T): every variant compiles the same model code into a different artefact.
VARIANTS = [(1, 0, False), (2, 0, False), (2, 1, False), (2, 0, True), (2, 1, True)]


def compile_variant(tp: int, rank: int, dynamic: bool) -> list[GraphReport]:
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=8)
    model = UserHC(layers=1, tp=tp, rank=rank)
    compiled = torch.compile(model, backend=be, dynamic=dynamic)
    # with a symbolic T, the second call (5 < sp_min_tokens) compiles the unsharded variant (lazy_variants)
    with fake_process_group(rank, tp), torch.no_grad():
        for tokens in (9, 5) if dynamic else (9,):
            compiled(torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(rank)))
    return be.reports


def summary(report: GraphReport) -> tuple:
    """What a report says about its graph (not when or where it was made)."""
    records = tuple((r.name, r.status, r.applied, r.reason, r.notes) for r in report.passes)
    return report.variant, report.num_nodes_before, report.num_nodes_after, records


def test_each_variant_gets_its_own_report_from_a_shared_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the backend's report store
    fresh = {variant: compile_variant(*variant) for variant in VARIANTS}
    served = {variant: compile_variant(*variant) for variant in VARIANTS}
    for variant in VARIANTS:
        tp, _, dynamic = variant
        first, again = fresh[variant], served[variant]
        # Not served another variant's artefact: rank 1 must not hit rank 0's entry, dynamic not static's.
        assert [r.cached for r in first] == [False] * len(first), variant
        assert [r.cached for r in again] == [True] * len(first), variant
        assert [summary(r) for r in again] == [summary(r) for r in first], variant
        sharded = [r for r in first if r.record("sp_rewrite").status == "applied"]
        assert len(sharded) == (tp > 1), variant
        # A symbolic T is sharded for large T and compiled unsharded for decode sizes: two artefacts.
        assert [r.variant for r in first] == (["sharded", "unsharded"] if dynamic else ["only"]), variant
        if tp > 1:
            assert first[0].record("sp_rewrite").applied == 3, first[0]  # both HC blocks and the final mixer

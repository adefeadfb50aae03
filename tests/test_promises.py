"""The promises around the passes, through real compiles: the dispatch threshold at its boundary, rollback
fidelity, every pass switched off by flag and by environment, dumps of a mixed compile, and side effects that
survive every pass (issue #23). Each test is written against the promise the README makes, not against one
fault; ``tests/unit/`` holds the fast versions the mutation run uses.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from corpus.gated_residual import UserHC
from corpus.spelled import BlockSpelling, SpelledHC
from harness import compile_without_codegen, fake_process_group, passes_run_every_compile
from harness.capture import capture_ranks_from_one_trace, copy_graph
from harness.graphs import add_unused_neg, first_node, node_program

import hcpasses
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.manager import PassManager
from hcpasses.passes import names, pipeline
from hcpasses.report import GraphReport
from hcpasses.testing.multiproc import run_ranks

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MIN_TOKENS = 16


@pytest.fixture
def rank0_of_2() -> Iterator[None]:
    with fake_process_group(0, 2):
        yield


def token_ids(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(seed))


def stop_before_codegen(monkeypatch) -> None:
    """The backend's compiles run every pass and make their reports, then stop before codegen (Dynamo's graph
    runs eagerly): what is tested is which variant the backend picks, not the code Inductor generates."""
    backend_module = sys.modules["hcpasses.backend"]
    monkeypatch.setattr(backend_module, "compile_fx", compile_without_codegen)


# --- 1. The dispatch threshold: T < sp_min_tokens unsharded, T >= sp_min_tokens sharded ------------------------


@pytest.mark.usefixtures("rank0_of_2")
@pytest.mark.parametrize("tokens", [MIN_TOKENS - 1, MIN_TOKENS, MIN_TOKENS + 1])
def test_static_token_count_at_the_threshold(tokens: int, monkeypatch) -> None:
    stop_before_codegen(monkeypatch)
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=MIN_TOKENS)
    with passes_run_every_compile(), torch.no_grad():
        torch.compile(UserHC(layers=1, tp=2, rank=0), backend=be, dynamic=False)(token_ids(tokens))
    [report] = be.reports
    record = report.record("sp_rewrite")
    if tokens >= MIN_TOKENS:
        assert (record.status, record.applied) == ("applied", 3), str(report)
    else:
        assert (record.status, record.reason) == ("unchanged", f"T={tokens} < sp_min_tokens={MIN_TOKENS}")
    assert be.dispatchers == []


@pytest.mark.usefixtures("rank0_of_2")
def test_symbolic_token_count_dispatches_at_the_threshold(monkeypatch) -> None:
    stop_before_codegen(monkeypatch)
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=MIN_TOKENS)
    model = UserHC(layers=1, tp=2, rank=0)
    compiled = torch.compile(model, backend=be, dynamic=True)
    ran = []
    with passes_run_every_compile(), torch.no_grad():
        for tokens in (MIN_TOKENS + 1, MIN_TOKENS - 1, MIN_TOKENS, MIN_TOKENS + 1, MIN_TOKENS - 1):
            before = dict(be.dispatchers[0].calls) if be.dispatchers else {"sharded": 0, "unsharded": 0}
            compiled(token_ids(tokens))
            after = be.dispatchers[0].calls
            ran.append(next(v for v in ("sharded", "unsharded") if after[v] > before[v]))
    assert ran == ["sharded", "unsharded", "sharded", "sharded", "unsharded"]
    assert len(be.dispatchers) == 1, [str(r) for r in be.reports]  # one graph for every T, in two variants
    assert [r.variant for r in be.reports] == ["sharded", "unsharded"]
    assert [r.record("sp_rewrite").status for r in be.reports] == ["applied", "disabled"]


# --- 2. Rollback restores kwargs, nodes with several users, ops with several outputs ---------------------------


def kwargs_users_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = torch.relu(x @ w)  # several users
    total = torch.sum(y, dim=1, keepdim=True, dtype=torch.float64)  # kwargs: dtype
    var, mean = torch.var_mean(y, dim=0, correction=0)  # several outputs, a kwarg
    return total, y * 2 + y.exp(), mean - var


class DropKwargsRewireThenRaise(GraphPass):
    """Changes every kind of thing a rollback must restore, then fails."""

    name = "sp_rewrite"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        for node in graph.nodes:
            if node.kwargs:
                node.kwargs = {}  # sum in float32, var_mean with the default correction
        relu = first_node(graph, aten.relu.default)
        with graph.inserting_after(relu):
            neg = graph.call_function(aten.neg.default, (relu,))
        relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
        var_mean = first_node(graph, aten.var_mean.correction)
        for user in list(var_mean.users):
            user.args = (var_mean, 1 - user.args[1])  # swap the two outputs
        raise RuntimeError("planted failure after the changes")


class AddUnusedNeg(GraphPass):
    name = "gated_mean_quant"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        add_unused_neg(graph)
        return PassResult(1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_rolled_back_graph_compiles_to_what_eager_computes(dynamic: bool) -> None:
    be = hcpasses.HCPassesBackend(
        HCPassesConfig.resolve(env={}), passes=(AddUnusedNeg(), DropKwargsRewireThenRaise(), *pipeline()[3:])
    )
    x, w = torch.randn(7, 5), torch.randn(5, 6)
    torch._dynamo.reset()
    with passes_run_every_compile():
        got = torch.compile(kwargs_users_outputs, backend=be, dynamic=dynamic)(x, w)
    record = be.reports[0].record("sp_rewrite")
    assert record.status == "rolled_back" and "planted failure" in record.reason
    assert be.reports[0].applied["gated_mean_quant"] == 1 and be.reports[0].applied["cleanup"] == 1
    expected = kwargs_users_outputs(x, w)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


# --- 3. Every pass switched off, by flag and by environment --------------------------------------------------

# Every pass but one applies to this graph: canonical_forms (max(...).values, sum * (1/4)), the fusion, SP at tp 2,
# and cleanup (an unused node, see Spy). blocked_scans has no work here: it changes no CPU graph, and this one has no
# cummax or cummin.
SPELLING_HAS_NO_WORK_FOR = "blocked_scans"
SPELLING = BlockSpelling("rsqrt", "fp32_sum_times_reciprocal", "max_values")


class Spy(GraphPass):
    """Counts the calls of a real pass. Around SP it also leaves an unused node behind, as a rewrite whose replaced
    chain had other uses does: the fusion's pattern matcher erases dead nodes itself, so on this graph cleanup
    has work only after SP."""

    def __init__(self, inner: GraphPass) -> None:
        self.inner, self.name, self.calls = inner, inner.name, 0
        self.resizes_values = inner.resizes_values

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        self.calls += 1
        result = self.inner.run(graph, config)
        if self.name == "sp_rewrite":
            ids = next(n for n in graph.nodes if n.op == "placeholder")
            with graph.inserting_after(ids):
                graph.call_function(aten.neg.default, (ids,)).meta["val"] = ids.meta["val"]
        return result


def run_pipelines(configs: dict[str, HCPassesConfig], passes: dict[str, Callable[[], list[GraphPass]]]) -> dict:
    """Rank 0's post-grad graph of the spelled HC model at tp 2, traced once; each config's pipeline runs on a
    copy. Returns per name: (report, program before, program after, spies)."""
    results: dict[str, Any] = {}

    def rewrite(graph: fx.Graph) -> None:
        if results:  # rank 1's copy: rank 0 is enough
            return
        for name, config in configs.items():
            copy = copy_graph(graph).graph
            reports: list[GraphReport] = []
            spies = [Spy(p) for p in passes[name]()]
            before = node_program(copy)
            PassManager(config, reports.append, passes=spies)(copy)
            results[name] = (reports[0], before, node_program(copy), spies)

    def build(rank: int, tp: int) -> torch.nn.Module:
        return SpelledHC([SPELLING, SPELLING], SPELLING, tp=tp, rank=rank)

    capture_ranks_from_one_trace(build, lambda rank, tp: (token_ids(9),), 2, rewrite)
    return results


def fresh_pipeline() -> list[GraphPass]:
    return [type(p)() for p in pipeline()]


def test_every_pass_disabled_by_flag_or_env_does_not_run_and_says_why() -> None:
    configs = {"all on": HCPassesConfig.resolve(env={}, sp_min_tokens=1)}
    passes = {"all on": fresh_pipeline}
    for name in names():
        configs[f"{name} flag"] = HCPassesConfig.resolve(env={}, sp_min_tokens=1, **{name: False})
        configs[f"{name} env"] = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": name}, sp_min_tokens=1)
        configs[f"{name} absent"] = configs["all on"]
        passes[f"{name} flag"] = passes[f"{name} env"] = fresh_pipeline
        passes[f"{name} absent"] = lambda name=name: [p for p in fresh_pipeline() if p.name != name]
    configs["all off"] = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": ",".join(names())})
    passes["all off"] = fresh_pipeline
    results = run_pipelines(configs, passes)
    report, before, after_all, _ = results["all on"]
    statuses = ["applied", "applied", "applied", "unchanged", "applied"]
    assert [r.status for r in report.passes] == statuses, str(report)  # each pass but blocked_scans has work here
    assert report.record(SPELLING_HAS_NO_WORK_FOR).reason == "no cummax or cummin"
    for name in names():
        absent = results[f"{name} absent"][2]
        if name == SPELLING_HAS_NO_WORK_FOR:
            assert absent == after_all, name  # the pass that has no work here changes nothing
        else:
            assert absent != after_all, name
        for how, reason in (("flag", f"flag {name}=False"), ("env", f"HCPASSES_DISABLE names {name}")):
            report, _, after, spies = results[f"{name} {how}"]
            record = report.record(name)
            assert (record.status, record.applied, record.reason, record.dump) == ("disabled", 0, reason, None)
            assert [s.calls for s in spies] == [int(s.name != name) for s in spies], (name, how)
            assert after == absent, (name, how)  # the graph the other passes make: untouched by this one
    report, before, after, spies = results["all off"]
    assert after == before and not any(s.calls for s in spies)
    assert {r.status for r in report.passes} == {"disabled"}


# --- 4. Dumps of a compile in which a pass applies, one runs unchanged and one is disabled --------------------


def test_dumps_of_an_applied_an_unchanged_and_a_disabled_pass(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HCPASSES_DISABLE", "sp_rewrite")
    config = HCPassesConfig.resolve(dump_dir=str(tmp_path))  # reads HCPASSES_DISABLE from the process
    be = hcpasses.HCPassesBackend(config, passes=(pipeline()[0], AddUnusedNeg(), *pipeline()[2:]))
    x, w = torch.randn(7, 5), torch.randn(5, 6)
    torch._dynamo.reset()
    torch.compile(kwargs_users_outputs, backend=be)(x, w)
    [report] = be.reports
    statuses = {r.name: r.status for r in report.passes}
    assert statuses == {
        "canonical_forms": "unchanged",
        "gated_mean_quant": "applied",
        "sp_rewrite": "disabled",
        "blocked_scans": "unchanged",  # no cummax or cummin
        "cleanup": "applied",  # the unused neg
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph_000", "index.json", "index.md"]
    assert sorted(p.name for p in (tmp_path / "graph_000").iterdir()) == [
        "2_gated_mean_quant.after.py",
        "2_gated_mean_quant.before.py",
        "2_gated_mean_quant.diff",
        "5_cleanup.after.py",
        "5_cleanup.before.py",
        "5_cleanup.diff",
    ]
    rows = (tmp_path / "index.md").read_text().splitlines()[4:]
    assert [row.split(" | ")[3] for row in rows] == ["unchanged", "applied", "disabled", "unchanged", "applied"]
    assert "HCPASSES_DISABLE names sp_rewrite" in rows[2]
    [entry] = json.loads((tmp_path / "index.json").read_text())
    assert [r["dump"] for r in entry["report"]["passes"]] == [
        None,
        "graph_000/2_gated_mean_quant.diff",
        None,
        None,
        "graph_000/5_cleanup.diff",
    ]


# --- 5. Side effects: input mutation, a buffer update and a KV-cache write survive every pass ---------------


class MutatingHC(UserHC):
    """``UserHC`` that writes a KV cache (``index_copy_`` of a projection of the first sub-layer's input), counts
    its calls in a buffer, and copies its final streams into a caller's tensor."""

    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__(layers=1, tp=tp, rank=rank)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.key = torch.nn.Parameter(torch.randn(32, 32, generator=torch.Generator().manual_seed(7)), False)

    def forward(
        self, ids: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, streams_out: torch.Tensor
    ) -> torch.Tensor:
        h = self.embed[ids].repeat(1, self.n)
        for index, (block, sublayer) in enumerate(zip(self.blocks, self.sublayers, strict=True)):
            x, inject = block(h)
            if index == 0:
                kv_cache.index_copy_(0, positions, F.linear(x, self.key))
            h = block.combine(h, sublayer(x), inject)
        self.calls.add_(1)
        streams_out.copy_(h)
        return F.linear(self.final(h)[0], self.head)


def mutation_inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    cache = torch.randn(tokens + 11, 32, generator=g)
    positions = torch.randperm(tokens + 11, generator=g)[:tokens]
    return token_ids(tokens, seed=tokens), cache, positions, torch.randn(tokens, 128, generator=g)


def mutating_rank(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    model = MutatingHC(tp=world_size, rank=rank)
    be = hcpasses.backend(sp_min_tokens=1)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for call in range(2):  # the second call reuses the compiled graph: its buffer count goes on
            ids, cache, positions, streams = mutation_inputs(9)
            logits = compiled(ids, cache, positions, streams)
            results[f"call{call}"] = (logits, cache, streams, model.calls.clone())
    results["report"] = str(be.reports[0])
    results["applied"] = be.reports[0].applied
    return results


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_mutations_survive_every_pass_at_tp2() -> None:
    results = run_ranks(mutating_rank, 2, timeout_s=600)
    eager = MutatingHC()
    for call in range(2):
        ids, cache, positions, streams = mutation_inputs(9)
        with torch.no_grad():
            logits = eager(ids, cache, positions, streams)
        for rank_results in results:
            got_logits, got_cache, got_streams, got_calls = rank_results[f"call{call}"]
            torch.testing.assert_close(got_logits, logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_cache, cache, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_streams, streams, rtol=1e-5, atol=1e-5)
            assert int(got_calls) == int(eager.calls) == call + 1
    for rank_results in results:
        assert rank_results["applied"]["sp_rewrite"] == 3, rank_results["report"]

"""The backend's decisions with Inductor stubbed out: which graphs are compiled how (sharded / unsharded / CUDA
graphs / autograd), the dispatch on the token count at its threshold, the reports it stores and reloads. The
compile itself is a stub that runs the pass manager Inductor would be given on a traced graph. Fast tests for
the mutation run (docs/TESTING.md); ``tests/test_promises.py`` checks the same promises through real compiles.
"""

from __future__ import annotations

import logging
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from harness.graphs import add_unused_neg, traced
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import hcpasses
from hcpasses.backend import (
    MICRO_PIPELINE_TP,
    HCPassesBackend,
    LazyInputs,
    LazyVariant,
    OwnedOutputs,
    TokenCount,
    TokenDispatch,
    compile_with_defaults,
    default_backend,
    fixed_token_count,
    is_autograd_compile,
    symbol_position,
)
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult, ShardedTokens
from hcpasses.passes.sp_rewrite.overlap import symmetric_memory_groups

backend_module = sys.modules["hcpasses.backend"]
aten = torch.ops.aten


def dynamo_like(fn, *inputs: Any) -> fx.GraphModule:
    """A graph whose placeholders carry ``example_value`` with symbolic sizes, as Dynamo's do."""
    gm = make_fx(fn, tracing_mode="symbolic")(*inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = node.meta["val"]
    return gm


def tokens_and_width(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.sum(-1) + y.sum(-1)).unsqueeze(-1)


def size_symbols(gm: fx.GraphModule) -> list[str]:
    return [str(s) for n in gm.graph.nodes if n.op == "placeholder" for s in n.meta["example_value"].shape]


def test_symbol_position_finds_int_inputs_first_then_tensor_dims() -> None:
    gm = dynamo_like(tokens_and_width, torch.randn(5, 3), torch.randn(5, 4))
    t, w, t2, v = size_symbols(gm)
    assert t == t2 and w != v
    assert symbol_position(gm, t) == (0, 0)
    assert symbol_position(gm, w) == (0, 1)
    assert symbol_position(gm, v) == (1, 1)
    assert symbol_position(gm, "s999") is None
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_before(first):
        count = gm.graph.placeholder("count")
    count.meta["example_value"] = first.meta["example_value"].shape[1]  # a SymInt input carrying the width
    assert symbol_position(gm, w) == (0, None)


def test_token_count_evaluates_its_expression_from_the_inputs() -> None:
    gm = dynamo_like(tokens_and_width, torch.randn(5, 3), torch.randn(5, 4))
    t, w, _, v = size_symbols(gm)
    count = TokenCount.find(gm, f"{t}*{w} + {v}")
    assert count is not None and count.expression == f"{t}*{w} + {v}"
    assert count([torch.empty(7, 2), torch.empty(7, 10)]) == 7 * 2 + 10
    assert TokenCount.find(gm, f"{t}*s999") is None
    assert TokenCount("s0", {"s0": (1, None)})([None, 12]) == 12


@pytest.mark.parametrize(("tokens", "variant"), [(15, "unsharded"), (16, "sharded"), (17, "sharded"), (1, "unsharded")])
def test_dispatch_runs_the_sharded_graph_from_the_threshold_up(tokens: int, variant: str) -> None:
    count = TokenCount("s0", {"s0": (0, 0)})
    dispatch = TokenDispatch(lambda *a: ("sharded", a), lambda *a: ("unsharded", a), count, min_tokens=16)
    x = torch.empty(tokens, 2)
    assert dispatch(x, 3) == (variant, (x, 3))
    assert dispatch.calls == {"sharded": int(variant == "sharded"), "unsharded": int(variant == "unsharded")}


def test_is_autograd_compile() -> None:
    gm = traced(lambda x, w: x @ w)
    plain, wants_grad = torch.randn(2), torch.randn(2, requires_grad=True)
    assert not is_autograd_compile(gm, [plain])
    assert is_autograd_compile(gm, [plain, wants_grad, 3])
    with torch.no_grad():
        assert not is_autograd_compile(gm, [wants_grad])
    gm.register_parameter("p", torch.nn.Parameter(torch.randn(2)))
    assert is_autograd_compile(gm, [plain])
    gm.p.requires_grad_(False)
    assert not is_autograd_compile(gm, [plain])


class FakeSP(GraphPass):
    """Stands in for the SP rewrite: adds a node and says it sharded, over ``symbol`` when T is symbolic."""

    name = "sp_rewrite"

    def __init__(self, symbol: str | None, applies: bool = True) -> None:
        self.symbol, self.applies = symbol, applies

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        if not self.applies:
            return PassResult(0, "no HC block")
        add_unused_neg(graph)
        return PassResult(1, sharded=ShardedTokens(self.symbol or 6, config.sp_min_tokens))


class Compiles:
    """``compile_fx`` stubbed: records each call's config patches and runs its pass manager on a traced graph,
    unless ``cache_hit`` (then no pass runs, as on an Inductor cache hit)."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.seen: list[tuple[fx.GraphModule, list[Any]]] = []
        self.cache_hit = False
        self.graphs_per_compile = 1
        self.fix_tokens = False  # the first compile fixes T (dim 0 of the first input), as Inductor may
        self.fix_tokens_in = 0  # or the compile of this number (from 1) does
        self.contexts: list[Any] = []  # Dynamo's TracingContext during each compile

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], config_patches: dict[str, Any]) -> Any:
        self.patches.append(config_patches)
        self.seen.append((gm, example_inputs))
        self.contexts.append(torch._guards.TracingContext.try_get())
        if (self.fix_tokens and len(self.patches) == 1) or len(self.patches) == self.fix_tokens_in:
            first = next(node for node in gm.graph.nodes if node.op == "placeholder")
            int(first.meta["example_value"].shape[0])  # guard_int: the ShapeEnv replaces the symbol by its value
        for _ in range(0 if self.cache_hit else self.graphs_per_compile):
            config_patches["post_grad_custom_pre_pass"](traced(lambda x, w: torch.relu(x @ w)).graph)
        number = len(self.patches)
        return lambda *args: (number, args)


@pytest.fixture
def compiles(monkeypatch, tmp_path: Path) -> Compiles:
    stub = Compiles()
    monkeypatch.setattr(backend_module, "compile_fx", stub)
    monkeypatch.setattr(backend_module.tempfile, "gettempdir", lambda: str(tmp_path))
    return stub


def make_backend(symbol: str | None = None, applies: bool = True, **flags: Any) -> HCPassesBackend:
    return HCPassesBackend(HCPassesConfig.resolve(env={}, **flags), passes=[FakeSP(symbol, applies)])


def graph_and_inputs(rows: int = 6) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    gm = dynamo_like(tokens_and_width, torch.randn(rows, 3), torch.randn(rows, 4))
    return gm, [torch.randn(rows, 3), torch.randn(rows, 4)]


def manager_flags(patches: dict[str, Any]) -> tuple[bool, bool, bool]:
    manager = patches["post_grad_custom_pre_pass"]
    return manager.config.pass_enabled("sp_rewrite"), manager.autograd, patches["triton.cudagraphs"]


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_symbolic_tokens_compile_a_sharded_and_an_unsharded_variant(compiles: Compiles, cudagraphs: bool) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(size_symbols(gm)[0], sp_min_tokens=6, cudagraphs=cudagraphs)
    compiled = be(gm, inputs)
    assert isinstance(compiled, TokenDispatch) and be.dispatchers == [compiled]
    assert [manager_flags(p) for p in compiles.patches] == [(True, False, False), (False, False, cudagraphs)]
    assert [r.variant for r in be.reports] == ["sharded", "unsharded"] and [r.index for r in be.reports] == [0, 1]
    assert compiled.min_tokens == 6
    assert compiled(torch.empty(5, 3), torch.empty(5, 4))[0] == 2  # the second compile: unsharded
    assert compiled(torch.empty(6, 3), torch.empty(6, 4))[0] == 1
    assert compiled.calls == {"sharded": 1, "unsharded": 1}


class ShardsAsCleanup(FakeSP):
    """Another pass that shards: the backend takes which pass to turn off from the record, not from a name."""

    name = "cleanup"


def test_the_unsharded_variant_turns_off_the_pass_whose_record_sharded(compiles: Compiles) -> None:
    gm, inputs = graph_and_inputs()
    passes = [FakeSP(None, applies=False), ShardsAsCleanup(size_symbols(gm)[0])]
    be = HCPassesBackend(HCPassesConfig.resolve(env={}, sp_min_tokens=6), passes=passes)
    assert isinstance(be(gm, inputs), TokenDispatch)
    enabled = [
        tuple(p["post_grad_custom_pre_pass"].config.pass_enabled(name) for name in ("sp_rewrite", "cleanup"))
        for p in compiles.patches
    ]
    assert enabled == [(True, True), (True, False)]
    assert compiles.patches[1]["post_grad_custom_pre_pass"] is be.unsharded_manager("cleanup")
    assert be.unsharded_manager("cleanup") is be.unsharded_manager("cleanup")  # one uuid, one cache key
    assert be.unsharded_manager("cleanup") is not be.unsharded_manager("sp_rewrite")
    assert be.reports[1].record("cleanup").reason == "flag cleanup=False"
    assert be.reports[1].record("sp_rewrite").reason == "no HC block"


def test_static_sharded_graph_is_compiled_once_and_never_with_cuda_graphs(compiles: Compiles) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(None, cudagraphs=True)
    compiled = be(gm, inputs)
    assert [manager_flags(p) for p in compiles.patches] == [(True, False, False)]
    assert compiled(1)[0] == 1 and be.dispatchers == [] and [r.variant for r in be.reports] == ["only"]


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_unsharded_graph_is_recompiled_with_cuda_graphs_only_when_asked(compiles: Compiles, cudagraphs: bool) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(None, applies=False, cudagraphs=cudagraphs)
    compiled = be(gm, inputs)
    expected = [(True, False, False)] + ([(True, False, True)] if cudagraphs else [])
    assert [manager_flags(p) for p in compiles.patches] == expected
    assert compiled()[0] == len(expected)
    assert [r.variant for r in be.reports] == ["only", "cudagraphs"][: len(expected)]
    # nothing sharded: the same pipeline again, with CUDA graphs (its report is the first one's)
    assert all(p["post_grad_custom_pre_pass"] is be.manager for p in compiles.patches)
    assert [r.record("sp_rewrite").reason for r in be.reports] == ["no HC block"] * len(expected)


def test_sp_off_by_flag_is_no_sharded_variant(compiles: Compiles) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(size_symbols(gm)[0], sp_rewrite=False)
    assert not isinstance(be(gm, inputs), TokenDispatch)
    assert be.reports[0].record("sp_rewrite").status == "disabled"


def test_autograd_compiles_once_with_the_autograd_pipeline(compiles: Compiles) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(size_symbols(gm)[0], cudagraphs=True)
    inputs[0].requires_grad_(True)
    be(gm, inputs)
    assert [manager_flags(p) for p in compiles.patches] == [(True, True, False)]
    assert [r.variant for r in be.reports] == ["autograd"]
    assert be.reports[0].record("sp_rewrite").status == "skipped"


def test_a_token_count_not_among_the_inputs_stays_sharded_and_warns(compiles: Compiles, caplog) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend("s999")
    with caplog.at_level(logging.WARNING, logger="hcpasses"):
        compiled = be(gm, inputs)
    assert len(compiles.patches) == 1 and not isinstance(compiled, TokenDispatch)
    warning = "hcpasses: cannot find the token count s999 among the graph inputs; always sharded"
    assert warning in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(("min_tokens", "compiled_variants"), [(7, ["sharded", "unsharded"]), (6, ["only"])])
def test_a_token_count_the_compile_fixed_picks_the_variant(
    compiles: Compiles, caplog, min_tokens: int, compiled_variants: list[str]
) -> None:
    """T symbolic when the pass ran, fixed (6) by the sharded compile: below the threshold the graph is compiled
    again unsharded and that compile is what runs; from the threshold up the sharded one; no dispatch, no warning."""
    gm, inputs = graph_and_inputs(rows=6)
    symbol = size_symbols(gm)[0]
    compiles.fix_tokens = True
    be = make_backend(symbol, sp_min_tokens=min_tokens)
    with caplog.at_level(logging.INFO, logger="hcpasses"):
        compiled = be(gm, inputs)
    assert fixed_token_count(gm, symbol) == 6 and TokenCount.find(gm, symbol) is None
    assert not isinstance(compiled, TokenDispatch) and be.dispatchers == []
    assert [r.variant for r in be.reports] == compiled_variants
    assert compiled()[0] == len(compiled_variants) == len(compiles.patches)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_fixed_token_count_is_none_while_a_symbol_is_free() -> None:
    gm, _ = graph_and_inputs(rows=6)
    t, w, _, _ = size_symbols(gm)
    assert fixed_token_count(gm, t) is None and fixed_token_count(gm, f"{t}*{w}") is None
    assert fixed_token_count(traced(lambda x: x + 1, (2, 3)), "s0") is None  # no symbolic input at all


def test_dumps_turn_off_every_cache(compiles: Compiles, tmp_path: Path) -> None:
    gm, inputs = graph_and_inputs()
    make_backend(None, dump_dir=str(tmp_path / "dumps"))(gm, inputs)
    make_backend(None)(gm, inputs)
    assert [p.get("force_disable_caches") for p in compiles.patches] == [True, None]


def test_a_cache_hit_reloads_the_stored_report_of_the_same_graph(compiles: Compiles) -> None:
    gm, inputs = graph_and_inputs()
    first = make_backend(size_symbols(gm)[0], sp_min_tokens=6)
    first(gm, inputs)
    compiles.cache_hit = True
    again = make_backend(size_symbols(gm)[0], sp_min_tokens=6)
    again(gm, inputs)
    # the reloaded sharded report names the symbolic T: the unsharded variant is compiled (and reloaded) too
    assert [(r.cached, r.variant, r.index) for r in again.reports] == [(True, "sharded", 0), (True, "unsharded", 1)]
    assert [r.passes for r in again.reports] == [r.passes for r in first.reports]
    assert again.reports[0].applied["sp_rewrite"] == 1 and again.reports[1].applied["sp_rewrite"] == 0
    assert len(again.dispatchers) == 1
    other = make_backend(size_symbols(gm)[0], sp_min_tokens=7)  # another config: another key, nothing stored
    other(gm, inputs)
    assert [(r.cached, r.passes, r.index) for r in other.reports] == [(True, [], 0)]


def test_the_report_key_ignores_comments_but_not_code_inputs_or_config(compiles: Compiles) -> None:
    be = make_backend(None)
    gm, _ = graph_and_inputs()
    key = be._report_key(gm, be.manager)
    assert key == be._report_key(gm, be.manager) and len(key) == 64
    gm.graph.nodes.__iter__().__next__().meta["example_value"] = torch.empty(2, 2)
    assert be._report_key(gm, be.manager) != key
    gm, _ = graph_and_inputs()
    commented = type("G", (), {"code": "# moved\n" + gm.code, "graph": gm.graph})()
    assert be._report_key(commented, be.manager) == key
    assert be._report_key(gm, be.unsharded_manager("sp_rewrite")) != key


def test_backend_resolves_flags_and_the_default_backend_is_one_object(compiles: Compiles) -> None:
    be = hcpasses.backend(sp_min_tokens=5)
    assert be.config.sp_min_tokens == 5 and be.reports == [] and be.dispatchers == []
    assert be.autograd_manager.autograd is True and be.autograd_manager.config == be.config
    assert default_backend() is default_backend()
    gm, inputs = graph_and_inputs()
    before = len(default_backend().reports)
    compile_with_defaults(gm, inputs)
    assert len(default_backend().reports) == before + 1


def test_int_inputs_and_several_size_symbols() -> None:
    gm, _ = graph_and_inputs()
    be = make_backend(None)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(placeholders[0]):
        steps = gm.graph.placeholder("steps")
    steps.meta["example_value"] = 3
    key = be._report_key(gm, be.manager)
    steps.meta["example_value"] = 4  # another int input: another graph for Dynamo, another report
    assert be._report_key(gm, be.manager) != key
    tokens, width = placeholders[0].meta["example_value"].shape
    with gm.graph.inserting_before(placeholders[0]):
        gm.graph.placeholder("width").meta["example_value"] = width
    steps.meta["example_value"] = tokens  # SymInt inputs: steps (0) carries T, width (1) the width
    assert symbol_position(gm, str(width)) == (1, None)  # the second SymInt input, not the first
    assert symbol_position(gm, str(tokens)) == (0, None)


def test_dispatch_counts_every_call() -> None:
    count = TokenCount("s0", {"s0": (0, None)})
    dispatch = TokenDispatch(lambda *a: "sharded", lambda *a: "unsharded", count, min_tokens=4)
    assert [dispatch(n) for n in (3, 4, 5, 1, 9)] == ["unsharded", "sharded", "sharded", "unsharded", "sharded"]
    assert dispatch.calls == {"sharded": 3, "unsharded": 2}


def test_every_variant_runs_the_backends_passes_and_gets_its_graph(compiles: Compiles) -> None:
    passes = [FakeSP(None)]
    be = HCPassesBackend(HCPassesConfig.resolve(env={}), passes=passes)
    for manager in (be.manager, be.unsharded_manager("sp_rewrite"), be.autograd_manager):
        assert list(manager.passes.values()) == passes
    assert be.inductor_config(be.manager) == {"post_grad_custom_pre_pass": be.manager, "triton.cudagraphs": False}
    gm, inputs = graph_and_inputs()
    be(gm, inputs)
    assert compiles.seen == [(gm, inputs)]
    inputs[0].requires_grad_(True)
    compiled = be(gm, inputs)
    assert compiled(7) == (2, (7,))  # the autograd compile's callable, not its reports


def test_each_report_is_logged_at_info(compiles: Compiles, caplog) -> None:
    gm, inputs = graph_and_inputs()
    be = make_backend(None)
    with caplog.at_level(logging.INFO, logger="hcpasses"):
        be(gm, inputs)
    assert f"hcpasses report\n{be.reports[0]}" in [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_stored_reports_survive_a_missing_store_dir_and_several_graphs(
    compiles: Compiles, monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(backend_module.tempfile, "gettempdir", lambda: str(tmp_path / "not" / "yet"))
    gm, inputs = graph_and_inputs()
    compiles.graphs_per_compile = 2  # two graphs in one compile: one report each, stored together
    first = make_backend(None)
    first(gm, inputs)
    compiles.cache_hit = True
    again = make_backend(None)
    again(gm, inputs)
    assert [r.passes for r in again.reports] == [r.passes for r in first.reports] and len(again.reports) == 2
    assert [(r.cached, r.index) for r in again.reports] == [(True, 0), (True, 1)]


@pytest.mark.parametrize(
    ("flags", "groups"),
    [({}, ["0"]), ({"overlap": False}, ["0"]), ({}, [])],
    ids=["fusable_group", "overlap_off", "no_fusable_group"],
)
def test_micro_pipeline_tp_only_for_sp_compiles_over_fusable_groups(
    monkeypatch, flags: dict[str, Any], groups: list[str]
) -> None:
    """Inductor's micro-pipeline TP (private config) is turned on for a compile only when overlap is on, the SP pass
    runs in it (not the unsharded variant's) and some group can fuse (symmetric memory enabled for it)."""
    monkeypatch.setattr(backend_module, "symmetric_memory_groups", lambda: groups)
    be = HCPassesBackend(HCPassesConfig.resolve(env={}, **flags))
    want = flags.get("overlap", True) and bool(groups)
    assert be.inductor_config(be.manager).get(MICRO_PIPELINE_TP, False) is want
    assert MICRO_PIPELINE_TP not in be.inductor_config(be.unsharded_manager("sp_rewrite"))


def test_no_symmetric_memory_group_without_cuda() -> None:
    assert symmetric_memory_groups() == []  # this machine: no CUDA, whatever the process groups


# ------------------------------------------------------------------------------------------ lazy_variants


def test_lazy_inputs_keep_no_activation_alive_but_keep_what_the_model_holds_and_tiny_tensors() -> None:
    activation, weight, lifted = torch.randn(8, 4), torch.nn.Parameter(torch.randn(4, 4)), torch.tensor(1e-6)
    fakes = ["fake activation", "fake weight", "fake lifted", None]
    inputs = LazyInputs([activation, weight, lifted, 7], fakes)
    released = weakref.ref(activation)
    del activation  # the first call is over: only the lazy inputs could still hold it
    assert released() is None
    got = inputs.get()
    assert got[0] == "fake activation" and got[1] is weight and got[2] is lifted and got[3] == 7


def tracing_context() -> tuple[torch._guards.TracingContext, torch.SymInt]:
    """A Dynamo-like context: a fake mode over a ShapeEnv holding one backed size symbol (hint 32)."""
    shape_env = ShapeEnv()
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=shape_env))
    tokens = shape_env.create_symintnode(shape_env.create_symbol(32, ConstantSource("tokens")), hint=32)
    return context, tokens


def sharded(*args: object) -> str:
    return "sharded"


def test_a_lazy_compile_runs_in_the_context_it_was_made_in_and_only_once() -> None:
    context, _ = tracing_context()
    contexts = []

    def compile_unsharded() -> object:
        contexts.append(torch._guards.TracingContext.try_get())
        return lambda *args: ("unsharded", args)

    variant = LazyVariant(compile_unsharded, sharded, context)
    assert contexts == [] and variant.compiled is None and variant.added == []  # nothing compiled before a call
    assert variant(1, 2) == ("unsharded", (1, 2)) and variant(3) == ("unsharded", (3,))
    assert contexts == [context] and variant.added == []
    assert torch._guards.TracingContext.try_get() is None  # the context is left again


@pytest.mark.parametrize(
    ("constrain", "added"),
    [
        (lambda tokens: bool(tokens >= 4), "{s} >= 4"),  # a guard
        (lambda tokens: bool(tokens == 32), "{s} -> 32"),  # a specialisation
        (lambda tokens: torch._check(tokens <= 1000), "{s} in VR[2, 1000]"),  # a narrowed range
    ],
)
def test_a_lazy_compile_that_adds_shape_constraints_gives_the_variant_up_for_the_sharded_graph(
    constrain, added: str, caplog: pytest.LogCaptureFixture
) -> None:
    context, tokens = tracing_context()
    symbol = str(tokens)  # before a specialisation prints it as its value

    def compile_unsharded() -> object:
        constrain(tokens)  # what a compile that specialises on T does to Dynamo's ShapeEnv
        return lambda *args: "unsharded"

    variant = LazyVariant(compile_unsharded, sharded, context)
    with caplog.at_level(logging.WARNING, logger="hcpasses"):
        assert variant() == "sharded" and variant() == "sharded"
    added = added.format(s=symbol)
    assert added in variant.added, variant.added
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hcpasses"]
    assert "no longer checks" in warning and added in warning and "lazy_variants=False" in warning


def dynamo_context(gm: fx.GraphModule) -> torch._guards.TracingContext:
    """A TracingContext over the fake mode (and ShapeEnv) of ``gm``'s placeholders, as Dynamo's backend call has."""
    fakes = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
    return torch._guards.TracingContext(torch._guards.detect_fake_mode(fakes))


def lazy_dispatch(compiles: Compiles, **flags: Any) -> tuple[TokenDispatch, HCPassesBackend, list[torch.Tensor], Any]:
    gm, inputs = graph_and_inputs()
    be = make_backend(size_symbols(gm)[0], sp_min_tokens=6, **flags)
    context = dynamo_context(gm)
    with torch._guards.tracing(context):
        compiled = be(gm, inputs)
    assert isinstance(compiled, TokenDispatch)
    return compiled, be, inputs, context


def small(rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(rows, 3), torch.empty(rows, 4)


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_lazy_variants_compile_the_unsharded_variant_on_the_first_small_call(
    compiles: Compiles, cudagraphs: bool
) -> None:
    compiled, be, inputs, context = lazy_dispatch(compiles, cudagraphs=cudagraphs)
    assert isinstance(compiled.unsharded, LazyVariant)
    assert len(compiles.patches) == 1 and [r.variant for r in be.reports] == ["sharded"]
    assert compiled(*small(6))[0] == 1 and len(compiles.patches) == 1  # T >= sp_min_tokens: nothing more compiled
    assert compiled(*small(5))[0] == 2  # the second compile, made now: unsharded
    assert compiled(*small(1))[0] == 2 and len(compiles.patches) == 2  # compiled once
    assert [manager_flags(p) for p in compiles.patches] == [(True, False, False), (False, False, cudagraphs)]
    assert compiles.contexts == [context, context]  # the lazy compile re-entered the backend call's context
    assert [r.variant for r in be.reports] == ["sharded", "unsharded"] and [r.index for r in be.reports] == [0, 1]
    assert all(got is want for got, want in zip(compiles.seen[1][1], inputs, strict=True))  # alive: themselves
    assert compiled.unsharded.added == [] and compiled.calls == {"sharded": 1, "unsharded": 2}


def test_a_lazy_compile_gets_dynamos_fakes_for_inputs_that_are_gone(compiles: Compiles) -> None:
    compiled, _, inputs, _ = lazy_dispatch(compiles)
    gm = compiles.seen[0][0]
    fakes = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
    del inputs[:]  # the first call's activations are gone (the stub's record of them too)
    compiles.seen.clear()
    compiled(*small())
    assert all(got is fake for got, fake in zip(compiles.seen[0][1], fakes, strict=True))


def test_lazy_variants_off_or_inputs_that_do_not_line_up_compile_both_variants_up_front(compiles: Compiles) -> None:
    compiled, be, _, _ = lazy_dispatch(compiles, lazy_variants=False)
    assert not isinstance(compiled.unsharded, LazyVariant) and len(compiles.patches) == 2
    compiles.patches.clear()
    gm, inputs = graph_and_inputs()
    be = make_backend(size_symbols(gm)[0], sp_min_tokens=6)
    with torch._guards.tracing(dynamo_context(gm)):
        compiled = be(gm, [*inputs, 3])  # one input more than the graph's placeholders
    assert not isinstance(compiled.unsharded, LazyVariant) and len(compiles.patches) == 2


def test_a_lazy_compile_that_fixes_the_token_count_gives_the_variant_up(compiles: Compiles, caplog) -> None:
    compiles.fix_tokens_in = 2  # the unsharded compile specialises T: a guard Dynamo will never check
    compiled, _, _, _ = lazy_dispatch(compiles)
    with caplog.at_level(logging.WARNING, logger="hcpasses"):
        assert compiled(*small())[0] == 1 and compiled(*small(3))[0] == 1  # the sharded graph runs small T
    assert len(compiles.patches) == 2 and compiled.unsharded.added  # compiled once, then given up
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hcpasses"]
    assert "no longer checks" in warning and compiled.unsharded.added[0] in warning


def test_owned_outputs_copy_each_buffer_once_and_leave_an_inputs_view_alone() -> None:
    pool = torch.zeros(6)

    def compiled(x: torch.Tensor, scale: int) -> tuple[Any, ...]:
        pool.copy_(torch.arange(6.0) * scale)  # this call's outputs, over the last call's
        return pool[:4], pool[2:], x[1:], scale

    x = torch.randn(3)
    first = OwnedOutputs(compiled)(x, 1)
    OwnedOutputs(compiled)(x, 5)
    assert isinstance(first, tuple) and len(first) == 4
    assert torch.equal(first[0], torch.arange(4.0)) and torch.equal(first[1], torch.arange(2.0, 6.0))
    assert first[0].untyped_storage().data_ptr() == first[1].untyped_storage().data_ptr()  # still one buffer
    assert first[0].untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    first[0][3] = -1.0
    assert first[1][1] == -1.0  # they still view one buffer: a write through one shows in the other
    assert first[2].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # the input's, not copied
    assert first[3] == 1
    assert isinstance(OwnedOutputs(lambda: [pool])(), list)


def test_without_cuda_graphs_the_outputs_are_inductors_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is only for graphs compiled with CUDA graphs: ``cudagraphs=False`` returns Inductor's callable."""
    made = []
    monkeypatch.setattr(backend_module, "compile_fx", lambda gm, inputs, config_patches: made.append(1) or gm)
    torch._dynamo.reset()
    be = hcpasses.backend()
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert be(gm, [torch.randn(2)]) is gm and made == [1]
    torch._dynamo.reset()
    made.clear()
    assert isinstance(hcpasses.backend(cudagraphs=True)(gm, [torch.randn(2)]), OwnedOutputs) and made == [1, 1]

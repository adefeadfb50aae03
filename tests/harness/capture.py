"""Capture the post-grad FX graph that Inductor's ``post_grad_custom_pre_pass`` sees (DESIGN §6).

:func:`capture_post_grad` compiles a module or function with ``torch.compile`` and a backend that calls
``torch._inductor.compile_fx.compile_fx`` with a recording :class:`CustomGraphPass` as
``post_grad_custom_pre_pass``. The pass copies the graph it is given into a standalone
``torch.fx.GraphModule`` (node meta, ``"val"`` included, is kept) before later Inductor passes change it.
The capture then runs the compiled callable once (plus ``extra_args`` calls) and records the real
arguments that callable receives: they are the post-grad graph's placeholder values, in order, which the
capture checks against each placeholder's ``meta["val"]``.

Tensor-parallel models run under the ``fake`` process group (one process plays one rank, collectives do
nothing), so one graph per rank can be captured in one process and fed to
:func:`tests.harness.simulator.simulate`. A :class:`GroupLayout` makes the TP group a subset of a larger world
(DP x TP): the virtual ranks play the members of one TP group, each its global rank in the world, and the model
is built with that group (``build_fn(rank, tp, group=...)``).

Internal torch APIs used (each pinned by a test in ``tests/test_harness.py``):
- ``torch.testing._internal.distributed.fake_pg.FakeStore`` (importing the module also registers the
  ``fake`` backend on older versions);
- ``torch._inductor.compile_fx.compile_fx`` and ``torch._inductor.custom_graph_pass.CustomGraphPass``
  (the documented way to plug passes into Inductor, but under ``torch._inductor``);
- the Inductor config keys ``post_grad_custom_pre_pass`` and ``fx_graph_cache``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V
from torch.testing._internal.distributed.fake_pg import FakeStore

from .simulator import simulate, simulate_compiled

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "GroupLayout",
    "RankDependentTrace",
    "RecordingPass",
    "capture_post_grad",
    "capture_ranks",
    "capture_ranks_from_one_trace",
    "check_inputs",
    "compile_without_codegen",
    "copy_graph",
    "fake_process_group",
    "fake_tp_group",
    "passes_run_every_compile",
    "simulate_captured",
    "tp_group_name",
]

# Bypass the FX graph cache (and with it AOTAutograd's cache, which requires it) so that the recording
# pass runs on every compile. ``force_disable_caches`` is not set: it also gives each compile a fresh cache
# dir, so every C++ kernel is compiled again (about 1 s each, scalar), even one this process just built.
_CACHE_PATCHES: dict[str, Any] = {"fx_graph_cache": False}


def passes_run_every_compile() -> contextlib.AbstractContextManager[None]:
    """Inductor config under which every ``torch.compile`` runs the post-grad passes (no FX or AOTAutograd
    cache hit) while identical C++ kernels are still reused from the kernel cache (content-addressed: a
    kernel's binary is keyed by its source)."""
    return torch._inductor.config.patch(_CACHE_PATCHES)


class CaptureError(RuntimeError):
    """The capture did not produce usable graphs or inputs."""


class RankDependentTrace(CaptureError):
    """Rank 0's trace does not hold for another rank's model (e.g. uneven shards): capture per rank."""


@dataclass
class CapturedGraph:
    """One post-grad graph and the real values of its placeholders.

    ``gm`` is a standalone copy of the graph the post-grad pre pass saw. ``calls`` holds the arguments of
    every call of the compiled graph during the capture, in placeholder order (ints for SymInt
    placeholders, tensors detached and cloned at call time); ``inputs`` is ``calls[0]``. The graph's
    outputs are AOTAutograd's flat outputs: for plain inference models, the model's outputs flattened.
    """

    gm: torch.fx.GraphModule
    calls: list[list[Any]]
    rank: int = 0
    tp: int = 1
    compiled: Callable[..., Any] | None = None  # Inductor's generated code for gm (captures with codegen)

    @property
    def inputs(self) -> list[Any]:
        """Placeholder values of the first call."""
        return self.calls[0]

    def placeholders(self) -> list[torch.fx.Node]:
        """The graph's placeholder nodes, in order."""
        return [node for node in self.gm.graph.nodes if node.op == "placeholder"]

    def targets(self) -> list[Any]:
        """Targets of the graph's ``call_function`` nodes, in order."""
        return [node.target for node in self.gm.graph.nodes if node.op == "call_function"]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A standalone ``GraphModule`` holding a node-by-node copy of ``graph`` (meta shallow-copied)."""
    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        env[node] = new_graph.node_copy(node, lambda n: env[n])
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return torch.fx.GraphModule(root, new_graph, class_name="PostGradGraph")


class RecordingPass(CustomGraphPass):
    """Post-grad pre pass that appends a copy of every graph it sees to ``self.graphs``.

    ``inner``, when given, is a user pass that runs first: the recorded graph is the graph after it.
    """

    def __init__(self, inner: Callable[[torch.fx.Graph], None] | None = None, stop: bool = False) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.contexts: list[TracingContext | None] = []  # the tracing context each graph was compiled in
        self.inner = inner
        self.stop = stop
        self._token = uuid.uuid4().hex

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        self.graphs.append(copy_graph(graph))
        self.contexts.append(TracingContext.try_get())
        if self.stop:
            raise _Recorded  # skip Inductor's codegen: only the graph is wanted

    def uuid(self) -> str:
        """Unique per instance: a cached graph is never reused for a recording pass."""
        inner_uuid = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
        return f"tests.harness.RecordingPass:{self._token}:{inner_uuid}"

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordingPass:
        # Inductor may deep-copy its config; the copy must record into the same list.
        return self


class _Recorded(Exception):
    """Raised by a stopping RecordingPass once the graph is recorded."""


def _caused_by_stop(err: BaseException) -> bool:
    """Whether ``err`` is, or wraps (as ``__cause__`` / ``__context__``), the recorder's stop signal."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, _Recorded):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


@dataclass
class _Compiled:
    """What one call of the capturing backend produced."""

    graphs: list[torch.fx.GraphModule]
    compiled: Callable[..., Any] | None = None  # Inductor's generated code (None without codegen)
    calls: list[list[Any]] = field(default_factory=list)
    contexts: list[TracingContext | None] = field(default_factory=list)  # one per graph


def _snapshot(args: Sequence[Any]) -> list[Any]:
    """The arguments as they are now: tensors detached and cloned (the graph may mutate its inputs)."""
    return [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]


class _CapturingBackend:
    """A ``torch.compile`` backend: Inductor with a recording post-grad pre pass; records call arguments."""

    def __init__(self, config_patches: dict[str, Any] | None, codegen: bool = True) -> None:
        patches = {**_CACHE_PATCHES, **(config_patches or {})}
        inner = patches.pop("post_grad_custom_pre_pass", None)
        self.recorder = RecordingPass(inner=inner, stop=not codegen)
        self.patches = {**patches, "post_grad_custom_pre_pass": self.recorder}
        self.compiled: list[_Compiled] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx  # imported late: importing Inductor is slow

        before = len(self.recorder.graphs)
        generated = True
        try:
            compiled = compile_fx(gm, list(example_inputs), config_patches=self.patches)
        except Exception as err:  # Inductor wraps what its passes raise (InductorError on 2.13)
            # Only the recorder's own stop signal is expected; anything else is a real failure.
            if not (self.recorder.stop and len(self.recorder.graphs) > before and _caused_by_stop(err)):
                raise
            compiled, generated = gm.forward, False  # the capture run itself runs Dynamo's graph eagerly
        entry = _Compiled(
            graphs=self.recorder.graphs[before:],
            compiled=compiled if generated else None,
            contexts=self.recorder.contexts[before:],
        )
        self.compiled.append(entry)

        def run(*args: Any) -> Any:
            entry.calls.append(_snapshot(args))
            return compiled(*args)

        return run


def compile_without_codegen(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any]
) -> Callable[..., Any]:
    """Inductor's ``compile_fx`` up to and including the post-grad passes of ``config_patches`` (their
    reports are made), stopped before codegen; returns Dynamo's graph, which runs eagerly. For tests of what a
    backend asks of Inductor, not of the code Inductor generates."""
    from torch._inductor.compile_fx import compile_fx

    stop = RecordingPass(stop=True)
    try:
        compile_fx(gm, list(example_inputs), config_patches={**config_patches, "post_grad_custom_post_pass": stop})
    except Exception as err:  # Inductor wraps what its passes raise (InductorError on 2.13)
        if not (stop.graphs and _caused_by_stop(err)):
            raise
    else:
        raise CaptureError("compile_fx returned without running the post-grad post pass")
    return gm.forward


def check_inputs(gm: torch.fx.GraphModule, values: Sequence[Any]) -> None:
    """Raise :class:`CaptureError` unless ``values`` fit ``gm``'s placeholders (count, kind, dtype, shape)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if len(values) != len(placeholders):
        names = [p.name for p in placeholders]
        raise CaptureError(f"{len(values)} runtime inputs for {len(placeholders)} placeholders ({names})")
    for node, value in zip(placeholders, values, strict=True):
        problem = _input_problem(node.meta.get("val"), value)
        if problem:
            raise CaptureError(f"runtime input for placeholder '{node.name}' does not fit: {problem}")


def _input_problem(expected: Any, value: Any) -> str | None:
    """Why ``value`` cannot be the runtime value of a placeholder whose ``meta["val"]`` is ``expected``."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return f"expected a tensor, got {type(value).__name__}"
        if value.dtype != expected.dtype:
            return f"dtype {value.dtype} != {expected.dtype}"
        mismatch = f"shape {list(value.shape)} != {list(expected.shape)}"
        if value.dim() != expected.dim():
            return mismatch
        pairs = zip(expected.shape, value.shape, strict=True)
        if any(isinstance(want, int) and want != got for want, got in pairs):
            return mismatch
        return None
    if isinstance(expected, (torch.SymInt, int)) and not isinstance(expected, bool):
        return None if isinstance(value, int) else f"expected an int, got {type(value).__name__}"
    return None


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Initialise the default process group as the ``fake`` backend for ``rank``; destroy it on exit.

    Internal API: ``FakeStore`` from ``torch.testing._internal.distributed.fake_pg`` (2.11 and 2.13).
    """
    if dist.is_initialized():
        raise CaptureError("a default process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class GroupLayout:
    """A world of ``world`` ranks split into TP groups (``groups``: global ranks, each group sorted, made in this
    order with ``dist.new_group`` by every rank, as a DP x TP job does); a capture's virtual ranks play the
    members of ``groups[played]``: virtual rank r is global rank ``groups[played][r]``, rank r of that group."""

    world: int
    groups: tuple[tuple[int, ...], ...]
    played: int = 0

    @classmethod
    def strided(cls, dp: int, tp: int, played: int = 0) -> GroupLayout:
        """``dp`` TP groups of ``tp`` ranks, group d holding global ranks d, d + dp, d + 2*dp, ... (DP inner)."""
        return cls(dp * tp, tuple(tuple(range(d, dp * tp, dp)) for d in range(dp)), played)

    @property
    def tp(self) -> int:
        return len(self.groups[self.played])

    def global_rank(self, tp_rank: int) -> int:
        return self.groups[self.played][tp_rank]


@contextlib.contextmanager
def fake_tp_group(tp_rank: int, tp: int, layout: GroupLayout | None = None) -> Iterator[dist.ProcessGroup | None]:
    """A ``fake`` world in which this process is rank ``tp_rank`` of its TP group of size ``tp``; yields that group.

    Without a layout the TP group is the default group (yields None, as models take it). With one, the world is
    ``layout.world`` ranks, this process global rank ``layout.global_rank(tp_rank)``, every group of the layout is
    made, and the played one is yielded.
    """
    if layout is None:
        with fake_process_group(tp_rank, tp):
            yield None
        return
    if layout.tp != tp:
        raise CaptureError(f"the layout's played group has {layout.tp} ranks, not tp = {tp}")
    with fake_process_group(layout.global_rank(tp_rank), layout.world):
        made = [dist.new_group(list(ranks)) for ranks in layout.groups]
        yield made[layout.played]


def tp_group_name(tp: int, layout: GroupLayout | None = None) -> str:
    """The name the TP group gets in the fake world of ``layout`` (the default group's without one): names follow
    the order groups are made in, the same in every rank's world."""
    with fake_tp_group(0, tp, layout) as group:
        return (dist.group.WORLD if group is None else group).group_name


def build_model(
    build_fn: Callable[..., Callable[..., Any]], rank: int, tp: int, group: dist.ProcessGroup | None
) -> Callable[..., Any]:
    """``build_fn(rank, tp)``, or ``build_fn(rank, tp, group=group)`` for a TP group other than the default one."""
    return build_fn(rank, tp) if group is None else build_fn(rank, tp, group=group)


@contextlib.contextmanager
def _group_for(rank: int, tp: int, wanted: bool) -> Iterator[None]:
    """A fake group for ``rank`` of ``tp`` when wanted, reusing a matching default group if one exists."""
    if not wanted:
        yield
        return
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size())
        if have != (rank, tp):
            raise CaptureError(f"the default process group is (rank, size) {have}, not ({rank}, {tp})")
        yield
        return
    with fake_process_group(rank, tp):
        yield


def capture_post_grad(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    dynamic: bool | None = False,
    tp: int = 1,
    rank: int = 0,
    config_patches: dict[str, Any] | None = None,
    fake_pg: bool | None = None,
    extra_args: Sequence[Sequence[Any]] = (),
    fullgraph: bool = False,
    no_grad: bool = True,
    codegen: bool = True,
) -> list[CapturedGraph]:
    """Compile ``fn`` (a module or function), run it on ``args``, return its post-grad graphs in order.

    ``config_patches`` are Inductor config patches; a ``post_grad_custom_pre_pass`` in them runs before
    the recording, so the recorded graph is the graph after it. ``fake_pg`` (default: ``tp > 1``) runs
    the capture as ``rank`` of a ``fake`` process group of size ``tp`` (an existing default group of that
    rank and size is reused). ``extra_args`` are further calls after the first; each compiled graph
    records the arguments of every call it serves. Runs under ``torch.no_grad()`` unless ``no_grad`` is
    False. ``codegen=False`` stops the compile once the graph is recorded (much faster; the capture
    run then executes Dynamo's graph eagerly). Dynamo is reset before and after.
    """
    backend = _CapturingBackend(config_patches, codegen)
    use_group = tp > 1 if fake_pg is None else fake_pg
    with _group_for(rank, tp, use_group):
        torch.compiler.reset()
        try:
            compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                for call_args in (args, *extra_args):
                    compiled(*call_args)
        finally:
            torch.compiler.reset()
    return _results(backend.compiled, rank, tp)


def _results(entries: Sequence[_Compiled], rank: int, tp: int) -> list[CapturedGraph]:
    """One :class:`CapturedGraph` per compiled graph, inputs checked against the placeholders."""
    if not entries:
        raise CaptureError("nothing was compiled (no tensor ops, or dynamo ran everything eagerly)")
    captured = []
    for i, entry in enumerate(entries):
        if len(entry.graphs) != 1:
            count = len(entry.graphs)
            raise CaptureError(f"compiled graph #{i} produced {count} post-grad graphs, expected 1")
        if not entry.calls:
            raise CaptureError(f"compiled graph #{i} was never called during the capture")
        for call in entry.calls:
            check_inputs(entry.graphs[0], call)
        captured.append(CapturedGraph(gm=entry.graphs[0], calls=entry.calls, rank=rank, tp=tp, compiled=entry.compiled))
    return captured


def capture_ranks(
    build_fn: Callable[..., Callable[..., Any]],
    args_fn: Callable[[int, int], Sequence[Any]],
    tp: int,
    *,
    extra_args_fn: Callable[[int, int], Sequence[Sequence[Any]]] | None = None,
    layout: GroupLayout | None = None,
    **capture_kwargs: Any,
) -> list[list[CapturedGraph]]:
    """Capture the post-grad graphs of every rank: ``result[rank][i]`` is rank's i-th graph.

    For each rank, under a ``fake`` group of size ``tp`` (also for tp=1; with ``layout``, as that rank of the
    layout's played TP group), builds the model with ``build_fn(rank, tp)`` (``build_fn(rank, tp, group=...)``
    with a layout; TP models read their rank at construction), gets its arguments from
    ``args_fn(rank, tp)`` (and further calls from ``extra_args_fn``), and calls
    :func:`capture_post_grad` with ``capture_kwargs``. All ranks must produce the same number of graphs.
    """
    per_rank = []
    for rank in range(tp):
        with fake_tp_group(rank, tp, layout) as group:
            model = build_model(build_fn, rank, tp, group)
            args = args_fn(rank, tp)
            extra = extra_args_fn(rank, tp) if extra_args_fn is not None else ()
            kwargs = capture_kwargs if layout is None else {**capture_kwargs, "fake_pg": False}  # the world is made
            graphs = capture_post_grad(model, args, tp=tp, rank=rank, extra_args=extra, **kwargs)
            per_rank.append(graphs)
    counts = [len(graphs) for graphs in per_rank]
    if len(set(counts)) != 1:
        raise CaptureError(f"ranks captured different numbers of graphs: {counts}")
    return per_rank


def capture_ranks_from_one_trace(
    build_fn: Callable[..., Callable[..., Any]],
    args_fn: Callable[[int, int], Sequence[Any]],
    tp: int,
    rewrite: Callable[[torch.fx.Graph], None],
    *,
    dynamic: bool | None = False,
    config_patches: dict[str, Any] | None = None,
    layout: GroupLayout | None = None,
) -> list[list[CapturedGraph]]:
    """Like :func:`capture_ranks` with ``codegen=False`` and ``rewrite`` as the post-grad pre pass, but
    Dynamo and AOTAutograd trace rank 0's model only: every rank's graph is that post-grad graph, copied and
    given to ``rewrite`` under the rank's fake group (the passes read the rank from the default group).

    A trace takes most of a capture's seconds, so this saves tp - 1 of them. It is valid when the graph does
    not depend on the rank: the model reads its rank at construction and its shards have equal shapes on
    every rank. Dynamo checks that for us: each rank's model is called through rank 0's compiled function,
    whose guards accept it only if the trace holds for it. (A
    forward that asks the default group for its rank at call time would see rank 0: such a model must be
    captured per rank.) Raises :class:`RankDependentTrace` before any ``rewrite`` ran when the guards refuse a
    rank. ``tests/test_harness.py`` pins that both captures give the same graphs. ``layout``: as for
    :func:`capture_ranks`.
    """
    models, arguments = [], []
    for rank in range(tp):
        with fake_tp_group(rank, tp, layout) as group:
            models.append(build_model(build_fn, rank, tp, group))
            arguments.append(list(args_fn(rank, tp)))
    patches = dict(config_patches or {})
    if "post_grad_custom_pre_pass" in patches:
        raise CaptureError("capture_ranks_from_one_trace runs `rewrite` itself; pass no post_grad_custom_pre_pass")
    backend = _CapturingBackend(patches, codegen=False)
    with fake_tp_group(0, tp, layout):
        torch.compiler.reset()
        try:
            compiled = torch.compile(_call_model, backend=backend, dynamic=dynamic)
            with torch.no_grad():
                for rank in range(tp):
                    compiled(models[rank], *arguments[rank])
                    if rank == 0:
                        traced = len(backend.compiled)
                    elif len(backend.compiled) != traced:
                        raise RankDependentTrace(
                            f"rank {rank}'s model did not reuse rank 0's trace (Dynamo recompiled: the graph "
                            "depends on the rank); capture it per rank with capture_ranks"
                        )
        finally:
            torch.compiler.reset()
    return [[_rewritten(entry, rank, tp, rewrite, layout) for entry in backend.compiled] for rank in range(tp)]


def _call_model(model: Callable[..., Any], *args: Any) -> Any:
    """The function compiled for every rank: the model is an argument, so one trace serves every rank's model."""
    return model(*args)


def _rewritten(
    entry: _Compiled, rank: int, tp: int, rewrite: Callable[[torch.fx.Graph], None], layout: GroupLayout | None
) -> CapturedGraph:
    """Rank ``rank``'s copy of one recorded graph after ``rewrite``, with the rank's recorded call."""
    if len(entry.graphs) != 1 or len(entry.calls) != tp:
        raise CaptureError(
            f"expected 1 graph called once per rank, got {len(entry.graphs)} graph(s), "
            f"{len(entry.calls)} call(s) for {tp} ranks"
        )
    gm = copy_graph(entry.graphs[0].graph)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    # Inductor runs its post-grad passes in its tracing context, with its fake mode installed (pattern-matcher
    # replacements trace in it) and the Python dispatcher on (the meta kernels of some ops, e.g. a pad of
    # symbolic size, are Python decompositions).
    with (
        fake_tp_group(rank, tp, layout),
        tracing(entry.contexts[0]),
        V.set_fake_mode(fake_mode),
        enable_python_dispatcher(),
    ):
        rewrite(gm.graph)
    gm.recompile()
    check_inputs(gm, entry.calls[rank])
    return CapturedGraph(gm=gm, calls=[entry.calls[rank]], rank=rank, tp=tp)


def simulate_captured(
    captures: Sequence[CapturedGraph], *, call: int = 0, generated: bool = False, timeout_s: float = 60
) -> list:
    """:func:`simulate` one graph per rank (``captures[r]`` is rank r's) on the inputs of call ``call``.

    ``generated=True`` runs Inductor's generated code of each graph instead of its FX graph (the captures
    must have been made with ``codegen=True``).
    """
    for capture in captures:
        if call >= len(capture.calls):
            raise CaptureError(f"rank {capture.rank} recorded {len(capture.calls)} call(s), no call #{call}")
    inputs = [c.calls[call] for c in captures]
    if not generated:
        return simulate([c.gm for c in captures], inputs, timeout_s)
    missing = [c.rank for c in captures if c.compiled is None]
    if missing:
        raise CaptureError(f"ranks {missing} were captured without codegen: no generated code to run")
    return simulate_compiled([c.compiled for c in captures], inputs, timeout_s)


def count_calls(gm: torch.fx.GraphModule, target: Any) -> int:
    """How many nodes of ``gm`` call ``target`` (e.g. a collective)."""
    return sum(1 for n in gm.graph.nodes if n.target is target)

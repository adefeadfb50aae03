"""The torch.compile backend: Inductor with the hcpasses pipeline as its post-grad pre pass.

    be = hcpasses.backend(sp_rewrite=True, dump_dir="dumps")
    compiled = torch.compile(model, backend=be)
    compiled(x)
    print(be.reports[-1])

Variants: when a pass shards a graph whose token count T is symbolic (its record carries a
``ShardedTokens``: the SP rewrite's), the same Dynamo graph is compiled a second time with that pass
off and a ``TokenDispatch`` runs the sharded graph for T >= ``min_tokens`` and the unsharded one below
(decode sizes keep the plain graph). With ``lazy_variants=True`` (the default) that second compile waits for the
first call with T < ``min_tokens`` (``LazyVariant``). With ``cudagraphs=True`` only unsharded graphs are compiled with
CUDA graphs: a graph no pass sharded is compiled again with them, under the same pipeline, and hands the caller
outputs it owns (``OwnedOutputs``: copied out of the graph's memory, which the next call overwrites).

``torch.compile(model, backend="hcpasses")`` finds ``compile_with_defaults`` through the
``torch_dynamo_backends`` entry point; its reports are on ``hcpasses.default_backend().reports``.

Overlap (``overlap=True``, the default): where a group of this process is NCCL on CUDA with more than one rank,
each compile with the SP pass on enables symmetric memory for such groups and turns on Inductor's micro-pipeline TP
pass, which fuses the all-gathers and reduce-scatters SP shaped for it with their GEMMs
(``hcpasses.passes.sp_rewrite.overlap``). Elsewhere (CPU, gloo, one GPU) Inductor's pass stays off.

Grad mode: a graph compiled with grad enabled and parameters or inputs that require grad is an autograd
graph; its pipeline runs no pass and reports why (``hcpasses.manager.AUTOGRAD_REASON``).

Reports and Inductor's caches: the FX graph cache key includes ``PassManager.uuid()`` (package
sources + flags), so a cached graph is always one our passes produced under the same config. On a
cache hit no pass runs; the backend then reloads the report it stored when the graph was first
compiled (keyed by the same uuid, the Dynamo graph's code and the input metadata) and marks it
``cached``. With ``dump_dir`` set, caches are bypassed so every compile writes its dumps.
"""

from __future__ import annotations

import dataclasses
import functools
import getpass
import hashlib
import logging
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx

import hcpasses.passes as registry
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, ShardedTokens
from hcpasses.manager import PassManager
from hcpasses.passes.sp_rewrite.overlap import symmetric_memory_groups
from hcpasses.report import GraphReport

log = logging.getLogger("hcpasses")
MICRO_PIPELINE_TP = "_micro_pipeline_tp"  # torch._inductor.config: its micro-pipeline (async) TP pass


def _input_signature(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({tuple(value.shape)},{tuple(value.stride())},{value.dtype},{value.device},{value.requires_grad})"
    return repr(value)


def symbol_position(gm: fx.GraphModule, symbol: str) -> tuple[int, int | None] | None:
    """Where the runtime value of a size symbol is: ``(input index, None)`` for an int input,
    ``(index, dim)`` for a tensor input with it at ``dim``; ``None`` if no Dynamo graph input carries it."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    for index, value in enumerate(values):
        if isinstance(value, torch.SymInt) and str(value) == symbol:
            return index, None
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if str(size) == symbol:
                    return index, dim
    return None


def fixed_token_count(gm: fx.GraphModule, expression: str) -> int | None:
    """The token count ``expression`` once a compile has fixed its symbols, or None while one is free.

    The SP pass sees T symbolic, but Inductor may specialise it while compiling the sharded graph (T = 2 at tp 2,
    one row per rank: the sharded graph's ``Ne((s0 + 1)//2, 1)`` fails, the recompile adds ``Eq(s0, 2)``); the
    graph's inputs then print the value, not the symbol. Read from the ShapeEnv's ``replacements`` (a torch
    internal, the same in 2.11 and 2.13; pinned by tests/unit/test_unit_backend.py and
    tests/test_simulated_tp.py).
    """
    values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    sizes = [v for v in values if isinstance(v, torch.SymInt)]
    sizes += [size for v in values if isinstance(v, torch.Tensor) for size in v.shape if isinstance(size, torch.SymInt)]
    if not sizes:
        return None
    replacements = {str(symbol): value for symbol, value in sizes[0].node.shape_env.replacements.items()}
    parsed = sympy.sympify(expression)
    value = parsed.subs(
        {symbol: replacements[str(symbol)] for symbol in parsed.free_symbols if str(symbol) in replacements}
    )
    return int(value) if value.is_Integer else None


def is_autograd_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd will build a forward + backward for this graph: grad mode is on and a graph
    input (Dynamo lifts parameters to inputs) or a parameter still held by the module requires grad."""
    if not torch.is_grad_enabled():
        return False
    inputs = (value for value in example_inputs if isinstance(value, torch.Tensor))
    return any(value.requires_grad for value in inputs) or any(p.requires_grad for p in gm.parameters())


class TokenCount:
    """The runtime token count N of a graph: an expression in size symbols (``s0``, or ``s0*s1`` for
    batch x seq), each read from where the graph's inputs carry it."""

    def __init__(self, expression: str, positions: dict[str, tuple[int, int | None]]) -> None:
        self.expression = expression
        parsed = sympy.sympify(expression)
        symbols = sorted(parsed.free_symbols, key=str)
        self.positions = [positions[str(symbol)] for symbol in symbols]
        self._evaluate = sympy.lambdify(symbols, parsed)

    @classmethod
    def find(cls, gm: fx.GraphModule, expression: str) -> TokenCount | None:
        """The token count of ``gm``, or None when one of its symbols is not among the graph inputs."""
        positions = {}
        for symbol in sympy.sympify(expression).free_symbols:
            position = symbol_position(gm, str(symbol))
            if position is None:
                return None
            positions[str(symbol)] = position
        return cls(expression, positions)

    def __call__(self, args: Sequence[Any]) -> int:
        values = [int(args[i]) if dim is None else int(args[i].shape[dim]) for i, dim in self.positions]
        return int(self._evaluate(*values))


class TokenDispatch:
    """Runs the sharded graph for N >= ``min_tokens`` and the unsharded one below (DESIGN §4)."""

    def __init__(
        self,
        sharded: Callable[..., Any],
        unsharded: Callable[..., Any],
        tokens: TokenCount,
        min_tokens: int,
    ) -> None:
        self.sharded, self.unsharded = sharded, unsharded
        self.tokens = tokens
        self.min_tokens = min_tokens
        self.calls = {"sharded": 0, "unsharded": 0}  # how often each variant ran, for reports and tests

    def __call__(self, *args: Any) -> Any:
        variant = "sharded" if self.tokens(args) >= self.min_tokens else "unsharded"
        self.calls[variant] += 1
        return (self.sharded if variant == "sharded" else self.unsharded)(*args)


class OwnedOutputs:
    """A graph compiled with CUDA graphs whose outputs the caller owns: every tensor output that is not a view of an
    input is copied out of the graph's memory, so a later call cannot overwrite it.

    Inductor's CUDA-graph trees give each call's outputs in the graph's pool and write the next call's over them:
    a tensor kept from one call to the next (a KV cache assigned from the forward's output, as deepseek_v4's
    sliding-window cache keeps ``full[:, :, -window + 1 :, :]``) then reads as Inductor's error "accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run" (transformers' ``generate()``, H100, torch
    2.11; ``torch.compile(mode="reduce-overhead")`` too, where the user clones by hand). The copy is per storage, so
    outputs that view one buffer still do after it; outputs that view an input are the input's and are left as they
    are. The cost: one copy of each output buffer per call (a decode step's logits and cache updates)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        outputs = self.compiled(*args)
        inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
        copies: dict[int, torch.UntypedStorage] = {}
        return type(outputs)(_owned(output, inputs, copies) for output in outputs)  # Inductor's: a list or tuple


def _owned(output: Any, inputs: set[int], copies: dict[int, torch.UntypedStorage]) -> Any:
    """``output``, on a copy of its storage (one copy per storage) unless it is not a tensor or views an input."""
    if not isinstance(output, torch.Tensor) or output.untyped_storage().data_ptr() in inputs:
        return output
    storage = output.untyped_storage()
    copy = copies.setdefault(storage.data_ptr(), storage.clone())
    return output.new_empty(0).set_(copy, output.storage_offset(), output.size(), output.stride())


class LazyVariant:
    """A graph's unsharded variant, compiled on its first call rather than in Dynamo's backend call (``lazy_variants``):
    a prefill-only run never compiles it.

    The compile re-enters the Dynamo ``TracingContext`` of the backend call that made the variant
    (``torch._guards.tracing``; internal, the same in 2.11 and 2.13, pinned by tests/test_lazy_variants.py): outside
    it, ``compile_fx`` specialises the graph's symbolic sizes to the example's (docs/BENCHMARKS.md, "Compiling the
    unsharded variant lazily"). Dynamo built the frame's guards from the ShapeEnv when the backend returned, so a
    guard, a replacement or a narrowed range this compile adds would never be checked: then the variant is given up,
    with a warning naming what was added, and ``fallback`` (the sharded graph, correct for every T) runs instead.
    """

    def __init__(self, compile: Callable[[], Callable[..., Any]], fallback: Callable[..., Any], context: Any) -> None:
        self._compile = compile
        self.fallback = fallback
        self.context = context
        self.compiled: Callable[..., Any] | None = None
        self.added: list[str] = []  # what the compile added to the ShapeEnv (non-empty: given up)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._compile_checked()
        return self.compiled(*args)

    def _compile_checked(self) -> Callable[..., Any]:
        shape_env = _shape_env_of(self.context)
        before = _shape_env_state(shape_env)
        with torch._guards.tracing(self.context):
            compiled = self._compile()
        after = _shape_env_state(shape_env)
        self.added = [str(guard.expr) for guard in shape_env.guards[before.guards :]]
        self.added += [f"{s} -> {v}" for s, v in after.replacements.items() if before.replacements.get(s) != v]
        self.added += [f"{s} in {r}" for s, r in after.ranges.items() if s in before.ranges and before.ranges[s] != r]
        if not self.added:
            return compiled
        log.warning(
            "hcpasses: compiling the unsharded variant on its first call added shape constraints Dynamo no longer "
            "checks (%s); small token counts run the sharded graph instead (lazy_variants=False compiles both "
            "variants up front)",
            "; ".join(self.added),
        )
        return self.fallback


class LazyInputs:
    """The example inputs of a compile that happens later, without keeping the first call's activations alive.

    A tensor the model still holds (a parameter, a buffer) is given as itself, through a weak reference; a tensor
    Dynamo made for the call (a Python float it lifted to a 0-d tensor: the graph reads its value with ``.item()``
    while it compiles) is kept, when it is that small; any other tensor that is gone by then (an activation) is
    replaced by Dynamo's fake of it, which carries the same symbolic sizes. Sizes (SymInts) are kept as they are.
    """

    SMALL = 1  # elements: tensors up to this size are kept alive

    def __init__(self, example_inputs: Sequence[Any], fakes: Sequence[Any]) -> None:
        self.inputs: list[Callable[[], Any]] = []
        for value, fake in zip(example_inputs, fakes, strict=True):
            if isinstance(value, torch.Tensor) and value.numel() > self.SMALL and fake is not None:
                self.inputs.append(functools.partial(_alive_or, weakref.ref(value), fake))
            else:
                self.inputs.append(functools.partial(_itself, value))

    def get(self) -> list[Any]:
        return [value() for value in self.inputs]


def _itself(value: Any) -> Any:
    return value


def _alive_or(reference: weakref.ref, fake: Any) -> Any:
    value = reference()
    return fake if value is None else value


@dataclasses.dataclass(frozen=True)
class _ShapeEnvState:
    guards: int
    replacements: dict[Any, Any]
    ranges: dict[Any, Any]


def _shape_env_state(shape_env: Any) -> _ShapeEnvState:
    """What Dynamo reads from a ShapeEnv to build a frame's guards (internals, the same in 2.11 and 2.13)."""
    return _ShapeEnvState(len(shape_env.guards), dict(shape_env.replacements), dict(shape_env.var_to_range))


def _shape_env_of(context: Any) -> Any:
    """The ShapeEnv of a Dynamo ``TracingContext`` (None without one: nothing to compile lazily against)."""
    fake_mode = getattr(context, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


class HCPassesBackend:
    """A ``torch.compile`` backend object; ``reports`` holds one ``GraphReport`` per compiled graph."""

    def __init__(self, config: HCPassesConfig, passes: Sequence[GraphPass] | None = None) -> None:
        self.config = config
        self.passes = registry.pipeline() if passes is None else tuple(passes)
        self.reports: list[GraphReport] = []
        self.dispatchers: list[TokenDispatch] = []  # one per graph compiled in two variants
        self.manager = PassManager(config, self._add_report, self.passes)
        self.autograd_manager = PassManager(config, self._add_report, self.passes, autograd=True)
        self._unsharded_managers: dict[str, PassManager] = {}
        self._report_store = Path(tempfile.gettempdir()) / f"hcpasses_reports_{getpass.getuser()}"

    def unsharded_manager(self, sharding_pass: str) -> PassManager:
        """The pipeline of the variant for small T of a graph that pass ``sharding_pass`` sharded: the same passes,
        that one off (built once per pass, so that its uuid, and with it the cache keys, stay the same)."""
        if sharding_pass not in self._unsharded_managers:
            config = self.config.with_passes(**{sharding_pass: False})
            self._unsharded_managers[sharding_pass] = PassManager(config, self._add_report, self.passes)
        return self._unsharded_managers[sharding_pass]

    def _add_report(self, report: GraphReport) -> None:
        report.index = len(self.reports)
        self.reports.append(report)
        log.info("hcpasses report\n%s", report)

    def inductor_config(self, manager: PassManager, cudagraphs: bool = False) -> dict[str, Any]:
        patches: dict[str, Any] = {"post_grad_custom_pre_pass": manager, "triton.cudagraphs": cudagraphs}
        if self.config.dump_dir:
            patches["force_disable_caches"] = True  # a cache hit runs no pass and so writes no dump
        shaping = any(manager.config.pass_enabled(spec.name) for spec in registry.PASSES if "overlap" in spec.reads)
        if self.config.overlap and shaping and symmetric_memory_groups():
            # Inductor's async-TP pass (private config) fuses what the SP rewrite shaped (sp_rewrite.overlap):
            # on for this compile only; off where no group can fuse (CPU, gloo, one GPU), where it only warns.
            patches[MICRO_PIPELINE_TP] = True
        return patches

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if is_autograd_compile(gm, example_inputs):
            return self._compile(gm, example_inputs, self.autograd_manager, "autograd")[0]
        compiled, reports = self._compile(gm, example_inputs, self.manager, "only")
        sharding = next((record for r in reports for record in r.passes if record.sharded), None)
        if sharding is not None and sharding.sharded.symbolic:
            return self._dispatch_on_tokens(gm, example_inputs, compiled, reports, sharding.name, sharding.sharded)
        if self.config.cudagraphs and sharding is None:
            # Decode-size graphs: compile again with CUDA graphs (whether a pass shards is only known after
            # the passes ran, inside the first compile; on the same graph they shard nothing again).
            compiled, _ = self._compile(gm, example_inputs, self.manager, "cudagraphs", cudagraphs=True)
        return compiled

    def _dispatch_on_tokens(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        sharded: Callable[..., Any],
        reports: list[GraphReport],
        sharding_pass: str,
        decision: ShardedTokens,
    ) -> Callable[..., Any]:
        """With symbolic T the sharded graph is correct for every T; small T (decode) runs unsharded: the
        same graph compiled with ``sharding_pass`` off."""
        tokens = TokenCount.find(gm, str(decision.tokens))
        if tokens is None:
            fixed = fixed_token_count(gm, str(decision.tokens))
            if fixed is None:
                log.warning(
                    "hcpasses: cannot find the token count %s among the graph inputs; always sharded", decision.tokens
                )
                return sharded
            if fixed >= decision.min_tokens:
                return sharded
            # The sharded compile fixed T below the threshold: this graph (Dynamo guards it to that T) runs unsharded.
            log.info(
                "hcpasses: compiling the sharded graph fixed the token count %s to %d < sp_min_tokens=%d: the graph "
                "runs unsharded",
                decision.tokens,
                fixed,
                decision.min_tokens,
            )
        for report in reports:
            report.variant = "sharded"
        manager = self.unsharded_manager(sharding_pass)
        cudagraphs = self.config.cudagraphs
        context = torch._guards.TracingContext.try_get()
        unsharded: Callable[..., Any]
        fakes = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        lazy = self.config.lazy_variants and _shape_env_of(context) is not None and len(fakes) == len(example_inputs)
        if tokens is not None and lazy:
            inputs = LazyInputs(example_inputs, fakes)
            unsharded = LazyVariant(
                lambda: self._compile(gm, inputs.get(), manager, "unsharded", cudagraphs=cudagraphs)[0],
                sharded,
                context,
            )
        else:
            unsharded, _ = self._compile(gm, example_inputs, manager, "unsharded", cudagraphs=cudagraphs)
        if tokens is None:
            return unsharded
        dispatch = TokenDispatch(sharded, unsharded, tokens, decision.min_tokens)
        self.dispatchers.append(dispatch)
        return dispatch

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        manager: PassManager,
        variant: str,
        cudagraphs: bool = False,
    ) -> tuple[Callable[..., Any], list[GraphReport]]:
        seen = len(self.reports)
        key = self._report_key(gm, manager)
        config = self.inductor_config(manager, cudagraphs)
        compiled = compile_fx(gm, list(example_inputs), config_patches=config)
        if cudagraphs:
            compiled = OwnedOutputs(compiled)
        fresh = self.reports[seen:]
        if fresh:
            self._store_reports(key, fresh)
        else:
            self._reload_reports(key)
        reports = self.reports[seen:]
        for report in reports:
            report.variant = variant
        return compiled, reports

    def _report_key(self, gm: fx.GraphModule, manager: PassManager) -> str:
        # Source-location comments are left out: moving the model's code shifts them, not the graph.
        code = [line for line in gm.code.splitlines() if not line.strip().startswith("#")]
        # Dynamo's placeholders carry symbolic sizes where the real example inputs carry this call's.
        metas = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        text = "|".join([manager.uuid(), *code, *map(_input_signature, metas)])
        return hashlib.sha256(text.encode()).hexdigest()

    def _store_reports(self, key: str, reports: list[GraphReport]) -> None:
        self._report_store.mkdir(parents=True, exist_ok=True)
        lines = "\n".join(report.to_json() for report in reports)
        (self._report_store / f"{key}.jsonl").write_text(lines)

    def _reload_reports(self, key: str) -> None:
        path = self._report_store / f"{key}.jsonl"
        stored = [GraphReport.from_json(line) for line in path.read_text().splitlines()] if path.exists() else []
        if not stored:
            stored = [GraphReport(index=-1)]
        for report in stored:
            report.cached = True
            self._add_report(report)


def backend(**flags: Any) -> HCPassesBackend:
    """A backend object with these flags (see ``HCPassesConfig``); unknown flags raise ``ValueError``."""
    return HCPassesBackend(HCPassesConfig.resolve(**flags))


@functools.cache
def default_backend() -> HCPassesBackend:
    """The backend behind ``backend="hcpasses"``: default flags plus environment overrides."""
    return backend()


def compile_with_defaults(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Entry point of the ``torch_dynamo_backends`` group: ``torch.compile(m, backend="hcpasses")``."""
    return default_backend()(gm, example_inputs)

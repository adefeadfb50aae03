"""Virtual-rank simulator: run tp copies of a post-grad FX graph in one process.

Each virtual rank runs its own graph in a ``torch.fx.Interpreter`` on its own thread (torch ops release
the GIL). Every collective a rank issues is matched with the collectives the other ranks issued at the
same position in their order of issue (the k-th collective of every rank meet, as on a real process
group), checked for agreement, and computed once for all ranks:

- reductions are folded in rank order 0..tp-1 in the tensor's own dtype (``acc = acc + x_r``), the way
  a real backend adds two buffers; with two ranks this is bit-identical to gloo (two operands commute).
  With three or more ranks gloo's ring algorithm adds in an order that depends on the element's segment,
  so results can differ from a real gloo run by rounding (one rounding per addition);
- ``wait_tensor`` is the identity;
- a rank that never issues a collective the others wait on (it finished, or it is stuck) raises
  :class:`CollectiveTimeoutError` instead of hanging, as the real job would hang;
- an op of a collective namespace that the simulator does not know raises ``NotImplementedError``.

All collectives are assumed to run on one group spanning the ``tp`` virtual ranks (the group name is
not resolved): with a TP group inside a larger world (``capture.GroupLayout``) the virtual ranks are that
group's members, and tests check the group names the graphs carry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "collective_name",
    "is_collective",
    "reduce_in_rank_order",
    "simulate",
    "simulate_compiled",
]

# Op namespaces whose ops talk to other ranks. An op from one of these that has no handler below is
# rejected rather than run: running it for real would need a process group the simulator does not have.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "symm_mem", "_dtensor"}
)


class CollectiveMismatchError(RuntimeError):
    """Ranks met at the same collective position with different collectives, parameters or shapes."""


class CollectiveTimeoutError(TimeoutError):
    """A collective was not joined by every rank: on a real process group the job would hang."""


class _Aborted(Exception):
    """Raised in a rank's thread when another rank failed first; never escapes :func:`simulate`."""


# ---------------------------------------------------------------------------------------------------------
# Describing one rank's call of a collective
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Call:
    """One rank's issue of a collective: what it is, its tensors and the parameters that must agree."""

    rank: int
    node: str
    op: str  # qualified op name, e.g. "_c10d_functional::all_reduce"
    kind: str  # "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"
    tensors: list[torch.Tensor]
    params: tuple[Any, ...]  # must be equal on every rank (reduce op, group size, src)
    coalesced: bool = False  # the op takes and returns a list of tensors
    out: list[torch.Tensor] | None = None  # tensors written in place (in-place and out= variants)
    splits: tuple[list[int], list[int]] | None = None  # all_to_all: (output_split_sizes, input_split_sizes)

    def describe(self) -> str:
        """``op(params, shapes) at node 'name'`` for error messages."""
        shapes = ", ".join(f"{_dtype_name(t.dtype)}{list(t.shape)}" for t in self.tensors)
        params = ", ".join(repr(p) for p in self.params)
        return f"rank {self.rank}: {self.op}({params}; {shapes}) at node '{self.node}'"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """Positional argument ``index`` or keyword ``name`` of an op call."""
    if index < len(args):
        return args[index]
    if name in kwargs:
        return kwargs[name]
    raise TypeError(f"missing argument {name!r} (position {index})")


def _tensors_arg(args: Sequence[Any], kwargs: dict[str, Any], coalesced: bool) -> list[torch.Tensor]:
    """The input tensor (``input``), or the list of them for a coalesced op (``inputs``), as a list."""
    value = _arg(args, kwargs, 0, "inputs" if coalesced else "input")
    tensors = list(value) if coalesced else [value]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"expected tensors, got {[type(t).__name__ for t in tensors]}")
    return tensors


def _parse_all_reduce(
    args: Sequence[Any], kwargs: dict[str, Any], *, inplace: bool = False, coalesced: bool = False
) -> dict[str, Any]:
    tensors = _tensors_arg(args, kwargs, coalesced)
    params = (_arg(args, kwargs, 1, "reduce_op"),)
    out = tensors if inplace else None
    return dict(kind="all_reduce", tensors=tensors, params=params, coalesced=coalesced, out=out)


def _parse_reduce_scatter(
    args: Sequence[Any], kwargs: dict[str, Any], *, coalesced: bool = False, out: bool = False
) -> dict[str, Any]:
    tensors = _tensors_arg(args, kwargs, coalesced)
    params = (_arg(args, kwargs, 1, "reduce_op"), int(_arg(args, kwargs, 2, "group_size")))
    outs = [kwargs["out"]] if out else None
    return dict(kind="reduce_scatter", tensors=tensors, params=params, coalesced=coalesced, out=outs)


def _parse_all_gather(
    args: Sequence[Any], kwargs: dict[str, Any], *, coalesced: bool = False, out: bool = False
) -> dict[str, Any]:
    tensors = _tensors_arg(args, kwargs, coalesced)
    params = (int(_arg(args, kwargs, 1, "group_size")),)
    outs = [kwargs["out"]] if out else None
    return dict(kind="all_gather", tensors=tensors, params=params, coalesced=coalesced, out=outs)


def _parse_all_to_all(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    output_splits = [int(s) for s in _arg(args, kwargs, 1, "output_split_sizes")]
    input_splits = [int(s) for s in _arg(args, kwargs, 2, "input_split_sizes")]
    tensors = _tensors_arg(args, kwargs, False)
    return dict(kind="all_to_all", tensors=tensors, params=(), splits=(output_splits, input_splits))


def _parse_broadcast(args: Sequence[Any], kwargs: dict[str, Any], *, inplace: bool = False) -> dict[str, Any]:
    tensors = _tensors_arg(args, kwargs, False)
    params = (int(_arg(args, kwargs, 1, "src")),)
    return dict(kind="broadcast", tensors=tensors, params=params, out=tensors if inplace else None)


_Parser = Callable[[Sequence[Any], dict[str, Any]], dict[str, Any]]


def _parsers() -> dict[str, _Parser]:
    """Handlers by qualified op name (``namespace::name``); the autograd variants share the plain ones."""
    table: dict[str, _Parser] = {
        "all_reduce": _parse_all_reduce,
        "all_reduce_": partial(_parse_all_reduce, inplace=True),
        "all_reduce_coalesced": partial(_parse_all_reduce, coalesced=True),
        "all_reduce_coalesced_": partial(_parse_all_reduce, inplace=True, coalesced=True),
        "reduce_scatter_tensor": _parse_reduce_scatter,
        "reduce_scatter_tensor_out": partial(_parse_reduce_scatter, out=True),
        "reduce_scatter_tensor_coalesced": partial(_parse_reduce_scatter, coalesced=True),
        "all_gather_into_tensor": _parse_all_gather,
        "all_gather_into_tensor_out": partial(_parse_all_gather, out=True),
        "all_gather_into_tensor_coalesced": partial(_parse_all_gather, coalesced=True),
        "all_to_all_single": _parse_all_to_all,
        "broadcast": _parse_broadcast,
        "broadcast_": partial(_parse_broadcast, inplace=True),
    }
    parsers = {f"_c10d_functional::{name}": fn for name, fn in table.items()}
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        parsers[f"_c10d_functional_autograd::{name}"] = table[name]
    return parsers


_PARSERS = _parsers()
_WAIT_OPS = frozenset({"_c10d_functional::wait_tensor"})


def collective_name(target: Any) -> str | None:
    """``namespace::name`` of an op target (an ``OpOverload`` or ``OpOverloadPacket``), else None.

    Internal API: ``torch._ops.OpOverload`` / ``OpOverloadPacket`` are the types of ``torch.ops.ns.op``
    targets in FX graphs (same in 2.11 and 2.13; pinned by test_harness.py::test_internal_op_types_pinned).
    """
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).replace(".", "::", 1)
    return None


def is_collective(target: Any) -> bool:
    """Whether ``target`` is an op of a collective namespace (known to the simulator or not)."""
    name = collective_name(target)
    return name is not None and name.split("::", 1)[0] in COLLECTIVE_NAMESPACES


def _check_supported(gm: torch.fx.GraphModule, rank: int) -> None:
    """Raise ``NotImplementedError`` for an unknown collective, or any collective inside a subgraph."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_collective(node.target):
            continue
        name = collective_name(node.target)
        if name not in _PARSERS and name not in _WAIT_OPS:
            raise NotImplementedError(
                f"simulate: collective {name} at node '{node.name}' (rank {rank}) is not supported"
            )
    for path, sub in gm.named_modules():
        if path and isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                if node.op == "call_function" and is_collective(node.target):
                    raise NotImplementedError(
                        f"simulate: collective {collective_name(node.target)} at node '{node.name}' inside "
                        f"subgraph '{path}' (rank {rank}): collectives in higher-order op subgraphs are "
                        "not supported"
                    )


# ---------------------------------------------------------------------------------------------------------
# Computing a collective from every rank's call
# ---------------------------------------------------------------------------------------------------------


_REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,  # divided by the rank count after the sum
    "product": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def reduce_in_rank_order(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Fold ``tensors`` (rank 0 first) with reduce op ``op`` in their own dtype; ``avg`` divides the sum."""
    op = op.lower()
    if op not in _REDUCERS:
        raise NotImplementedError(f"simulate: reduce op {op!r} is not supported")
    combine = _REDUCERS[op]
    acc = tensors[0].clone()
    for tensor in tensors[1:]:
        acc = combine(acc, tensor)
    if op == "avg":
        rounding = None if acc.is_floating_point() or acc.is_complex() else "trunc"
        acc = torch.div(acc, len(tensors), rounding_mode=rounding).to(tensors[0].dtype)
    return acc


def _check_agreement(calls: Sequence[_Call], tp: int, index: int) -> None:
    """Raise :class:`CollectiveMismatchError` unless all calls are the same collective on compatible data."""
    first = calls[0]
    problems = []
    for call in calls[1:]:
        if call.kind != first.kind or call.params != first.params or call.coalesced != first.coalesced:
            problems.append("different collectives or parameters")
        elif len(call.tensors) != len(first.tensors):
            problems.append("different numbers of tensors")
        elif any(a.dtype != b.dtype for a, b in zip(call.tensors, first.tensors, strict=True)):
            problems.append("different dtypes")
        elif first.kind != "all_to_all" and any(
            a.shape != b.shape for a, b in zip(call.tensors, first.tensors, strict=True)
        ):
            problems.append("different shapes")
    if not problems:
        problems = _kind_problems(calls, tp)
    if problems:
        lines = "\n  ".join(call.describe() for call in calls)
        why = "; ".join(sorted(set(problems)))
        raise CollectiveMismatchError(f"collective #{index} does not match across ranks ({why}):\n  {lines}")


def _kind_problems(calls: Sequence[_Call], tp: int) -> list[str]:
    """Kind-specific checks: group size, divisibility, split sizes, broadcast source."""
    first = calls[0]
    if first.kind in ("reduce_scatter", "all_gather") and first.params[-1] != tp:
        return [f"group_size {first.params[-1]} != tp {tp}"]
    if first.kind == "reduce_scatter" and any(t.dim() == 0 or t.shape[0] % tp for t in first.tensors):
        return [f"dim 0 not divisible by tp {tp}"]
    if first.kind == "broadcast" and not 0 <= first.params[0] < tp:
        return [f"broadcast src {first.params[0]} outside [0, {tp})"]
    if first.kind == "all_to_all":
        return _all_to_all_problems(calls, tp)
    return []


def _all_to_all_problems(calls: Sequence[_Call], tp: int) -> list[str]:
    sends = [_input_splits(call, tp) for call in calls]
    if any(split is None for split in sends):
        return ["input split sizes do not fit the input"]
    if any(call.tensors[0].shape[1:] != calls[0].tensors[0].shape[1:] for call in calls):
        return ["different trailing shapes"]
    for call in calls:
        wanted = call.splits[0] if call.splits and call.splits[0] else None
        got = [sends[src][call.rank] for src in range(tp)]
        if wanted is not None and list(wanted) != got:
            return [f"rank {call.rank} expects output splits {list(wanted)} but receives {got}"]
    return []


def _input_splits(call: _Call, tp: int) -> list[int] | None:
    rows = call.tensors[0].shape[0] if call.tensors[0].dim() else 0
    splits = call.splits[1] if call.splits else []
    if not splits:
        return [rows // tp] * tp if rows % tp == 0 else None
    return list(splits) if len(splits) == tp and sum(splits) == rows else None


def _compute(calls: Sequence[_Call], tp: int) -> list[list[torch.Tensor]]:
    """Each rank's result tensors (one per input tensor) of an agreed collective."""
    first = calls[0]
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    for i in range(len(first.tensors)):
        inputs = [call.tensors[i] for call in calls]
        for rank, result in enumerate(_compute_one(first, inputs, calls, tp)):
            per_rank[rank].append(result)
    return per_rank


def _compute_one(first: _Call, inputs: list[torch.Tensor], calls: Sequence[_Call], tp: int) -> list:
    """Results by rank for one tensor position; every rank gets its own tensor."""
    if first.kind == "all_reduce":
        total = reduce_in_rank_order(inputs, first.params[0])
        return [total.clone() for _ in range(tp)]
    if first.kind == "reduce_scatter":
        total = reduce_in_rank_order(inputs, first.params[0])
        return [chunk.clone() for chunk in total.chunk(tp, dim=0)]
    if first.kind == "all_gather":
        gathered = torch.cat([t.reshape((1,) if t.dim() == 0 else t.shape) for t in inputs], dim=0)
        return [gathered.clone() for _ in range(tp)]
    if first.kind == "broadcast":
        return [inputs[first.params[0]].clone() for _ in range(tp)]
    if first.kind == "all_to_all":
        pieces = [t.split(_input_splits(call, tp), dim=0) for t, call in zip(inputs, calls, strict=True)]
        return [torch.cat([pieces[src][dst] for src in range(tp)], dim=0) for dst in range(tp)]
    raise AssertionError(f"unhandled collective kind {first.kind}")


# ---------------------------------------------------------------------------------------------------------
# Meeting point of the ranks
# ---------------------------------------------------------------------------------------------------------


class _Hub:
    """Where the ranks' k-th collectives meet; detects missing ranks, mismatches and failures."""

    def __init__(self, tp: int, deadline: float, timeout_s: float) -> None:
        self.tp = tp
        self.deadline = deadline
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._issued = [0] * tp
        self._slots: dict[int, dict[int, _Call]] = {}
        self._results: dict[int, list[list[torch.Tensor]] | BaseException] = {}
        self._finished: set[int] = set()
        self._abort = False
        self._waiting: dict[int, int] = {}  # rank -> collective index it waits on

    def exchange(self, call: _Call) -> list[torch.Tensor]:
        """Join collective number k of ``call.rank``; block until every rank joined; return its results."""
        with self._cond:
            index = self._issued[call.rank]
            self._issued[call.rank] += 1
            slot = self._slots.setdefault(index, {})
            slot[call.rank] = call
            if len(slot) == self.tp:
                self._complete(index, [slot[r] for r in range(self.tp)])
            self._waiting[call.rank] = index
            try:
                result = self._wait_for(index)
            finally:
                del self._waiting[call.rank]
        if isinstance(result, BaseException):
            raise result
        return result[call.rank]

    def _complete(self, index: int, calls: list[_Call]) -> None:
        try:
            _check_agreement(calls, self.tp, index)
            self._results[index] = _compute(calls, self.tp)
        except Exception as err:  # every rank of this collective raises the same error
            self._results[index] = err
        del self._slots[index]
        self._cond.notify_all()

    def _wait_for(self, index: int) -> list[list[torch.Tensor]] | BaseException:
        while index not in self._results:
            if self._abort:
                raise _Aborted
            gone = sorted(r for r in self._finished if self._issued[r] <= index)
            if gone:
                raise CollectiveTimeoutError(self._missing_message(index, gone))
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(self._missing_message(index, []))
            self._cond.wait(min(remaining, 1.0))
        return self._results[index]

    def _missing_message(self, index: int, finished: list[int]) -> str:
        joined = self._slots.get(index, {})
        first = next(iter(joined.values()), None)
        what = f"{first.op} at node '{first.node}'" if first else "collective"
        missing = [r for r in range(self.tp) if r not in joined]
        if finished:
            counts = [self._issued[r] for r in finished]
            why = f"rank(s) {finished} finished after issuing {counts} collective(s)"
        else:
            why = f"not joined within {self.timeout_s:g} s"
        return (
            f"collective #{index} ({what}) joined by ranks {sorted(joined)} but never by {missing}: {why}; "
            "a real process group would hang here"
        )

    def waiting_on(self, rank: int) -> int | None:
        """The collective index ``rank`` is blocked on, or None."""
        with self._cond:
            return self._waiting.get(rank)

    def finish(self, rank: int) -> None:
        """Rank ``rank`` returned from its graph: waiters on collectives it never issued must fail."""
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()

    def abort(self) -> None:
        """Release every waiting rank (another rank failed, or the deadline passed)."""
        with self._cond:
            self._abort = True
            self._cond.notify_all()


# ---------------------------------------------------------------------------------------------------------
# Per-rank interpreters
# ---------------------------------------------------------------------------------------------------------


def _run_collective(hub: _Hub, rank: int, where: str, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """One rank's collective ``name`` (a wait or a known collective): exchanged through the hub."""
    if name in _WAIT_OPS:
        return args[0] if args else kwargs["tensor"]
    call = _Call(rank=rank, node=where, op=name, **_PARSERS[name](args, kwargs))
    results = hub.exchange(call)
    if call.out is not None:
        for dst, src in zip(call.out, results, strict=True):
            dst.copy_(src)
        results = call.out
    return results if call.coalesced else results[0]


class _RankInterpreter(torch.fx.Interpreter):
    """``fx.Interpreter`` that sends collectives to the hub and treats ``wait_tensor`` as the identity."""

    def __init__(self, gm: torch.fx.GraphModule, rank: int, hub: _Hub) -> None:
        super().__init__(gm)
        self.rank = rank
        self.hub = hub
        self.node_name = ""

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node_name = n.name
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = collective_name(target)
        if name not in _PARSERS and name not in _WAIT_OPS:
            return super().call_function(target, args, kwargs)
        return _run_collective(self.hub, self.rank, self.node_name, name, args, kwargs)

    def __call__(self, *inputs: Any) -> Any:
        return self.run(*inputs)


class _HubMode(TorchDispatchMode):
    """Routes the collectives that compiled code issues (through the dispatcher) to the hub.

    Inductor's generated code calls collectives as ``torch.ops._c10d_functional.*`` ops; every other op
    runs as it is. Dispatch modes are thread-local, so each virtual rank's thread has its own.
    """

    def __init__(self, rank: int, hub: _Hub) -> None:
        super().__init__()
        self.rank, self.hub, self.issued = rank, hub, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = collective_name(func)
        if name in _PARSERS or name in _WAIT_OPS:
            self.issued += name in _PARSERS
            return _run_collective(self.hub, self.rank, f"compiled collective #{self.issued}", name, args, kwargs or {})
        if is_collective(func):
            raise NotImplementedError(
                f"simulate: collective {name} in compiled code (rank {self.rank}) is not supported"
            )
        return func(*args, **(kwargs or {}))


class _CompiledRank:
    """One rank's compiled callable, run with its collectives resolved through the hub."""

    def __init__(self, fn: Callable[..., Any], rank: int, hub: _Hub) -> None:
        self.fn, self.rank, self.hub = fn, rank, hub

    def __call__(self, *inputs: Any) -> Any:
        with _HubMode(self.rank, self.hub):
            return self.fn(*inputs)


@dataclass
class _Outcome:
    outputs: list[Any] | None = None
    error: BaseException | None = None
    done: bool = False


def _flatten(value: Any) -> list[Any]:
    """Leaves of nested tuples/lists/dicts, in order."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


def _run_rank(runner: _RankInterpreter | _CompiledRank, inputs: Sequence[Any], outcome: _Outcome) -> None:
    """Thread body: run one rank's graph without grad; record its outputs or its error."""
    try:
        with torch.no_grad():
            outcome.outputs = _flatten(runner(*inputs))
    except BaseException as err:  # reported by simulate
        outcome.error = err
        runner.hub.abort()
    finally:
        outcome.done = True
        runner.hub.finish(runner.rank)


def _first_error(outcomes: Sequence[_Outcome]) -> tuple[int, BaseException] | None:
    """The lowest rank's error that is not an abort; collective timeouts lose to primary errors."""
    errors = [(r, o.error) for r, o in enumerate(outcomes) if o.error is not None]
    errors = [(r, e) for r, e in errors if not isinstance(e, _Aborted)]
    primary = [(r, e) for r, e in errors if not isinstance(e, CollectiveTimeoutError)]
    chosen = primary or errors
    return chosen[0] if chosen else None


def simulate(
    graphs: Sequence[torch.fx.GraphModule],
    inputs: Sequence[Sequence[Any]],
    timeout_s: float = 60,
) -> list[list[Any]]:
    """Run ``graphs[r]`` on ``inputs[r]`` for every virtual rank r; return each rank's flattened outputs.

    ``len(graphs)`` is the tensor-parallel size. ``inputs[r]`` are the placeholder values in order
    (ints for SymInt placeholders); ranks run concurrently, so a tensor that a graph mutates in place
    must not be shared between ranks' inputs. Graphs run without autograd.

    Raises :class:`CollectiveMismatchError`, :class:`CollectiveTimeoutError` (also when ``timeout_s``
    passes), ``NotImplementedError`` (an unknown collective or reduce op), or the first error a rank
    raised (with a note naming the rank).
    """
    for rank, gm in enumerate(graphs):
        _check_supported(gm, rank)
    return _simulate_runners(graphs, inputs, timeout_s, _RankInterpreter)


def simulate_compiled(
    compiled: Sequence[Callable[..., Any]],
    inputs: Sequence[Sequence[Any]],
    timeout_s: float = 120,
) -> list[list[Any]]:
    """Like :func:`simulate`, but each rank runs Inductor's generated code for its graph (``compiled[r]``).

    The collectives the generated code issues go through the dispatcher; a per-thread dispatch mode sends
    them to the same meeting point as :func:`simulate`, with the same rank-order reductions, so the
    generated code of a rewritten graph is checked, not only its FX graph.
    """
    return _simulate_runners(compiled, inputs, timeout_s, _CompiledRank)


def _simulate_runners(
    programs: Sequence[Any],
    inputs: Sequence[Sequence[Any]],
    timeout_s: float,
    runner: Callable[[Any, int, _Hub], _RankInterpreter | _CompiledRank],
) -> list[list[Any]]:
    tp = len(programs)
    if tp < 1 or len(inputs) != tp:
        raise ValueError(f"need one input list per graph, got {tp} graphs and {len(inputs)} input lists")
    deadline = time.monotonic() + timeout_s
    hub = _Hub(tp, deadline, timeout_s)
    outcomes = [_Outcome() for _ in range(tp)]
    threads = [
        threading.Thread(
            target=_run_rank,
            args=(runner(program, rank, hub), list(inputs[rank]), outcomes[rank]),
            name=f"virtual-rank-{rank}",
            daemon=True,  # a rank stuck in compute must not keep the process alive
        )
        for rank, program in enumerate(programs)
    ]
    for thread in threads:
        thread.start()
    _join(threads, deadline)
    return _collect(outcomes, hub, timeout_s)


def _join(threads: Sequence[threading.Thread], deadline: float) -> None:
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _collect(outcomes: Sequence[_Outcome], hub: _Hub, timeout_s: float) -> list[list[Any]]:
    """Raise the run's error, if any, else return the outputs by rank."""
    stuck = [r for r, o in enumerate(outcomes) if not o.done]
    failure = _first_error(outcomes)
    if failure is not None and not isinstance(failure[1], CollectiveTimeoutError):
        hub.abort()
        rank, err = failure
        if hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note(f"(raised on virtual rank {rank} of {len(outcomes)})")
        raise err
    if stuck:
        hub.abort()
        waits = {r: hub.waiting_on(r) for r in stuck}
        detail = ", ".join(
            f"rank {r} " + (f"waits on collective #{k}" if k is not None else "is still computing")
            for r, k in waits.items()
        )
        cause = f"; {failure[1]}" if failure is not None else ""
        raise CollectiveTimeoutError(f"simulate: ranks not done after {timeout_s:g} s ({detail}){cause}")
    if failure is not None:
        raise failure[1]
    return [list(o.outputs or []) for o in outcomes]

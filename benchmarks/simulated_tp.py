"""Simulated tensor parallelism: one process on one device plays rank r of a TP group of size N (DESIGN §11).

    with simulated_tp(tp=4, rank=0) as ledger:       # fake process group + collectives with real values
        out = torch.compile(model, backend=be)(ids)  # the passes see a group of size 4, this process is rank 0
    comm_ms = CommModel().ms(ledger.calls)           # what the collectives of that forward would cost on NVLink

Per-rank compute at any tp is measurable on one GPU this way, and it is most of what SP changes: on a ring,
a reduce-scatter plus an all-gather move the bytes of the all-reduce they replace. The logits are not those of
a real TP run (every rank's partial sums are taken to be this rank's), but every tensor holds real, finite
values of the right shape, so MoE routing, norms and FP8 scales see realistic inputs.

Mechanism, the least internal one found (both torch 2.11 and 2.13):

- The process group: torch's ``fake`` backend, ``dist.init_process_group("fake", store=FakeStore(), ...)``;
  ``FakeStore`` is in ``torch.testing._internal.distributed.fake_pg`` (internal; importing that module also
  registers the backend). Its collectives do no work and leave their outputs uninitialised.
- The values: ``torch.ops._c10d_functional``'s collectives (every collective API lowers to them under
  Dynamo, and Inductor's generated code calls them as extern kernels) have one kernel each, registered for
  ``CompositeExplicitAutograd``. :func:`simulated_collectives` registers Python kernels for the ``CPU`` and
  ``CUDA`` dispatch keys through the public ``torch.library.Library(..., "IMPL")``; a backend key's kernel
  takes precedence over the alias key's, so these run in eager and in compiled code alike, and the fake /
  meta kernels Dynamo traces with are untouched. Leaving the context destroys the library, which removes the
  kernels (``tests/test_simulated_tp.py`` pins that the keys start empty and end empty).

Stand-ins (N = the op's group size, r = the simulated rank): all-gather = N copies of the local shard stacked
along dim 0; reduce-scatter = rank r's block (rows ``r*L:(r+1)*L``) of the input; all-reduce = identity;
``wait_tensor`` = identity. Each call is recorded in a :class:`CommLedger` (op, bytes of the full-size tensor,
group size), which the :class:`CommModel` turns into milliseconds.

The stand-ins' copies are communication, not the rank's compute: each runs inside a profiler range named
``simulated_tp::<kind>``, and :func:`standin_ms` sums what a profile spent in them, so that a benchmark can report
compute without them (the comm model prices the collectives instead). Without that, SP is charged for its
gathers' copies while SP off's in-place all-reduce costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

NAMESPACE = "_c10d_functional"
STANDIN_RANGE = "simulated_tp::"  # profiler ranges of the stand-ins: communication, not compute
DISPATCH_KEYS = ("CPU", "CUDA")

# H200 NVLink 4: 18 links, 900 GB/s per GPU bidirectional (NVIDIA H200 product brief), so 450 GB/s each way;
# a ring collective sends and receives at once, so one direction's bandwidth sets its time. Measured NCCL on
# 2x H200 (DESIGN §10, [16384, 2560] bf16) reached 160-230 GB/s of ring bytes: pass ``link_gbps`` to model that.
NVLINK_GBPS_PER_DIRECTION = 450.0


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as a rank sees it: ``kind`` (all_reduce / all_gather / reduce_scatter), the bytes of the
    full-size tensor (an all-reduce's tensor, an all-gather's output, a reduce-scatter's input), the group size."""

    kind: str
    full_bytes: int
    group_size: int


@dataclass
class CommLedger:
    """The collectives the stand-ins ran, in order; ``clear()`` between measured forwards."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def record(self, kind: str, full: torch.Tensor | int, group_size: int) -> None:
        nbytes = full if isinstance(full, int) else full.numel() * full.element_size()
        self.calls.append(CollectiveCall(kind, nbytes, group_size))

    def clear(self) -> None:
        self.calls.clear()

    def counts(self) -> dict[str, int]:
        """Calls per kind."""
        return dict(Counter(call.kind for call in self.calls))

    def bytes_by_kind(self) -> dict[str, int]:
        """Full-size bytes per kind."""
        totals: Counter[str] = Counter()
        for call in self.calls:
            totals[call.kind] += call.full_bytes
        return dict(totals)


# Bytes each rank sends, as a fraction of the full-size tensor, for the ring algorithm on N ranks.
RING_FRACTION = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class CommModel:
    """Ring collectives at ``link_gbps`` (GB/s each way per GPU), plus ``latency_us`` per call."""

    link_gbps: float = NVLINK_GBPS_PER_DIRECTION
    latency_us: float = 0.0

    def wire_bytes(self, call: CollectiveCall) -> float:
        """Bytes one rank sends for ``call`` (0 for a group of one)."""
        return RING_FRACTION[call.kind](call.group_size) * call.full_bytes

    def call_ms(self, call: CollectiveCall) -> float:
        if call.group_size == 1:
            return 0.0
        return self.wire_bytes(call) / (self.link_gbps * 1e9) * 1e3 + self.latency_us / 1e3

    def ms(self, calls: Sequence[CollectiveCall]) -> float:
        """Time of ``calls`` one after another, none overlapped with compute."""
        return sum(self.call_ms(call) for call in calls)

    def estimate(self, compute_ms: float, calls: Sequence[CollectiveCall]) -> dict[str, float]:
        """End-to-end estimate beside measured compute: serial (no overlap) and the overlap bound."""
        comm = self.ms(calls)
        return {
            "compute_ms": compute_ms,
            "comm_ms": comm,
            "serial_ms": compute_ms + comm,
            "overlap_ms": max(compute_ms, comm),
        }


# ------------------------------------------------------------------------------------------------ stand-ins


def _gathered(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.cat([tensor] * group_size)


def _block(tensor: torch.Tensor, group_size: int, rank: int) -> torch.Tensor:
    rows = tensor.shape[0] // group_size
    return tensor[rank * rows : (rank + 1) * rows]


def _kernels(rank: int, ledger: CommLedger) -> dict[str, object]:
    """Python kernels for the ``_c10d_functional`` ops, by op name; each but ``wait_tensor`` in its profiler range."""

    def all_gather(tensor: torch.Tensor, group_size: int, group_name: object) -> torch.Tensor:
        out = _gathered(tensor, group_size)
        ledger.record("all_gather", out, group_size)
        return out

    def all_gather_out(tensor: torch.Tensor, group_size: int, group_name: object, *, out: torch.Tensor) -> torch.Tensor:
        ledger.record("all_gather", out, group_size)
        return out.copy_(_gathered(tensor, group_size))

    def reduce_scatter(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: object) -> torch.Tensor:
        ledger.record("reduce_scatter", tensor, group_size)
        return _block(tensor, group_size, rank).clone()

    def reduce_scatter_out(
        tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: object, *, out: torch.Tensor
    ) -> torch.Tensor:
        ledger.record("reduce_scatter", tensor, group_size)
        return out.copy_(_block(tensor, group_size, rank))

    def all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: object) -> torch.Tensor:
        ledger.record("all_reduce", tensor, _group_size(group_name))
        return tensor.clone()

    def all_reduce_(tensor: torch.Tensor, reduce_op: str, group_name: object) -> torch.Tensor:
        ledger.record("all_reduce", tensor, _group_size(group_name))
        return tensor

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    kernels = {
        "all_gather_into_tensor": all_gather,
        "all_gather_into_tensor_out": all_gather_out,
        "reduce_scatter_tensor": reduce_scatter,
        "reduce_scatter_tensor_out": reduce_scatter_out,
        "all_reduce": all_reduce,
        "all_reduce_": all_reduce_,
    }
    return {name: _in_range(name, kernel) for name, kernel in kernels.items()} | {"wait_tensor": wait_tensor}


def _in_range(name: str, kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``kernel`` run inside the profiler range ``simulated_tp::<name>``."""

    @functools.wraps(kernel)
    def ranged(*args: object, **kwargs: object) -> torch.Tensor:
        with torch.profiler.record_function(f"{STANDIN_RANGE}{name}"):
            return kernel(*args, **kwargs)

    return ranged


def standin_ms(events: Iterable[Any], on_gpu: bool) -> float:
    """Milliseconds a profile's ``events`` (``prof.events()``) spent in the stand-ins: the device time of the
    kernels launched inside their ranges (``on_gpu``), else the CPU time of the ops inside them (the range's total
    less its own: what a CPU profile's op self times, the CPU's "kernel time", count of them; the Python of the
    stand-in around its ops is in no op's self time, and subtracting it made compute negative)."""
    ranges = [event for event in events if event.name.startswith(STANDIN_RANGE)]
    own = (event.device_time_total if on_gpu else event.cpu_time_total - event.self_cpu_time_total for event in ranges)
    return sum(own) / 1e3


def _group_size(group_name: object) -> int:
    """The size of the group an all-reduce names (its schema has no group size): the default group's."""
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def simulated_collectives(rank: int, ledger: CommLedger | None = None) -> Iterator[CommLedger]:
    """Within the context, the ``_c10d_functional`` collectives on CPU and CUDA run the stand-ins for ``rank``.

    Yields the ledger the calls are recorded in. On exit the kernels are removed again.
    """
    ledger = CommLedger() if ledger is None else ledger
    library = torch.library.Library(NAMESPACE, "IMPL")
    try:
        for name, kernel in _kernels(rank, ledger).items():
            for key in DISPATCH_KEYS:
                library.impl(name, kernel, key)
        yield ledger
    finally:
        library._destroy()


@contextlib.contextmanager
def fake_group(tp: int, rank: int) -> Iterator[None]:
    """The default process group as torch's ``fake`` backend, size ``tp``, this process rank ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the backend on torch 2.11

    if dist.is_initialized():
        raise RuntimeError("simulated TP needs the default process group free; one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def simulated_tp(tp: int, rank: int = 0) -> Iterator[CommLedger]:
    """Rank ``rank`` of a simulated TP group of ``tp``: a fake default group and the stand-in collectives.

    ``tp == 1`` sets up nothing (models and passes run unsharded without a group) and yields an empty ledger.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in a group of {tp}")
    if tp == 1:
        yield CommLedger()
        return
    with fake_group(tp, rank), simulated_collectives(rank) as ledger:
        yield ledger

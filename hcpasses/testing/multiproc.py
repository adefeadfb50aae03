"""Run a function on several ranks, one process each, with a deadline.

Used by the demo (2 gloo processes on CPU, NCCL when enough GPUs are present) and by the tests.
A rank that hangs (a collective that one rank never joins) fails the call after ``timeout_s``
instead of blocking forever. ``torch.multiprocessing.spawn`` has no deadline, so this module
starts the processes itself.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish before the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled here, by value: torch's queue would pass tensors through shared memory that
        # vanishes when this process exits before the parent reads it.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). The process group is
    initialised before ``fn`` runs and destroyed after. Raises :class:`RankFailure` naming the
    rank and its traceback if any rank raises, dies or misses the deadline; all ranks are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, backend, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        _collect(results, procs, collected, world_size, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return [collected[rank] for rank in range(world_size)]


def _collect(
    results: Any,
    procs: list[Any],
    collected: dict[int, Any],
    world_size: int,
    timeout_s: float,
) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while len(collected) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(collected))
            raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in collected and p.exitcode not in (None, 0)]
            if dead:
                raise RankFailure(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}") from None
            continue
        if not ok:
            raise RankFailure(f"rank {rank} raised:\n{value}")
        collected[rank] = pickle.loads(value)

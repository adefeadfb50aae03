"""MTP drafter benchmark, TP over one process per GPU: one-graph prefill, and draft-step latency (issues #5, #25).

Run from the repository root (NCCL on GPUs; ``--device cpu --tiny`` checks the plumbing over gloo)::

    PYTHONPATH=. python benchmarks/mtp_draft.py --tp 2
    PYTHONPATH=. python benchmarks/mtp_draft.py --device cpu --tiny

Models: ``HCDecoder(HCConfig.real())`` (S 2560, n 4, r 320, 16 heads x 256, 2 kv heads, SwiGLU 5632,
``--layers`` layers (4), PLE in layer ``--ple-layer`` (1; -1: none), bf16) and its ``MTPDrafter`` (shared
embedding and lm_head); ``--tiny``: ``HCConfig.tiny``, fp32.

(a) Prefill of T prompt tokens, each point compiled with static shapes:

- ``fused``: ``prefill_target_and_drafter`` compiled as one function with ``hcpasses.backend(sp_min_tokens=...)``:
  the target's HC state can stay row-sharded into the drafter;
- ``separate``: the target (``return_hc_state=True``) and the drafter compiled apart with the same flags:
  the state is gathered at the target's exit and sharded again inside the drafter's graph.

  ``ratio`` = separate / fused time (above 1: the one graph is faster). Each variant's SP status and facts
  (``streams_gathered``, ``entries_sharded``) are recorded, and fused vs separate's largest output difference.

(b) Draft step on B rows for B in ``--batches``, two calls (``--draft-calls``):

- ``step``: ``MTPDrafter.step`` (B consecutive positions, ``[T, n*S]`` state) after a KV cache of ``--context``
  tokens; each call reads the same cache;
- ``forward``: ``MTPDrafter.forward`` on a ``[B, n, S]`` state, no KV cache (one new position per sequence, its
  cache left out).

Each as ``eager``; ``compiled`` (``hcpasses.backend(sp_min_tokens=...)``); ``cudagraphs`` (the same with
``cudagraphs=True``). Compiled variants use dynamic shapes (one graph for every B >= 2, one for B = 1).

Timing (``benchmarks/prefill_sp.py``'s helpers): per rank, CUDA events (host clock on CPU) around each call
after a sync and a barrier; warm-up calls first (the first compiles, reported apart); the median per rank,
and the slowest rank's median is the point's time. Outputs are compared with eager (largest difference
relative to eager's largest magnitude). The bf16 GEMM and copy ceilings are measured in the same run.

Merged from ``benchmarks/mtp_tp.py`` (issue #25; deleted, last at commit 3075f19), which measured the
``forward`` draft call and the prefill's SP facts. Where both measured the same thing this script's method is
kept: ids and states drawn the same on every rank (mtp_tp drew them per rank from the device's generator),
5 warm-up and 30 timed calls (mtp_tp: 3 and 10), outputs checked against eager (mtp_tp compared fused with
separate only; kept as ``fused_vs_separate_max_abs_diff``), the first call's compile time reported, and no
``clone`` of the inputs inside the timed call (mtp_tp cloned them in every call). mtp_tp's run used
``--layers 2 --ple-layer -1 --prefill-tokens 16384,32768 --draft-calls forward``.

CUDA graphs with NCCL collectives (issue #25 item 2). At TP 2 the ``cudagraphs`` step hung before its first
result (``results/mtp_draft_tp2.log``), and mtp_tp's runs, whose ``forward`` graphs were captured, hung at
process teardown. Believed, not shown (no 2-GPU run since): NCCL requires that a collective be captured, or
launched eagerly, on every rank alike (NVIDIA, "Using NCCL with CUDA Graphs"), and torch's graph capture begins
by waiting, with no deadline, until the NCCL watchdog has cleaned every earlier eager collective
(``CUDAGraph::capture_begin``, "Waiting for pending NCCL work to finish before starting graph capture";
pytorch PRs #103503 and #104487); the step's eager reference ran its all-reduces right before the compiled
calls, unsynchronised, and Inductor's cudagraph trees (``torch/_inductor/cudagraph_trees.py``) warm up on a
shape's first call and record (then replay) on a later one, so a rank that reaches a capture while
collectives are still in flight, or records where the other runs eagerly, can wait forever. The teardown hang
matches pytorch issue #115388 (``destroy_process_group`` hangs after graphs that captured NCCL work).
The fix, on by default (``--no-capture-guard`` runs without it): every eager reference is computed before any
compile; then, before timing, every rank makes each batch size's first calls (trees' warm-up, record, replay)
in the same order, largest batch first (vLLM's order: ``vllm/v1/worker/gpu_model_runner.py`` captures the
``reversed`` batch sizes), with a device sync and a barrier before and after each, so no NCCL work is pending
when a capture begins and all ranks capture the same graph at the same point; afterwards the graphs are
freed (``torch._dynamo.reset`` resets the trees) before the next variant and before teardown. The trees
already capture on their own side stream (as vLLM's ``graph_capture`` context does), so the guard adds none.
``TORCH_NCCL_BLOCKING_WAIT=1`` is refused: with it the capture's wait for pending work has been reported to
deadlock. Untested on 2 GPUs (none lent); ``tests/test_mtp_cudagraph_tp2.py`` captures and replays a TP 2
decode step where two GPUs are present.

Writes ``mtp_draft_tp{tp}.json`` (``smoke_`` prefixed for ``--tiny``) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hcpasses
from benchmarks.prefill_sp import log, measure_ceilings, time_calls
from hcpasses.testing.models import HCConfig, HCDecoder, MTPDrafter, prefill_target_and_drafter
from hcpasses.testing.multiproc import run_ranks

DEFAULT_PREFILL = "1024,4096,16384"
DEFAULT_BATCHES = "1,2,4,8,16,32"
DRAFT_VARIANTS = ("eager", "compiled", "cudagraphs")
DRAFT_CALLS = ("step", "forward")
# Inductor's cudagraph trees run a shape's first call eagerly (warm-up) and record, then replay, on the next;
# the third call is the first plain replay.
CAPTURE_CALLS = 3


@dataclass(frozen=True)
class Settings:
    """Everything a rank needs (picklable)."""

    tp: int
    device_type: str
    tiny: bool
    layers: int
    ple_layer: int | None
    prefill_tokens: tuple[int, ...]
    batches: tuple[int, ...]
    draft_calls: tuple[str, ...]
    capture_guard: bool
    context: int
    warmup: int
    repeats: int
    sp_min_tokens: int

    def config(self) -> HCConfig:
        """Real sizes in bf16, or the tiny fp32 model."""
        if self.tiny:
            return HCConfig.tiny(n_layers=self.layers, ple_layer=self.ple_layer, seed=5)
        return HCConfig.real(n_layers=self.layers, ple_layer=self.ple_layer)

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


def random_ids(cfg: HCConfig, n_tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    """Token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (n_tokens,), generator=gen).to(device)


def random_rows(rows: int, width: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, width]`` normal tensor, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(device, dtype)


def rel_diff(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """Largest ``|got - expected|`` over the outputs, relative to expected's largest magnitude."""
    pairs = zip(got, expected, strict=True)
    return max(float((g.float() - e.float()).abs().max()) / float(e.float().abs().max()) for g, e in pairs)


def timed(call: Callable[[], Any], settings: Settings, device: torch.device) -> dict[str, Any]:
    """First call (compiles), warm-up, then the timed calls; returns times and the first call's outputs."""
    began = time.perf_counter()
    # Copied: a CUDA-graph replay overwrites the outputs of the calls before it.
    outputs = [t.clone() for t in call()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - began
    for _ in range(settings.warmup):
        call()
    times = time_calls(lambda _: call(), settings.repeats, device)
    return {"first_call_s": first_s, "median_ms": statistics.median(times), "times_ms": times, "outputs": outputs}


def sp_statuses(be: hcpasses.HCPassesBackend, seen: int) -> list[str]:
    """The SP rewrite's status in each graph compiled since ``seen``, with the variant and any reason."""
    records = [(report.variant, report.record("sp_rewrite")) for report in be.reports[seen:]]
    return [f"{variant}: {r.status}" + (f" ({r.reason})" if r.reason else "") for variant, r in records]


def sp_facts(be: hcpasses.HCPassesBackend, seen: int) -> list[dict[str, Any]]:
    """The SP rewrite's facts (what it gathered and sharded) in each graph compiled since ``seen``."""
    return [dict(report.record("sp_rewrite").facts) for report in be.reports[seen:]]


def settle(device: torch.device) -> None:
    """Device idle and ranks aligned: nothing of this rank's NCCL work is in flight when the next call begins."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


# ------------------------------------------------------------------------------------------------ prefill


def run_prefill(settings: Settings, models: tuple[HCDecoder, MTPDrafter], rank: int, device: torch.device) -> dict:
    """Fused and separate prefill at every point: times, SP statuses, differences from eager."""
    results = {}
    for tokens in settings.prefill_tokens:
        results[str(tokens)] = point = prefill_point(settings, models, tokens, device)
        fused_ms, separate_ms = point["fused"]["median_ms"], point["separate"]["median_ms"]
        log(rank, f"prefill T={tokens}: fused {fused_ms:.3f} ms, separate {separate_ms:.3f} ms")
    return results


def prefill_point(
    settings: Settings, models: tuple[HCDecoder, MTPDrafter], tokens: int, device: torch.device
) -> dict[str, Any]:
    """Both prefill variants on T tokens, each compiled from a fresh Dynamo state with static shapes."""
    target, drafter = models
    ids = random_ids(target.cfg, tokens, seed=tokens, device=device)
    next_ids = torch.roll(ids, -1)
    eager = prefill_target_and_drafter(target, drafter, ids, next_ids)
    torch._dynamo.reset()
    be = hcpasses.backend(sp_min_tokens=settings.sp_min_tokens)
    fused_fn = torch.compile(prefill_target_and_drafter, backend=be)
    fused = timed(lambda: fused_fn(target, drafter, ids, next_ids), settings, device)
    fused_sp, fused_facts = sp_statuses(be, 0), sp_facts(be, 0)
    seen = len(be.reports)
    target_fn = torch.compile(lambda i: target(i, return_hc_state=True), backend=be)
    drafter_fn = torch.compile(drafter, backend=be)

    def separate_call() -> tuple[torch.Tensor, ...]:
        logits, state = target_fn(ids)
        return (logits, *drafter_fn(state, next_ids))

    separate = timed(separate_call, settings, device)
    apart = max(float((f - s).abs().max()) for f, s in zip(fused["outputs"], separate["outputs"], strict=True))
    return {
        "fused": {**summary(fused, eager, fused_sp), "sp_facts": fused_facts},
        "separate": {**summary(separate, eager, sp_statuses(be, seen)), "sp_facts": sp_facts(be, seen)},
        "fused_vs_separate_max_abs_diff": apart,
    }


def summary(result: dict[str, Any], eager: Sequence[torch.Tensor] | None, sp: list[str] | None) -> dict[str, Any]:
    """A timed result without its outputs: their difference from eager instead, and the SP statuses."""
    row = {k: v for k, v in result.items() if k != "outputs"}
    if eager is not None:
        row["rel_diff_vs_eager"] = rel_diff(result["outputs"][:2], eager[:2])
    if sp is not None:
        row["sp"] = sp
    return row


# ------------------------------------------------------------------------------------------------- draft


def draft_cache(drafter: MTPDrafter, settings: Settings, device: torch.device) -> Any:
    """The drafter's KV cache after ``--context`` positions (eager, random states)."""
    cfg = drafter.cfg
    state = random_rows(settings.context, cfg.streams_width, seed=1, device=device, dtype=cfg.dtype)
    _, _, cache = drafter.step(state, random_ids(cfg, settings.context, seed=2, device=device), drafter.empty_cache())
    return cache


def draft_function(drafter: MTPDrafter, call: str) -> Callable[..., Any]:
    """The drafter's ``step`` (with the KV cache) or its ``forward`` (without)."""
    return drafter.step if call == "step" else drafter


def draft_inputs(drafter: MTPDrafter, call: str, batch: int, cache: Any, device: torch.device) -> tuple[Any, ...]:
    """``call``'s arguments on ``batch`` rows: a ``[B, n*S]`` state and the cache, or a ``[B, n, S]`` state."""
    cfg = drafter.cfg
    state = random_rows(batch, cfg.streams_width, seed=batch, device=device, dtype=cfg.dtype)
    ids = random_ids(cfg, batch, seed=batch, device=device)
    if call == "step":
        return state, ids, cache
    return state.view(batch, cfg.n_streams, cfg.hidden), ids


def run_draft(settings: Settings, drafter: MTPDrafter, rank: int, device: torch.device) -> dict[str, Any]:
    """Draft time of every call and variant at every batch size."""
    cache = draft_cache(drafter, settings, device)
    results: dict[str, Any] = {}
    for call in settings.draft_calls:
        inputs = {batch: draft_inputs(drafter, call, batch, cache, device) for batch in settings.batches}
        # Every eager reference before any compile: their all-reduces are done before a graph is captured.
        eager = {batch: draft_function(drafter, call)(*args)[:2] for batch, args in inputs.items()}
        results[call] = {
            variant: run_variant(settings, (drafter, call, variant), (inputs, eager), rank, device)
            for variant in DRAFT_VARIANTS
        }
    return results


def run_variant(
    settings: Settings,
    what: tuple[MTPDrafter, str, str],
    data: tuple[dict[int, tuple[Any, ...]], dict[int, Any]],
    rank: int,
    device: torch.device,
) -> dict[str, Any]:
    """One draft call's variant (``what``: drafter, call, variant) on every batch (``data``: inputs, eager)."""
    drafter, call, variant = what
    inputs, eager = data
    torch._dynamo.reset()
    be = None
    fn = draft_function(drafter, call)
    if variant != "eager":
        be = hcpasses.backend(sp_min_tokens=settings.sp_min_tokens, cudagraphs=variant == "cudagraphs")
        fn = torch.compile(fn, backend=be, dynamic=True)
    guarded = variant == "cudagraphs" and settings.capture_guard
    capture_s = capture_graphs(fn, inputs, device) if guarded else {}
    rows = {}
    for batch, args in inputs.items():
        row = summary(timed(lambda args=args: fn(*args)[:2], settings, device), eager[batch], None)
        if batch in capture_s:
            row["capture_calls_s"] = capture_s[batch]
        rows[str(batch)] = row
        log(rank, f"draft {call} {variant} B={batch}: {row['median_ms']:.3f} ms")
    result = {"batches": rows, "sp": sp_statuses(be, 0) if be else []}
    if guarded:
        torch._dynamo.reset()  # frees the cudagraph trees: no captured NCCL work outlives the variant
        settle(device)
    return result


def capture_graphs(
    fn: Callable[..., Any], inputs: dict[int, tuple[Any, ...]], device: torch.device
) -> dict[int, float]:
    """Every batch's first calls (compile, warm-up, record and replay), largest batch first, the same on every
    rank, each call between two :func:`settle`: a capture begins with no NCCL work pending, on all ranks at once.
    Returns each batch's seconds."""
    seconds = {}
    for batch in sorted(inputs, reverse=True):
        began = time.perf_counter()
        for _ in range(CAPTURE_CALLS):
            settle(device)
            fn(*inputs[batch])
        settle(device)
        seconds[batch] = time.perf_counter() - began
    return seconds


def rank_main(rank: int, world_size: int, settings: Settings) -> dict[str, Any]:
    """One rank: ceilings, prefill points, draft steps."""
    device = settings.device(rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the CPU cores
    torch._dynamo.config.recompile_limit = max(8, 2 * len(settings.batches))
    ceilings = measure_ceilings(device, smoke=settings.tiny)
    with torch.no_grad():
        target = HCDecoder(settings.config()).to(device)
        drafter = MTPDrafter(settings.config(), target=target).to(device)
        prefill = run_prefill(settings, (target, drafter), rank, device)
        draft = run_draft(settings, drafter, rank, device)
    return {"ceilings": ceilings, "prefill": prefill, "draft": draft}


# ---------------------------------------------------------------------------------------------- summary


def slowest(per_rank: list[dict[str, Any]], *path: str) -> float:
    """The slowest rank's median at ``path``."""
    values = []
    for rank in per_rank:
        node = rank
        for key in path:
            node = node[key]
        values.append(node["median_ms"])
    return max(values)


def summarize(settings: Settings, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: environment, settings, ceilings, prefill and draft tables (slowest rank)."""
    prefill = []
    for tokens in map(str, settings.prefill_tokens):
        fused, separate = (slowest(per_rank, "prefill", tokens, v) for v in ("fused", "separate"))
        prefill.append({"tokens": int(tokens), "fused_ms": fused, "separate_ms": separate, "ratio": separate / fused})
    draft = []
    for call in settings.draft_calls:
        for batch in map(str, settings.batches):
            ms = {v: slowest(per_rank, "draft", call, v, "batches", batch) for v in DRAFT_VARIANTS}
            draft.append({"call": call, "batch": int(batch), **{f"{v}_ms": t for v, t in ms.items()}})
            draft[-1].update(
                eager_vs_compiled=ms["eager"] / ms["compiled"], eager_vs_cudagraphs=ms["eager"] / ms["cudagraphs"]
            )
    on_gpu = settings.device_type == "cuda"
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "settings": asdict(settings),
        "model": repr(settings.config()),
        "method": __doc__,
        "ceilings_rank0": per_rank[0]["ceilings"],
        "prefill": prefill,
        "draft": draft,
        "per_rank": per_rank,
    }


def table(report: dict[str, Any]) -> str:
    """Both tables as text."""
    lines = [f"{'T':>7} {'fused ms':>10} {'separate ms':>12} {'separate/fused':>15}"]
    lines += [
        f"{r['tokens']:>7} {r['fused_ms']:>10.3f} {r['separate_ms']:>12.3f} {r['ratio']:>15.3f}"
        for r in report["prefill"]
    ]
    lines.append(
        f"{'call':>7} {'B':>4} "
        + "".join(f"{v + ' ms':>16}" for v in DRAFT_VARIANTS)
        + "  eager/compiled  eager/cudagraphs"
    )
    for r in report["draft"]:
        times = "".join(f"{r[v + '_ms']:>16.3f}" for v in DRAFT_VARIANTS)
        ratios = f"{r['eager_vs_compiled']:>14.3f}  {r['eager_vs_cudagraphs']:>16.3f}"
        lines.append(f"{r['call']:>7} {r['batch']:>4} {times}  {ratios}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    """Command line -> settings (``--tiny`` switches the defaults to a small CPU-sized run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="TP size = processes (one GPU each), default 2")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu runs over gloo")
    parser.add_argument("--tiny", action="store_true", help="the tiny fp32 model and small sizes (smoke run)")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default 4; tiny 2)")
    parser.add_argument("--ple-layer", type=int, default=None, help="the PLE layer, -1: none (default 1; tiny 0)")
    parser.add_argument("--prefill-tokens", default=None, help=f"comma list, default {DEFAULT_PREFILL}")
    parser.add_argument("--batches", default=None, help=f"draft-step rows, default {DEFAULT_BATCHES}")
    parser.add_argument("--draft-calls", default=",".join(DRAFT_CALLS), help="step and/or forward (comma list)")
    parser.add_argument(
        "--no-capture-guard",
        dest="capture_guard",
        action="store_false",
        help="capture the cudagraphs variant's graphs inside the timed loop, without the aligned first calls",
    )
    parser.add_argument("--context", type=int, default=None, help="draft KV cache length (default 1024; tiny 32)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls after the first (default 5)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 30)")
    parser.add_argument("--sp-min-tokens", type=int, default=None, help="hcpasses threshold (default 1024; tiny 8)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    tiny = args.tiny
    calls = tuple(args.draft_calls.split(","))
    if not set(calls) <= set(DRAFT_CALLS):
        parser.error(f"--draft-calls: each of {DRAFT_CALLS}, got {args.draft_calls!r}")
    ple_layer = args.ple_layer if args.ple_layer is not None else (0 if tiny else 1)

    def ints(text: str | None, default: str) -> tuple[int, ...]:
        return tuple(int(x) for x in (text or default).split(","))

    settings = Settings(
        tp=args.tp,
        device_type=args.device,
        tiny=tiny,
        layers=args.layers or (2 if tiny else 4),
        ple_layer=None if ple_layer < 0 else ple_layer,
        prefill_tokens=ints(args.prefill_tokens, "16" if tiny else DEFAULT_PREFILL),
        batches=ints(args.batches, "1,2,4" if tiny else DEFAULT_BATCHES),
        draft_calls=calls,
        capture_guard=args.capture_guard,
        context=args.context or (32 if tiny else 1024),
        warmup=args.warmup if args.warmup is not None else (1 if tiny else 5),
        repeats=args.repeats or (3 if tiny else 30),
        sp_min_tokens=args.sp_min_tokens or (8 if tiny else 1024),
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> None:
    """Run every rank, write the JSON report, print the tables."""
    settings, args = parse_args(argv)
    if settings.device_type == "cuda" and torch.cuda.device_count() < settings.tp:
        raise SystemExit(f"mtp_draft: --tp {settings.tp} needs as many GPUs (found {torch.cuda.device_count()})")
    if settings.capture_guard and os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        # Graph capture waits for pending NCCL work with no deadline; blocking wait has been seen to deadlock it.
        raise SystemExit("mtp_draft: unset TORCH_NCCL_BLOCKING_WAIT (or pass --no-capture-guard)")
    backend = "nccl" if settings.device_type == "cuda" else "gloo"
    per_rank = run_ranks(rank_main, settings.tp, settings, backend=backend, timeout_s=args.timeout)
    report = summarize(settings, per_rank)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{'smoke_' if settings.tiny else ''}mtp_draft_tp{settings.tp}.json"
    path.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

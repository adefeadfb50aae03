"""TP prefill benchmark of the HC benchmark model: SP off vs hcpasses SP vs hand-written SP (DESIGN §4, §8).

Run from the repository root, one process per GPU (NCCL; gloo on CPU)::

    PYTHONPATH=. python benchmarks/prefill_sp.py --tp 2           # 2 GPUs, the default points
    PYTHONPATH=. python benchmarks/prefill_sp.py --tp 4 --points 64x1,1024x64
    PYTHONPATH=. python benchmarks/prefill_sp.py --cpu-smoke      # tiny model, gloo on CPU: checks the plumbing
    PYTHONPATH=. python benchmarks/prefill_sp.py --tp 8 --simulate --points 1024x64   # one GPU plays rank 0 of 8

``--simulate`` (``benchmarks/simulated_tp.py``, DESIGN §11): one process on one GPU is rank ``--rank`` of a fake
group of ``--tp``; the collectives return stand-in values (all-gather = tp copies of the local shard,
reduce-scatter = this rank's block, all-reduce = identity), so the times are one rank's compute. Each
variant's collectives of one forward are recorded and priced by the ring model at ``--link-gbps`` (default
450 GB/s each way, H200 NVLink 4); the rows then carry ``comm_ms`` and ``estimated_ms`` (compute + comm, no
overlap) beside the measured time. Logits are not those of a real TP run, so ``rel_diff_vs_sp_off`` only
shows that nothing blew up.

Model: ``hcpasses.testing.models.bench_model.BenchDecoder`` at real sizes (S 2560, n 4, r 320, bf16, 8 layers: linear
token mixer with GDN-sized projections, attention every 4th layer, SwiGLU 5632; logits of the last
token of each sequence; ``--fp8``: PTPC-FP8 input projections, where hcpasses fuses each gated mean with its
quant and both SP variants gather FP8 codes and scales). A point ``LxB`` is B concurrent sequences of L tokens,
one forward of T = L*B tokens. Variants, all through Inductor, each compiled once per point with static shapes
(``--dynamic`` compiles with symbolic sizes instead):

- ``sp_off``: ``hcpasses.backend(sp_rewrite=False)`` on the plain model;
- ``hcpasses_sp``: ``hcpasses.backend(sp_rewrite=True, sp_min_tokens=...)`` on the plain model;
- ``handwritten_sp``: ``torch.compile`` (default Inductor) on the hand-written SP model (same weights).

Static shapes cost one compile per variant and point (15 at the default points, tens of seconds each at
real size): to fit a device call, split the points over several runs (each run still times all three
variants side by side), or pass ``--dynamic`` (one compile per variant; hcpasses then compiles its
sharded and unsharded variants and dispatches on T). Rank 0 prints its progress as it goes.

Timing: per rank, CUDA events around each forward, after a device sync and a barrier so that the ranks
start together; warm-up calls first (the first one compiles; its time is reported apart); input ids
rotated over a few sets; the median per rank, and the slowest rank's median is the point's time
(throughput = T / time). Each variant's logits are compared with ``sp_off``'s on the same ids.

HC time per rank: the HC blocks cannot be told apart in a compiled graph (Inductor fuses them with
their neighbours and ``record_function`` ranges vanish), so the HC-only chain of the model (every HC
block's mix and combine with the same replicated weights, the sub-layers replaced by a fixed output
``y``, then the final mixer; the gated means are returned so that nothing is dead) is compiled alone and
run on T rows (unsharded) and on ceil(T/tp) rows (what a rank holds under SP). Its time is the sum of
the GPU kernel durations that ``torch.profiler`` records (under ``--cpu-smoke``: the CPU ops' self time,
which only checks the plumbing); the ratio sharded / unsharded is the HC time goal's number. The FLOP
and copy ceilings (a bf16 GEMM, a device-to-device copy) are measured in the same run, and each point's
per-rank FLOPs are counted (``flops_per_rank``).

``--kernels``: each variant's kernels of rank 0, profiled over ``--repeats`` more calls, summed by name and by kind
(Inductor's Triton pointwise, reduction and template kernels, library GEMMs, copies, the rest), per forward: where
two variants' times differ, which kernels differ (printed side by side, in the JSON as ``kernel_profile_rank0``).

Writes ``prefill_sp_tp{tp}.json`` and ``.png`` (``smoke_`` prefixed for ``--cpu-smoke``, ``_fp8`` after the tp for
``--fp8``, ``_simulated`` for ``--simulate``) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from simulated_tp import NVLINK_GBPS_PER_DIRECTION, CommLedger, CommModel, simulated_tp
from torch import nn

import hcpasses
from hcpasses.testing.models import HCConfig
from hcpasses.testing.models.bench_model import ATTENTION_PERIOD, MIXER_CHUNK, BenchDecoder, MixerSizes, bench_config
from hcpasses.testing.models.hc import FinalMixer, HyperConnection
from hcpasses.testing.multiproc import run_ranks

VARIANTS = ("sp_off", "hcpasses_sp", "handwritten_sp")
DEFAULT_POINTS = "64x1,1024x1,1024x4,1024x16,1024x64"
SMOKE_POINTS = "4x1,16x2"
GOAL_HC_RATIO = 0.55  # HC time per rank, sharded / unsharded, at most
GOAL_VS_HANDWRITTEN = 1.00  # hcpasses SP throughput / hand-written SP throughput, at least
GOAL_SPEEDUP = 1.08  # hcpasses SP / SP off throughput at the largest T, at least
GOAL_DECODE_BAND = 0.02  # |hcpasses / SP off - 1| below sp_min_tokens, at most


@dataclass(frozen=True)
class Point:
    """``n_seqs`` concurrent sequences of ``seq_len`` tokens: one forward of ``tokens`` rows."""

    seq_len: int
    n_seqs: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.n_seqs

    @property
    def label(self) -> str:
        return f"{self.seq_len}x{self.n_seqs}"


def parse_points(text: str) -> tuple[Point, ...]:
    """``"1024x64,64x1"`` -> points; raises ValueError on a malformed entry."""
    points = []
    for item in text.split(","):
        seq_len, _, n_seqs = item.strip().partition("x")
        if not (seq_len.isdigit() and n_seqs.isdigit()) or int(seq_len) < 1 or int(n_seqs) < 1:
            raise ValueError(f"a point is LENxSEQS with positive integers, got {item!r}")
        points.append(Point(int(seq_len), int(n_seqs)))
    return tuple(points)


@dataclass(frozen=True)
class Settings:
    """Everything a rank needs to run the benchmark (picklable)."""

    tp: int
    points: tuple[Point, ...]
    variants: tuple[str, ...]
    n_layers: int
    warmup: int
    repeats: int
    n_inputs: int
    sp_min_tokens: int
    ple_layer: int | None
    fp8: bool
    all_logits: bool
    dynamic: bool
    smoke: bool
    simulate: bool = False
    sim_rank: int = 0
    link_gbps: float = NVLINK_GBPS_PER_DIRECTION
    kernels: bool = False

    def config(self) -> HCConfig:
        """Real sizes, bf16 (tiny fp32 for the smoke run)."""
        if self.smoke:
            return HCConfig.tiny(
                n_layers=self.n_layers, n_heads=4, n_kv_heads=2, ple_layer=self.ple_layer, fp8=self.fp8, seed=5
            )
        return bench_config(n_layers=self.n_layers, ple_layer=self.ple_layer, fp8=self.fp8)

    def sizes(self) -> MixerSizes:
        """GDN sizes: 16 heads x 128 (4 heads x 8 for the smoke run)."""
        return MixerSizes(heads=4, key_head_dim=8, value_head_dim=8) if self.smoke else MixerSizes()

    def device(self, rank: int) -> torch.device:
        if self.smoke:
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.simulate else rank)


# ----------------------------------------------------------------------------------------------- timing


def log(rank: int, message: str) -> None:
    """Progress on rank 0's stdout (on the one process of a simulated run, whichever rank it plays)."""
    if rank == 0 or dist.get_backend() == "fake":
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if not dist.is_initialized():  # simulated tp 1
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def time_calls(step: Callable[[int], Any], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of ``step(i)`` for ``i < repeats``: CUDA events (host clock on CPU), ranks aligned."""
    times = []
    for i in range(repeats):
        _sync(device)
        _barrier(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - began) * 1e3)
    return times


def profiled_ms(step: Callable[[int], Any], repeats: int, device: torch.device) -> float:
    """Per call, the summed durations of the GPU kernels ``torch.profiler`` records (on CPU: ops' self time), ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for i in range(repeats):
            step(i)
        _sync(device)
    if on_gpu:
        total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    else:
        total_us = sum(e.self_cpu_time_total for e in prof.events() if e.device_type == DeviceType.CPU)
    return total_us / repeats / 1e3


# kinds of kernel, first match wins: Inductor's Triton kernels by their name's prefix, library kernels by a word
KERNEL_KINDS = (
    ("triton pointwise", ("triton_poi",)),
    ("triton reduction", ("triton_red", "triton_per")),
    ("triton template", ("triton_tem",)),
    ("library GEMM", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas", "mm")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel (or, on CPU, an op) by its name; ``other`` where none matches."""
    lowered = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(word in lowered for word in words)), "other")


def kernel_profile(step: Callable[[int], Any], repeats: int, device: torch.device) -> dict[str, Any]:
    """Per forward: GPU kernel microseconds and launches by kernel name and by kind (on CPU: ops' self time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for i in range(repeats):
            step(i)
        _sync(device)
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == kind:
            us = event.time_range.elapsed_us() if on_gpu else event.self_cpu_time_total
            entry = by_name.setdefault(event.name, [0.0, 0])
            entry[0] += us / repeats
            entry[1] += 1 / repeats
    by_kind: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        kind_of_name = kernel_kind(name)
        by_kind[kind_of_name] = by_kind.get(kind_of_name, 0.0) + us
    ranked = sorted(by_name.items(), key=lambda item: item[1][0], reverse=True)
    return {
        "total_us": sum(us for us, _ in by_name.values()),
        "launches": sum(count for _, count in by_name.values()),
        "by_kind_us": dict(sorted(by_kind.items())),
        "by_name": [{"name": name, "us": us, "launches": count} for name, (us, count) in ranked],
    }


def measure_ceilings(device: torch.device, smoke: bool) -> dict[str, float]:
    """Measured bf16 GEMM TFLOP/s (8192^3) and device-to-device copy GB/s (1 GiB read + written)."""
    n, numel = (256, 1 << 20) if smoke else (8192, 1 << 29)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gemm_ms = statistics.median(time_calls(lambda _: a @ b, 10, device)[2:])
    copy_ms = statistics.median(time_calls(lambda _: dst.copy_(src), 10, device)[2:])
    return {"gemm_tflops": 2 * n**3 / gemm_ms / 1e9, "copy_gbps": 2 * 2 * numel / copy_ms / 1e6}


# ------------------------------------------------------------------------------------------------ model


def token_sets(point: Point, settings: Settings, device: torch.device) -> list[torch.Tensor]:
    """``n_inputs`` random id tensors ``[T]``, the same on every rank (seeded by the point)."""
    gen = torch.Generator().manual_seed(point.tokens * 7919 + point.n_seqs)
    vocab = settings.config().vocab_size
    return [torch.randint(0, vocab, (point.tokens,), generator=gen).to(device) for _ in range(settings.n_inputs)]


def make_backend(variant: str, settings: Settings) -> Any:
    """The ``torch.compile`` backend of a variant."""
    if variant == "handwritten_sp":
        return "inductor"
    return hcpasses.backend(sp_rewrite=variant == "hcpasses_sp", sp_min_tokens=settings.sp_min_tokens)


def report_summary(backend: Any, seen: int) -> list[dict[str, Any]]:
    """The hcpasses reports of the graphs compiled since ``seen`` (empty for plain Inductor)."""
    if isinstance(backend, str):
        return []
    return [json.loads(report.to_json()) for report in backend.reports[seen:]]


def run_point(
    model: Any, backend: Any, point: Point, settings: Settings, device: torch.device, ledger: CommLedger | None
) -> dict[str, Any]:
    """Compile (first call), warm up and time one point; returns times, compile time, logits of set 0.

    With a ledger (simulated TP), one more forward records its collectives and their modelled time.
    """
    inputs = token_sets(point, settings, device)
    seen = 0 if isinstance(backend, str) else len(backend.reports)
    began = time.perf_counter()
    with torch.no_grad():
        logits = model(inputs[0], point.n_seqs)
        _sync(device)
        first_s = time.perf_counter() - began

        def step(i: int) -> torch.Tensor:
            return model(inputs[i % len(inputs)], point.n_seqs)

        for i in range(settings.warmup):
            step(i)
        times = time_calls(step, settings.repeats, device)
        result = {
            "first_call_s": first_s,
            "times_ms": times,
            "median_ms": statistics.median(times),
            "reports": report_summary(backend, seen),
            "logits": logits.float().cpu(),
        }
        if settings.kernels:
            result["kernel_profile"] = kernel_profile(step, settings.repeats, device)
        if ledger is not None:
            ledger.clear()
            step(0)
            result["collectives"] = {"counts": ledger.counts(), "full_bytes": ledger.bytes_by_kind()}
            result["comm_ms"] = CommModel(settings.link_gbps).ms(ledger.calls)
    return result


def run_variant(
    variant: str, settings: Settings, rank: int, device: torch.device, ledger: CommLedger | None = None
) -> dict[str, dict[str, Any]]:
    """Every point of one variant, from a fresh Dynamo state."""
    torch._dynamo.reset()
    cfg, handwritten = settings.config(), variant == "handwritten_sp"
    model = BenchDecoder(
        cfg, rank, settings.tp, handwritten_sp=handwritten, sizes=settings.sizes(), all_logits=settings.all_logits
    ).to(device)
    backend = make_backend(variant, settings)
    compiled = torch.compile(model, backend=backend, dynamic=settings.dynamic)
    results = {}
    for point in settings.points:
        results[point.label] = result = run_point(compiled, backend, point, settings, device, ledger)
        log(
            rank,
            f"{variant} {point.label}: first call {result['first_call_s']:.1f} s, median {result['median_ms']:.3f} ms",
        )
    del compiled, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


class HCChain(nn.Module):
    """Every HC block of the benchmark model back to back, sub-layers replaced by a fixed output ``y``.

    Same names, so the same replicated weights as :class:`~hcpasses.testing.models.bench_model.BenchDecoder`'s HCs.
    ``forward(h [R, nS], y [R, S])`` returns the final mixer output and every block's gated mean.
    """

    def __init__(self, cfg: HCConfig) -> None:
        super().__init__()
        names = [f"layers.{i}.{kind}" for i in range(cfg.n_layers) for kind in ("attn_hc", "mlp_hc")]
        self.blocks = nn.ModuleList(HyperConnection(cfg, name=name) for name in names)
        self.final_mixer = FinalMixer(cfg, name="final_mixer")

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs = []
        for block in self.blocks:
            x, logits = block.mix(h)
            xs.append(x)
            h = block.combine(h, y, logits)
        return self.final_mixer(h), *xs


def time_hc_chain(chain: Any, rows: int, settings: Settings, device: torch.device) -> dict[str, float]:
    """Profiled kernel time and event-timed median (ms) of the compiled HC chain on ``rows`` rows."""
    cfg, gen = settings.config(), torch.Generator().manual_seed(rows)
    sets = [
        (torch.randn(rows, cfg.streams_width, generator=gen), torch.randn(rows, cfg.hidden, generator=gen))
        for _ in range(settings.n_inputs)
    ]
    sets = [(h.to(device, cfg.dtype), y.to(device, cfg.dtype)) for h, y in sets]

    def step(i: int) -> Any:
        return chain(*sets[i % len(sets)])

    with torch.no_grad():
        for i in range(settings.warmup + 1):
            step(i)
        events_ms = statistics.median(time_calls(step, settings.repeats, device))
        kernels_ms = profiled_ms(step, settings.repeats, device)
    return {"rows": rows, "kernel_ms": kernels_ms, "event_ms": events_ms}


def run_hc_only(settings: Settings, rank: int, device: torch.device) -> dict[str, dict[str, Any]]:
    """HC chain times unsharded (T rows) and sharded (ceil(T/tp) rows) for every T >= sp_min_tokens.

    One compile with a symbolic row count serves every size (row-wise kernels: only their grid depends on it).
    """
    torch._dynamo.reset()
    chain = torch.compile(HCChain(settings.config()).to(device), dynamic=True)
    results = {}
    for tokens in sorted({p.tokens for p in settings.points if p.tokens >= settings.sp_min_tokens}):
        full = time_hc_chain(chain, tokens, settings, device)
        shard = time_hc_chain(chain, -(-tokens // settings.tp), settings, device)
        results[str(tokens)] = {"unsharded": full, "sharded": shard, "ratio": shard["kernel_ms"] / full["kernel_ms"]}
        log(rank, f"HC chain T={tokens}: {full['kernel_ms']:.3f} ms unsharded, {shard['kernel_ms']:.3f} ms sharded")
    return results


def rank_main(rank: int, world_size: int, settings: Settings, ledger: CommLedger | None = None) -> dict[str, Any]:
    """One rank's whole benchmark: ceilings, every variant at every point, the HC chain."""
    device = settings.device(rank)
    if settings.smoke:
        torch.set_num_threads(1)  # the ranks share the CPU cores
    torch._dynamo.config.recompile_limit = max(8, 2 * len(settings.points))
    ceilings = measure_ceilings(device, settings.smoke)
    log(rank, f"ceilings: {ceilings}")
    variants = {variant: run_variant(variant, settings, rank, device, ledger) for variant in settings.variants}
    compare_logits(variants)
    return {"ceilings": ceilings, "variants": variants, "hc_only": run_hc_only(settings, rank, device)}


def compare_logits(variants: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Replace each result's logits by its largest difference from ``sp_off``'s (relative to their max)."""
    reference = {label: result["logits"] for label, result in variants.get("sp_off", {}).items()}
    for results in variants.values():
        for label, result in results.items():
            logits = result.pop("logits")
            if label in reference:
                scale = float(reference[label].abs().max())
                result["rel_diff_vs_sp_off"] = float((logits - reference[label]).abs().max()) / scale


# ------------------------------------------------------------------------------------------- accounting


def flops_per_rank(settings: Settings, point: Point, sharded_hc: bool) -> float:
    """FLOPs one rank does in one forward (GEMMs, attention and recurrence products; no elementwise ops)."""
    cfg, sizes, tp = settings.config(), settings.sizes(), settings.tp
    hidden, width, rank = cfg.hidden, cfg.streams_width, cfg.hc_rank
    hc_rows = -(-point.tokens // tp) if sharded_hc else point.tokens
    hc = 2 * cfg.n_layers * (2 * width * (rank + cfg.n_streams) + 2 * rank * width) + 4 * width * rank
    q_width, kv_width = cfg.n_heads * cfg.head_dim // tp, max(cfg.n_kv_heads // tp, 1) * cfg.head_dim
    attention = 2 * hidden * (2 * q_width + 2 * kv_width) + 2 * (point.seq_len + 1) * q_width
    mixer_projections = (
        2 * hidden * (2 * sizes.key_dim + 2 * sizes.value_dim + sizes.heads) + 2 * sizes.value_dim * hidden
    )
    recurrence = sizes.heads * (2 * MIXER_CHUNK * (sizes.key_head_dim + sizes.value_head_dim))
    recurrence += sizes.heads * 4 * sizes.key_head_dim * sizes.value_head_dim
    mixer = (mixer_projections + recurrence) / tp
    n_attention = cfg.n_layers // ATTENTION_PERIOD
    sublayers = (
        n_attention * attention
        + (cfg.n_layers - n_attention) * mixer
        + cfg.n_layers * 6 * hidden * cfg.intermediate / tp
    )
    logit_rows = point.tokens if settings.all_logits else point.n_seqs
    return hc_rows * hc + point.tokens * sublayers + logit_rows * 2 * hidden * cfg.vocab_size


def sp_applied(reports: list[dict[str, Any]], tokens: int, sp_min_tokens: int) -> bool | None:
    """Whether the SP rewrite changed the graph that runs T tokens (None: no graph was compiled for them).

    Of a compile with symbolic T, the ``sharded`` variant runs T >= sp_min_tokens, ``unsharded`` the rest.
    """
    wanted = "sharded" if tokens >= sp_min_tokens else "unsharded"
    used = [report for report in reports if report["variant"] in ("only", wanted)]
    if not used:
        return None
    return any(p["name"] == "sp_rewrite" and p["applied"] > 0 for report in used for p in report["passes"])


def variant_row(settings: Settings, point: Point, variant: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant at one point over all ranks: the slowest rank's median, throughput, FLOP rate."""
    results = [rank["variants"][variant][point.label] for rank in per_rank]
    ms = max(r["median_ms"] for r in results)
    sharded = variant == "handwritten_sp" or (variant == "hcpasses_sp" and point.tokens >= settings.sp_min_tokens)
    flops = flops_per_rank(settings, point, sharded)
    row = {
        "ms": ms,
        "rank_medians_ms": [r["median_ms"] for r in results],
        "tokens_per_s": point.tokens / ms * 1e3,
        "first_call_s": max(r["first_call_s"] for r in results),
        "flops_per_rank": flops,
        "tflops_per_rank": flops / ms / 1e9,
        "sp_applied": sp_applied(results[0]["reports"], point.tokens, settings.sp_min_tokens),
        "reports_rank0": results[0]["reports"],
    }
    if "rel_diff_vs_sp_off" in results[0]:
        row["rel_diff_vs_sp_off"] = max(r["rel_diff_vs_sp_off"] for r in results)
    if "kernel_profile" in results[0]:
        row["kernel_profile_rank0"] = results[0]["kernel_profile"]
    if "comm_ms" in results[0]:
        row |= {"comm_ms": results[0]["comm_ms"], "estimated_ms": ms + results[0]["comm_ms"]}
        row["collectives"] = results[0]["collectives"]
    return row


def point_row(settings: Settings, point: Point, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every variant at one point, and their throughput ratios."""
    row: dict[str, Any] = {"point": point.label, "seq_len": point.seq_len, "n_seqs": point.n_seqs}
    row["tokens"] = point.tokens
    row["variants"] = {v: variant_row(settings, point, v, per_rank) for v in settings.variants}
    ms = {v: r["ms"] for v, r in row["variants"].items()}
    for name, (slow, fast) in {
        "hcpasses_vs_sp_off": ("sp_off", "hcpasses_sp"),
        "handwritten_vs_sp_off": ("sp_off", "handwritten_sp"),
        "hcpasses_vs_handwritten": ("handwritten_sp", "hcpasses_sp"),
    }.items():
        if slow in ms and fast in ms:
            row[name] = ms[slow] / ms[fast]
    return row


def hc_only_rows(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """HC chain kernel time per T: each rank's sharded / unsharded ratio and the worst one."""
    rows = {}
    for tokens in per_rank[0]["hc_only"]:
        ranks = [rank["hc_only"][tokens] for rank in per_rank]
        rows[tokens] = {
            "ratio": max(r["ratio"] for r in ranks),
            "unsharded_kernel_ms": [r["unsharded"]["kernel_ms"] for r in ranks],
            "sharded_kernel_ms": [r["sharded"]["kernel_ms"] for r in ranks],
            "unsharded_event_ms": [r["unsharded"]["event_ms"] for r in ranks],
            "sharded_event_ms": [r["sharded"]["event_ms"] for r in ranks],
            "sharded_rows": ranks[0]["sharded"]["rows"],
        }
    return rows


def _goal(value: float | None, goal: float, at_most: bool) -> dict[str, Any]:
    met = None if value is None else (value <= goal if at_most else value >= goal)
    return {"goal": f"{'<=' if at_most else '>='} {goal}", "value": value, "met": met}


def goals(settings: Settings, rows: list[dict[str, Any]], hc_only: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's four goals, each with its measured value (None where a variant or point is missing)."""
    prefill = [r for r in rows if r["tokens"] >= settings.sp_min_tokens]
    decode = [r for r in rows if r["tokens"] < settings.sp_min_tokens]
    largest = [r for r in prefill if r["tokens"] == max((p["tokens"] for p in prefill), default=0)]

    def worst(selected: list[dict[str, Any]], key: str, pick: Callable[..., float]) -> float | None:
        values = [r[key] for r in selected if key in r]
        return pick(values) if values else None

    hc_ratio = hc_only[max(hc_only, key=int)]["ratio"] if hc_only else None
    decode_dev = worst(decode, "hcpasses_vs_sp_off", lambda v: max(abs(x - 1) for x in v))
    return {
        "hc_time_ratio_at_largest_T": _goal(hc_ratio, GOAL_HC_RATIO, at_most=True),
        "hcpasses_vs_handwritten_min_over_prefill": _goal(
            worst(prefill, "hcpasses_vs_handwritten", min), GOAL_VS_HANDWRITTEN, at_most=False
        ),
        "hcpasses_vs_sp_off_at_largest_T": _goal(worst(largest, "hcpasses_vs_sp_off", min), GOAL_SPEEDUP, False),
        "decode_abs_deviation_vs_sp_off": _goal(decode_dev, GOAL_DECODE_BAND, at_most=True),
    }


def summarize(settings: Settings, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: environment, settings, ceilings, per-point rows, HC-only rows, goals."""
    rows = [point_row(settings, point, per_rank) for point in settings.points]
    hc_only = hc_only_rows(per_rank)
    on_gpu = not settings.smoke
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (smoke)",
        "simulated_tp": settings.simulate,
        "torch": torch.__version__,
        "settings": {**asdict(settings), "points": [p.label for p in settings.points]},
        "model": {"config": repr(settings.config()), "mixer": asdict(settings.sizes())},
        "method": __doc__,
        "ceilings_rank0": per_rank[0]["ceilings"],
        "points": rows,
        "hc_only": hc_only,
        "goals": goals(settings, rows, hc_only),
    }


# ------------------------------------------------------------------------------------------------ output


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Throughput per point and variant, and speedups over SP off; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, variants = summary["points"], summary["settings"]["variants"]
    labels = [r["point"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(rows))]
        left.bar(xs, [r["variants"][variant]["tokens_per_s"] / 1e3 for r in rows], width, label=variant)
    left.set_xticks(range(len(rows)), labels)
    left.set(xlabel="sequence length x concurrency", ylabel="k tokens / s", title="prefill throughput")
    left.legend()
    for key in ("hcpasses_vs_sp_off", "handwritten_vs_sp_off", "hcpasses_vs_handwritten"):
        if all(key in r for r in rows):
            right.plot(labels, [r[key] for r in rows], marker="o", label=key)
    right.axhline(GOAL_SPEEDUP, color="grey", linestyle="--", linewidth=0.8)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(xlabel="sequence length x concurrency", ylabel="throughput ratio", title="ratios")
    right.legend()
    settings = summary["settings"]
    fig.suptitle(f"HC benchmark model, TP {settings['tp']}, {summary['device']}, torch {summary['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def table(summary: dict[str, Any]) -> str:
    """The per-point timings and ratios, the HC-only ratios and the goals, as text."""
    variants = summary["settings"]["variants"]
    lines = [f"{'point':>10} {'T':>7} " + "".join(f"{v + ' ms':>18}" for v in variants) + "  hcp/off  hcp/hw  sp"]
    for r in summary["points"]:
        times = "".join(f"{r['variants'][v]['ms']:>18.3f}" for v in variants)
        ratios = (
            f"{r.get('hcpasses_vs_sp_off', float('nan')):>8.3f} {r.get('hcpasses_vs_handwritten', float('nan')):>7.3f}"
        )
        applied = r["variants"].get("hcpasses_sp", {}).get("sp_applied")
        lines.append(f"{r['point']:>10} {r['tokens']:>7} {times} {ratios}  {applied}")
        if summary["simulated_tp"]:
            estimates = "".join(f"{r['variants'][v]['estimated_ms']:>18.3f}" for v in variants)
            lines.append(f"{'+ comm':>10} {'':>7} {estimates}  (ring model, no overlap)")
    lines.extend(kernel_table(summary))
    for tokens, r in summary["hc_only"].items():
        lines.append(f"HC chain T={tokens}: sharded/unsharded kernel time {r['ratio']:.3f} (rows {r['sharded_rows']})")
    lines.extend(f"goal {name}: {json.dumps(goal)}" for name, goal in summary["goals"].items())
    return "\n".join(lines)


def kernel_table(summary: dict[str, Any]) -> list[str]:
    """Each point's kernel microseconds per forward by kind, the variants side by side (``--kernels`` runs only)."""
    lines = []
    for r in summary["points"]:
        profiles = {v: row["kernel_profile_rank0"] for v, row in r["variants"].items() if "kernel_profile_rank0" in row}
        if not profiles:
            continue
        lines.append(f"kernels at {r['point']}, us per forward: " + "  ".join(f"{v:>18}" for v in profiles))
        kinds = sorted({kind for profile in profiles.values() for kind in profile["by_kind_us"]})
        for kind in kinds:
            cells = "  ".join(f"{profile['by_kind_us'].get(kind, 0.0):>18.1f}" for profile in profiles.values())
            lines.append(f"{kind:>35} {cells}")
        totals = "  ".join(f"{p['total_us']:>10.1f} ({p['launches']:>5.0f})" for p in profiles.values())
        lines.append(f"{'total (launches)':>35} {totals}")
    return lines


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    """Command line -> settings (``--cpu-smoke`` switches the defaults to a tiny CPU run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="TP size = processes (one GPU each), default 2")
    parser.add_argument("--points", default=None, help=f"LENxSEQS list, default {DEFAULT_POINTS}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; smoke 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls after the first (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 15)")
    parser.add_argument("--sp-min-tokens", type=int, default=None, help="hcpasses threshold (default 1024)")
    parser.add_argument("--ple-layer", type=int, default=None, help="layer holding the PLE layer (default none)")
    parser.add_argument("--fp8", action="store_true", help="PTPC-FP8 input projections (x quantised per token)")
    parser.add_argument("--all-logits", action="store_true", help="logits of every token, not the last of each")
    parser.add_argument("--dynamic", action="store_true", help="compile with symbolic sizes (one graph per variant)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU over gloo, to check the script")
    parser.add_argument("--simulate", action="store_true", help="one GPU plays one rank of --tp (simulated_tp.py)")
    parser.add_argument("--rank", type=int, default=0, help="the rank --simulate plays (default 0)")
    parser.add_argument("--link-gbps", type=float, default=NVLINK_GBPS_PER_DIRECTION, help="--simulate's comm model")
    parser.add_argument("--kernels", action="store_true", help="profile each variant's kernels by name and kind")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    variants = tuple(v.strip() for v in args.variants.split(","))
    if set(variants) - set(VARIANTS) or args.tp < 1:
        parser.error(f"--variants must be a subset of {','.join(VARIANTS)} and --tp >= 1")
    settings = Settings(
        tp=args.tp,
        points=parse_points(args.points or (SMOKE_POINTS if smoke else DEFAULT_POINTS)),
        variants=variants,
        n_layers=args.layers or (4 if smoke else 8),
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 3),
        repeats=args.repeats or (3 if smoke else 15),
        n_inputs=2 if smoke else 4,
        sp_min_tokens=args.sp_min_tokens or (16 if smoke else 1024),
        ple_layer=args.ple_layer,
        fp8=args.fp8,
        all_logits=args.all_logits,
        dynamic=args.dynamic,
        smoke=smoke,
        simulate=args.simulate,
        sim_rank=args.rank,
        link_gbps=args.link_gbps,
        kernels=args.kernels,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> None:
    """Run every rank, then write the JSON report and the plot and print the table."""
    settings, args = parse_args(argv)
    needed = 1 if settings.simulate else settings.tp
    if not settings.smoke and torch.cuda.device_count() < needed:
        raise SystemExit(f"prefill_sp: --tp {settings.tp} needs {needed} GPUs (found {torch.cuda.device_count()})")
    if settings.simulate:
        with simulated_tp(settings.tp, settings.sim_rank) as ledger:
            per_rank = [rank_main(settings.sim_rank, settings.tp, settings, ledger)]
    else:
        backend = "gloo" if settings.smoke else "nccl"
        per_rank = run_ranks(rank_main, settings.tp, settings, backend=backend, timeout_s=args.timeout)
    summary = summarize(settings, per_rank)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{'smoke_' if settings.smoke else ''}prefill_sp_tp{settings.tp}{'_fp8' if settings.fp8 else ''}"
    stem += "_simulated" if settings.simulate else ""
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(summary, args.out / f"{stem}.png")
    print(table(summary))
    print(f"wrote {args.out / stem}.json" + (" and .png" if plotted else " (no plot: matplotlib is missing)"))


if __name__ == "__main__":
    main()

"""Prefill of transformers' real-size HC models under simulated TP: Inductor, hcpasses SP off / SP, hand-written SP.

Run from the repository root on one GPU (each case is one rank of a simulated group, ``simulated_tp.py``)::

    PYTHONPATH=. python benchmarks/prefill_hf.py --models qwen4_exp --tp 1,2,8 --tokens 16384 --dtypes bf16
    PYTHONPATH=. python benchmarks/prefill_hf.py --cpu-smoke          # tiny models, tiny T, CPU: the plumbing

Models (``hcpasses.testing.hf_models``): ``real_qwen4_exp`` (default 4 layers: 3 GatedDeltaNet + 1 indexed
attention, PLE in layer 2) and ``real_deepseek_v4`` (default 2 layers), built in the case's dtype on the GPU
(fp8: bf16 with ``swap_fp8_linears``), then ``shard_for_tp`` for rank ``--rank`` of tp. Where tp exceeds
qwen4_exp's 2 KV heads, each rank keeps a copy of the KV head its query heads use, as vLLM does
(:func:`replicate_kv_heads`). One forward is one sequence of T tokens with ``logits_to_keep=1``, as serving
does (the full lm_head over every token was 20 % of the kernel time, DESIGN §11).

Variants, each compiled with static shapes from a fresh Dynamo state for every case:

- ``inductor``: ``torch.compile(backend="inductor")``;
- ``sp_off``: ``hcpasses.backend(sp_rewrite=False)``;
- ``hcpasses_sp``: ``hcpasses.backend(sp_rewrite=True, sp_min_tokens=...)``;
- ``handwritten_sp``: ``torch.compile(backend="inductor")`` on the same sharded model (same weights) with sequence
  parallelism written by hand (``handwritten_sp_hf.py``, issue #27's fourth variant: what a serving team writes,
  the anchor hcpasses' SP must match or beat), for qwen4_exp and deepseek_v4. It gathers only the last token's row
  at the exit (``logits_to_keep=1``), and with ``fp8`` it gathers x unquantised (its docstring says why).

``hcpasses_vs_handwritten`` = the hand-written variant's ms / ``hcpasses_sp``'s ms, for kernel and wall time (above 1:
hcpasses is faster).

Every case runs inside ``hcpasses.hf.eager_kernels_under_compile()`` (the documented path): the compiled
GatedDeltaNet runs what eager runs, as one op (flash-linear-attention's kernels where the ``fla`` package imports:
carry its wheels to the GPU machine; else the torch reference), and torch 2.11's folded export check is undone.
``--as-traced`` runs without it (the numbers before: on torch 2.11 the export loop, unrolled, and never fla; with
fla on a torch that does not fold the check, a graph break at fla's ``torch.compiler.disable``d kernel). The JSON
header says whether ``fla`` was found and which modules the context patched.

Per case and variant: the first call's seconds (compile), the passes' own seconds from the reports, the
median wall time of ``--repeats`` calls (CUDA events; host clock on CPU; since 2026-12-07 the timed and profiled
calls run with the garbage collector paused), the profiler's kernel time and kernel count per forward (on CPU: ops'
self time and op count, which only checks the plumbing), the host calls
with the most self CPU time under the profiler (``host_top_ms``: where a host-bound forward's time goes), on the
GPU each kernel name's ms (``kernel_ms_by_name``), the time the GPU sat idle between kernels (``idle_ms``, and the
longest gaps with the kernels around them, ``gaps_top_us``) and the caching allocator's cudaMalloc / cudaFree
calls per timed call (``allocator_per_call``), the
collectives of one forward with their ring-model time at ``--link-gbps`` (``simulated_tp.CommModel``) and
``estimated_ms`` = kernel ms + comm ms (no overlap), and the logits' largest difference from ``inductor``'s (none
for a variant that shards: ``sp_applied`` true for ``hcpasses_sp`` where the pass sharded, for ``handwritten_sp`` at
tp > 1).

HC-only bound: the model's own HC modules (every decoder layer's two HC blocks and the final mixer / head,
same weights) run back to back with the sub-layers replaced by a fixed ``y``, compiled alone with symbolic
rows, timed on T rows and on ceil(T/tp) rows (profiler kernel time). ``hc_share`` = its T-row kernel time /
``sp_off``'s kernel time; ``hc_bound`` = hc_share * (1 - 1/tp), the fraction of kernel time that sharding
the HC work could save at best; ``hc_sharded_ratio`` = ceil(T/tp)-row time / T-row time. ``sp_compute_gain`` =
1 - hcpasses_sp's compute ms / sp_off's, ``sp_gain_of_bound`` = that / hc_bound (issue #27's goal: >= 0.9), and
``sp_wall_over_kernel_gain`` = the wall-time gain / the kernel-time gain (goal: >= 0.9; both include the
stand-ins' copies, so this measures what the host adds).

Compute ms = kernel ms - the stand-in collectives' kernels (``simulated_tp.standin_ms``: the copies that stand in
for NCCL are communication, priced by the comm model, not the rank's compute; without this SP was charged for its
gathers' copies while SP off's in-place all-reduce stand-in costs nothing). Kernel ms keeps them, for reference.

Robust on a time-limited GPU call: progress on stdout, the JSON rewritten after every case, and a case that
raises (out of memory, a head count tp does not divide) is recorded with its error and skipped.
Writes ``prefill_hf[_<tag>].json`` (``smoke_`` prefixed for ``--cpu-smoke``; its header names the date, start
time, commit and command) and, where matplotlib imports, the run's plot ``.png`` (``prefill_hf_grid.plot``) to
``--out``; with ``--trace DIR``, each variant's profiled calls as a Chrome trace
``DIR/trace_<model>_<dtype>_tp<N>_T<T>_<variant>.json``. ``prefill_hf_grid.py`` puts every run's cells together
(the README's table).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import prefill_hf_grid
import torch
from handwritten_sp_hf import handwritten_sp
from simulated_tp import NVLINK_GBPS_PER_DIRECTION, STANDIN_RANGE, CommLedger, CommModel, simulated_tp, standin_ms
from torch import nn

import hcpasses
from hcpasses.hf import eager_kernels_under_compile, shard_for_tp, swap_fp8_linears
from hcpasses.testing import hf_models

MODELS = ("qwen4_exp", "deepseek_v4")
VARIANTS = ("inductor", "sp_off", "hcpasses_sp", "handwritten_sp")
DTYPES = ("bf16", "fp8")
HOST_TOP = 12  # host calls listed per variant (``host_top_ms``), by self CPU time under the profiler
GAPS_TOP = 8  # longest idle gaps between kernels listed per variant (``gaps_top_us``, GPU only)
DEFAULT_LAYERS = {"qwen4_exp": 4, "deepseek_v4": 2}
SMOKE_LAYERS = {"qwen4_exp": 2, "deepseek_v4": 1}  # qwen4_exp: the PLE layer is layer 2


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    tps: tuple[int, ...]
    tokens: tuple[int, ...]
    dtypes: tuple[str, ...]
    variants: tuple[str, ...]
    layers: int | None
    rank: int
    warmup: int
    repeats: int
    sp_min_tokens: int
    link_gbps: float
    smoke: bool
    eager_kernels: bool
    trace_dir: Path | None = None
    qsa_batched: bool = False  # qwen4_exp's QSA selection for all queries at once (hcpasses.hf.qsa_batched)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.smoke else torch.device("cuda", 0)

    def n_layers(self, model: str) -> int:
        if self.layers is not None:
            return self.layers
        return (SMOKE_LAYERS if self.smoke else DEFAULT_LAYERS)[model]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------ models


def build(name: str, settings: Settings) -> nn.Module:
    """The case's model in bf16 (fp32 for the smoke run), unsharded; qwen4_exp keeps the PLE layers it still has."""
    layers = settings.n_layers(name)
    if name == "deepseek_v4":
        if not settings.smoke:
            return hf_models.real_deepseek_v4(num_layers=layers, dtype=torch.bfloat16, device=settings.device)
        tiny = hf_models.DEEPSEEK_V4_TINY
        cut = {key: tiny[key][:layers] for key in ("layer_types", "mlp_layer_types")}
        return hf_models.tiny_deepseek_v4(num_hidden_layers=layers, **cut)
    fields = hf_models.QWEN4_EXP_TINY if settings.smoke else hf_models.QWEN4_EXP_REAL
    ple = [layer for layer in fields["ple_layer_ids"] if layer <= layers]
    if not settings.smoke:
        return hf_models.real_qwen4_exp(layers, torch.bfloat16, settings.device, ple_layer_ids=ple)
    cut = {"layer_types": fields["layer_types"][:layers], "ple_layer_ids": ple}
    return hf_models.tiny_qwen4_exp(num_hidden_layers=layers, **cut)


def replicate_kv_heads(model: nn.Module, tp: int) -> int:
    """Give each qwen4_exp attention with fewer KV heads than tp ``tp`` KV heads, head h a copy of the original
    head ``h * kv // tp``: after ``shard_for_tp`` every rank holds the one KV head its query heads use (vLLM's
    KV replication). Returns the number of attention modules changed. Before ``swap_fp8_linears``."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ != "Qwen4ExpTextAttention":
            continue
        config, head_dim = module.config, module.head_dim
        kv = config.num_key_value_heads
        if kv >= tp:
            continue
        if tp % kv:
            raise ValueError(f"tp = {tp} is not a multiple of num_key_value_heads = {kv}")
        rows = torch.cat([torch.arange(h * kv // tp * head_dim, (h * kv // tp + 1) * head_dim) for h in range(tp)])
        for proj in (module.k_proj, module.v_proj):
            proj.weight = nn.Parameter(proj.weight.detach()[rows.to(proj.weight.device)], requires_grad=False)
            proj.out_features = len(rows)
        module.config = copy.copy(config)
        module.config.num_key_value_heads = tp
        module.num_key_value_groups = config.num_attention_heads // tp  # per rank: heads / tp query heads, one KV
        changed += 1
    return changed


def prepare(name: str, dtype: str, tp: int, settings: Settings) -> nn.Module:
    """Built, KV-replicated where needed, FP8-swapped for ``fp8``, and sharded for this rank (under the group)."""
    model = build(name, settings)
    if tp > 1:
        replicate_kv_heads(model, tp)
    if dtype == "fp8":
        swap_fp8_linears(model)
    return shard_for_tp(model, settings.rank, tp)


class QwenHCChain(nn.Module):
    """qwen4_exp's HC blocks back to back (same modules), each sub-layer replaced by ``y``, then the mixer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        layers = model.model.layers
        self.blocks = nn.ModuleList(
            b for layer in layers for b in (layer.attn_hyper_connection, layer.mlp_hyper_connection)
        )
        self.mixer = model.model.hyper_connection_mixer

    def streams(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(1, rows, 4 * hidden, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs = []
        for block in self.blocks:
            x, h, inject = block(h)
            xs.append(x)
            h = h + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
        return self.mixer(h), *xs


class DeepseekHCChain(nn.Module):
    """deepseek_v4's mHC blocks back to back (same modules), each sub-layer replaced by ``y``, then the head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(b for layer in model.model.layers for b in (layer.attn_hc, layer.ffn_hc))
        self.head = model.model.hc_head

    def streams(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(1, rows, 4, hidden, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs = []
        for block in self.blocks:
            post, comb, x = block(h)
            xs.append(x)
            h = post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)
        return self.head(h), *xs


# ------------------------------------------------------------------------------------------------ timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_allocs(device: torch.device) -> dict[str, int]:
    """The caching allocator's device calls so far (cudaMalloc, cudaFree, retries after freeing its cache): a
    forward that makes any stalls the host on the device (cudaFree synchronises); empty on CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector collected once, then off for the block (as ``timeit`` times): a collection
    inside a timed call of a host-bound forward would stall its launches. (The T = 16384 runs' GPU idle time moved
    between runs of the same graphs, 1.6 to 7.7 ms per call; whether collections caused any of it is not known.)"""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def wall_ms(step: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls: CUDA events (host clock on CPU), the garbage collector paused."""
    with gc_paused():
        return [one_call_ms(step, device) for _ in range(repeats)]


def one_call_ms(step: Callable[[], Any], device: torch.device) -> float:
    """One call's milliseconds from an idle device: CUDA events (host clock on CPU)."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    step()
    return (time.perf_counter() - began) * 1e3


def profiled(
    step: Callable[[], Any], repeats: int, device: torch.device, trace: Path | None = None
) -> dict[str, float]:
    """Per call: summed GPU kernel ms and number of kernels ``torch.profiler`` records (CPU: ops' self time), the
    part of it the stand-in collectives took, and compute = the rest. ``trace``: write the profile there too (a
    Chrome trace: which host call ran while the GPU sat idle)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with gc_paused(), profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        sync(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    # On the GPU timeline a stand-in's profiler range shows up as an event of its own: not a kernel.
    events = [e for e in prof.events() if e.device_type == kind and not e.name.startswith(STANDIN_RANGE)]
    kernel_ms = sum(e.time_range.elapsed_us() if on_gpu else e.self_cpu_time_total for e in events) / repeats / 1e3
    standin = standin_ms(prof.events(), on_gpu) / repeats
    # Where the host's time goes, for a forward whose wall time exceeds its kernel time (host-bound): the calls
    # with the most self CPU time (on CUDA: launches, synchronisations, allocations, the wrapper's ops).
    host = sorted(prof.key_averages(), key=lambda entry: entry.self_cpu_time_total, reverse=True)[:HOST_TOP]
    return {
        "kernel_ms": kernel_ms,
        "standin_ms": standin,
        "compute_ms": kernel_ms - standin,
        "kernels": len(events) / repeats,
        "host_top_ms": {entry.key: entry.self_cpu_time_total / repeats / 1e3 for entry in host},
        **({"kernel_ms_by_name": kernel_ms_by_name(events, repeats), **device_gaps(events, repeats)} if on_gpu else {}),
    }


def kernel_ms_by_name(kernels: Sequence[Any], repeats: int) -> dict[str, float]:
    """Device ms per call of each kernel name, most first: two variants' profiles side by side, kernel by kernel."""
    totals: dict[str, float] = {}
    for kernel in kernels:
        totals[kernel.name] = totals.get(kernel.name, 0.0) + kernel.time_range.elapsed_us() / repeats / 1e3
    return dict(sorted(totals.items(), key=lambda item: item[1], reverse=True))


def device_gaps(kernels: Sequence[Any], repeats: int) -> dict[str, Any]:
    """Where the GPU sat idle between kernels: ``idle_ms`` per call (the gaps summed), and the ``GAPS_TOP`` longest
    gaps with the kernels on either side (a host-bound forward idles everywhere; a stall idles at one place)."""
    gaps = []
    last = None  # the kernel that ends last so far (kernels on other streams may overlap)
    for kernel in sorted(kernels, key=lambda e: e.time_range.start):
        if last is not None and kernel.time_range.start > last.time_range.end:
            gaps.append((kernel.time_range.start - last.time_range.end, last.name, kernel.name))
        if last is None or kernel.time_range.end > last.time_range.end:
            last = kernel
    top = sorted(gaps, reverse=True)[:GAPS_TOP]
    return {
        "idle_ms": sum(gap for gap, _, _ in gaps) / repeats / 1e3,
        "gaps_top_us": [{"us": gap, "after": before[:80], "before": after[:80]} for gap, before, after in top],
    }


def make_backend(variant: str, settings: Settings) -> Any:
    if variant in ("inductor", "handwritten_sp"):
        return "inductor"
    return hcpasses.backend(sp_rewrite=variant == "hcpasses_sp", sp_min_tokens=settings.sp_min_tokens)


def pass_summary(backend: Any) -> dict[str, Any]:
    """What hcpasses did: whether SP sharded a graph, the passes' own seconds, applied counts (none for Inductor)."""
    if isinstance(backend, str):
        return {}
    reports = backend.reports
    return {
        "sp_applied": any(r.record("sp_rewrite").applied > 0 for r in reports if r.passes),
        "passes_s": sum(record.seconds for r in reports for record in r.passes),
        "applied": [r.applied for r in reports],
        "graphs": len(reports),
        # the whole report of every graph: why a pass did not apply is in it, not only that it did not
        "reports": [str(r) for r in reports],
    }


def run_variant(
    model: nn.Module, variant: str, ids: torch.Tensor, settings: Settings, ledger: CommLedger, trace: Path | None = None
) -> dict[str, Any]:
    """Compile (first call), warm up, time and profile one variant on ``ids``; one more call for the ledger."""
    torch._dynamo.reset()
    backend = make_backend(variant, settings)
    target = handwritten_sp(model) if variant == "handwritten_sp" else model
    compiled = torch.compile(target, backend=backend, dynamic=False)
    device = settings.device

    def step() -> torch.Tensor:
        return compiled(input_ids=ids, logits_to_keep=1).logits

    with torch.no_grad():
        began = time.perf_counter()
        logits = step()
        sync(device)
        compile_s = time.perf_counter() - began
        for _ in range(settings.warmup):
            step()
        allocs_before = device_allocs(device)
        times = wall_ms(step, settings.repeats, device)
        allocs = {k: (v - allocs_before[k]) / settings.repeats for k, v in device_allocs(device).items()}
        kernels = profiled(step, settings.repeats, device, trace)
        ledger.clear()
        step()
    comm = CommModel(settings.link_gbps)
    row = {"compile_s": compile_s, "wall_ms": statistics.median(times), "wall_times_ms": times, **kernels}
    row["allocator_per_call"] = allocs
    row |= {"collectives": ledger.counts(), "collective_bytes": ledger.bytes_by_kind()}
    row |= {"comm_ms": comm.ms(ledger.calls), "estimated_ms": kernels["compute_ms"] + comm.ms(ledger.calls)}
    row |= pass_summary(backend)
    if variant == "handwritten_sp":
        row["sp_applied"] = target.size > 1
    row["logits"] = logits.float().cpu()
    return row


def hc_chain_times(model: nn.Module, name: str, tokens: int, tp: int, settings: Settings) -> dict[str, float]:
    """Kernel ms of the model's HC chain on T rows and on ceil(T/tp) rows."""
    torch._dynamo.reset()
    chain = (QwenHCChain if name == "qwen4_exp" else DeepseekHCChain)(model)
    compiled = torch.compile(chain, dynamic=True)
    hidden = model.config.hidden_size
    dtype = model.model.embed_tokens.weight.dtype
    out = {}
    for label, rows in (("unsharded", tokens), ("sharded", -(-tokens // tp))):
        h = chain.streams(rows, hidden, dtype, settings.device)
        y = torch.randn(1, rows, hidden, dtype=dtype, device=settings.device)

        def step(h: torch.Tensor = h, y: torch.Tensor = y) -> tuple[torch.Tensor, ...]:
            return compiled(h, y)

        with torch.no_grad():
            for _ in range(settings.warmup + 1):
                step()
            out[f"{label}_kernel_ms"] = profiled(step, settings.repeats, settings.device)["compute_ms"]
    out["hc_sharded_ratio"] = out["sharded_kernel_ms"] / out["unsharded_kernel_ms"]
    return out


def hc_bound(hc: dict[str, float], sp_off_compute_ms: float, tp: int) -> dict[str, float]:
    """HC share of ``sp_off``'s kernel time and the most sharding the HC work could save: share * (1 - 1/tp)."""
    share = hc["unsharded_kernel_ms"] / sp_off_compute_ms
    return {"hc_share": share, "hc_bound": share * (1 - 1 / tp)}


def compare_logits(rows: dict[str, dict[str, Any]]) -> None:
    """Replace each variant's logits by their largest difference from ``inductor``'s (relative to its max).

    None where SP sharded (hcpasses or by hand): the stand-in all-gather returns copies of this rank's rows, so the kept
    last token's logits are those of another row (the values are realistic, not the model's; DESIGN §11)."""
    reference = rows.get("inductor", {}).get("logits")
    for row in rows.values():
        logits = row.pop("logits", None)
        if reference is not None and logits is not None:
            diff = float((logits - reference).abs().max() / reference.abs().max())
            row["rel_diff_vs_inductor"] = None if row.get("sp_applied") else diff


# ------------------------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    tp: int
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} tp{self.tp} T={self.tokens}"

    @property
    def stem(self) -> str:
        """The case in a file name."""
        return f"{self.model}_{self.dtype}_tp{self.tp}_T{self.tokens}"


def input_ids(tokens: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randint(2, vocab, (1, tokens), generator=gen).to(device)


def run_case(model: nn.Module, case: Case, settings: Settings, ledger: CommLedger) -> dict[str, Any]:
    """Every variant at one T, then the HC chain; a variant that raises is recorded, the others still run."""
    ids = input_ids(case.tokens, model.config.vocab_size, settings.device)
    variants: dict[str, dict[str, Any]] = {}
    for variant in settings.variants:
        trace = None if settings.trace_dir is None else settings.trace_dir / f"trace_{case.stem}_{variant}.json"
        variants[variant] = guarded(lambda v=variant, t=trace: run_variant(model, v, ids, settings, ledger, t))
        if "kernels" in variants[variant]:
            variants[variant]["kernels_per_layer"] = variants[variant]["kernels"] / settings.n_layers(case.model)
        summary = {
            k: variants[variant].get(k) for k in ("compile_s", "wall_ms", "compute_ms", "kernel_ms", "kernels", "error")
        }
        log(f"{case.label} {variant}: {json.dumps(summary, default=str)}")
        release(settings.device)
    compare_logits(variants)
    row: dict[str, Any] = {**asdict(case), "variants": variants}
    if ratios := vs_handwritten(variants):
        row["hcpasses_vs_handwritten"] = ratios
    hc = guarded(lambda: hc_chain_times(model, case.model, case.tokens, case.tp, settings))
    row["hc_chain"] = hc
    if "kernel_ms" in variants.get("sp_off", {}) and "error" not in hc:
        row |= hc_bound(hc, variants["sp_off"]["compute_ms"], case.tp)
        row |= sp_gains(variants, row["hc_bound"])
    log(f"{case.label} HC chain: {json.dumps({k: row.get(k) for k in ('hc_share', 'hc_bound')})}")
    return row


def sp_gains(variants: dict[str, dict[str, Any]], bound: float) -> dict[str, float]:
    """What ``hcpasses_sp`` saves over ``sp_off``: the compute gain (fraction of SP off's compute ms), that gain over
    the HC-only bound, and the wall gain over the kernel gain (1: the host does not set the pace); empty unless both
    ran."""
    off, sp = variants.get("sp_off", {}), variants.get("hcpasses_sp", {})
    if "compute_ms" not in off or "compute_ms" not in sp:
        return {}
    gain = 1 - sp["compute_ms"] / off["compute_ms"]
    # Host-bound or not: wall and kernel time both include the stand-ins' copies, so compare those two gains.
    wall_gain, kernel_gain = 1 - sp["wall_ms"] / off["wall_ms"], 1 - sp["kernel_ms"] / off["kernel_ms"]
    if bound <= 0 or gain == 0 or kernel_gain == 0:  # tp 1: nothing to shard, no bound to be a fraction of
        return {"sp_compute_gain": gain}
    return {
        "sp_compute_gain": gain,
        "sp_gain_of_bound": gain / bound,
        "sp_wall_over_kernel_gain": wall_gain / kernel_gain,
    }


def vs_handwritten(variants: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Hand-written SP's kernel and wall ms over ``hcpasses_sp``'s (above 1: hcpasses is faster); empty unless both
    ran."""
    hand, auto = variants.get("handwritten_sp", {}), variants.get("hcpasses_sp", {})
    if not hand or not auto or "error" in hand or "error" in auto:
        return {}
    return {key: hand[key] / auto[key] for key in ("compute_ms", "kernel_ms", "wall_ms")}


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or its error (type, message, traceback tail) when it raises."""
    try:
        return fn()
    except Exception as error:  # recorded per case: one failure must not end a time-limited run
        return {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def release(device: torch.device) -> None:
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cases(settings: Settings) -> Iterator[tuple[str, str, int, tuple[Case, ...]]]:
    """(model, dtype, tp, that model's cases at every T): one model build serves all of its T."""
    for name in settings.models:
        for dtype in settings.dtypes:
            for tp in settings.tps:
                yield name, dtype, tp, tuple(Case(name, dtype, tp, tokens) for tokens in settings.tokens)


def run(settings: Settings, path: Path, command: str) -> dict[str, Any]:
    """Every case, the JSON at ``path`` rewritten after each; ``command`` is recorded in its header."""
    report = header(settings, command)
    on = settings.eager_kernels
    kernels = eager_kernels_under_compile(settings.qsa_batched) if on else contextlib.nullcontext({})
    with kernels as patched:
        report["patched"] = patched
        run_cases(settings, path, report)
    return report


def run_cases(settings: Settings, path: Path, report: dict[str, Any]) -> None:
    for name, dtype, tp, group in cases(settings):
        with simulated_tp(tp, settings.rank) as ledger:
            log(f"building {name} {dtype} tp{tp} ({settings.n_layers(name)} layers)")
            model = guarded(lambda n=name, d=dtype, t=tp: {"model": prepare(n, d, t, settings)})
            for case in group:
                if "error" in model:
                    report["cases"].append({**asdict(case), "error": model["error"], "traceback": model["traceback"]})
                else:
                    report["cases"].append(run_case(model["model"], case, settings, ledger))
                write(report, path)
            del model
            release(settings.device)


def commit() -> str | None:
    """The checkout's commit, with ``+dirty`` for uncommitted changes; None where git or the repository is missing
    (the device machine gets a copy of the working tree, perhaps without ``.git``)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def header(settings: Settings, command: str) -> dict[str, Any]:
    on_gpu = settings.device.type == "cuda"
    return {
        "date": datetime.date.today().isoformat(),
        # which of one day's runs is newer, which code it ran and how (prefill_hf_grid.py picks each cell's newest)
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (smoke)",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "fla": importlib.util.find_spec("fla") is not None,
        "settings": asdict(settings),
        "comm_model": {"link_gbps": settings.link_gbps, "algorithm": "ring, no overlap"},
        "method": __doc__,
        "cases": [],
    }


def write(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))


def table(report: dict[str, Any]) -> str:
    """One line per case and variant."""
    lines = [
        f"{'case':<36} {'variant':<14} {'wall ms':>9} {'compute ms':>10} {'kernels':>8} {'comm ms':>8} "
        f"{'est ms':>9} {'compile s':>9}  sp"
    ]
    for case in report["cases"]:
        label = f"{case['model']} {case['dtype']} tp{case['tp']} T={case['tokens']}"
        if "error" in case:
            lines.append(f"{label:<36} error: {case['error'][:80]}")
            continue
        for variant, row in case["variants"].items():
            if "error" in row:
                lines.append(f"{label:<36} {variant:<14} error: {row['error'][:70]}")
                continue
            times = f"{row['wall_ms']:>9.2f} {row['compute_ms']:>10.2f} {row['kernels']:>8.0f} {row['comm_ms']:>8.3f}"
            tail = f"{row['estimated_ms']:>9.2f} {row['compile_s']:>9.1f}  {row.get('sp_applied', '')}"
            lines.append(f"{label:<36} {variant:<14} {times} {tail}")
        if "hcpasses_vs_handwritten" in case:
            ratios = case["hcpasses_vs_handwritten"]
            lines.append(
                f"{label:<36} hcpasses SP vs hand-written SP (hand-written ms / hcpasses ms): "
                f"compute {ratios['compute_ms']:.3f}x, wall {ratios['wall_ms']:.3f}x"
            )
        if "hc_bound" in case:
            lines.append(
                f"{label:<36} HC share {case['hc_share']:.3f}, bound {case['hc_bound']:.3f}, "
                f"sharded/unsharded {case['hc_chain']['hc_sharded_ratio']:.3f}"
            )
        if "sp_gain_of_bound" in case:
            lines.append(
                f"{label:<36} SP compute gain {case['sp_compute_gain']:.3f} = {case['sp_gain_of_bound']:.2f} of the "
                f"bound; wall gain / kernel gain {case['sp_wall_over_kernel_gain']:.2f}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def choice_list(text: str, allowed: Sequence[str], parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in text.split(","))
    if set(items) - set(allowed):
        parser.error(f"{flag} must be a subset of {','.join(allowed)}, got {text!r}")
    return items


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tp", default=None, help="simulated TP sizes (default 1,2,4,8; smoke 1,2)")
    parser.add_argument("--tokens", default=None, help="T list (default 16384,65536; smoke 32)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default qwen4_exp 4, deepseek_v4 2; smoke 2, 1)"
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank each simulated group's process plays")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls after the first (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 5)")
    parser.add_argument("--sp-min-tokens", type=int, default=None, help="hcpasses threshold (default 1024)")
    parser.add_argument("--link-gbps", type=float, default=NVLINK_GBPS_PER_DIRECTION, help="comm model GB/s each way")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models, tiny T, CPU")
    parser.add_argument(
        "--as-traced",
        action="store_true",
        help="run without hcpasses.hf.eager_kernels_under_compile (GatedDeltaNet as Dynamo traces it)",
    )
    parser.add_argument(
        "--qsa-batched",
        action="store_true",
        help="qwen4_exp's QSA token selection for all queries at once (opt-in: ties may break otherwise; README)",
    )
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument(
        "--trace", type=Path, default=None, help="write each variant's profile there as a Chrome trace (JSON)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    settings = Settings(
        models=choice_list(args.models, MODELS, parser, "--models"),
        tps=int_list(args.tp or ("1,2" if smoke else "1,2,4,8")),
        tokens=int_list(args.tokens or ("32" if smoke else "16384,65536")),
        dtypes=choice_list(args.dtypes, DTYPES, parser, "--dtypes"),
        variants=choice_list(args.variants, VARIANTS, parser, "--variants"),
        layers=args.layers,
        rank=args.rank,
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 2),
        repeats=args.repeats or (2 if smoke else 5),
        sp_min_tokens=args.sp_min_tokens or (16 if smoke else 1024),
        link_gbps=args.link_gbps,
        smoke=smoke,
        eager_kernels=not args.as_traced,
        trace_dir=args.trace,
        qsa_batched=args.qsa_batched,
    )
    stem = f"{'smoke_' if smoke else ''}prefill_hf{'_' + args.tag if args.tag else ''}"
    return settings, args.out / f"{stem}.json"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    settings, path = parse_args(args)
    if not settings.smoke and not torch.cuda.is_available():
        raise SystemExit("prefill_hf: needs a GPU (or --cpu-smoke)")
    if settings.smoke:
        torch.set_num_threads(1)
    log(f"prefill_hf: {json.dumps(asdict(settings), default=str)} -> {path}")
    report = run(settings, path, " ".join(["python benchmarks/prefill_hf.py", *args]))
    print(table(report))
    plotted = prefill_hf_grid.plot(prefill_hf_grid.newest(prefill_hf_grid.load([path])), path.with_suffix(".png"))
    print(f"wrote {path}" + (" and .png" if plotted else " (no plot: matplotlib is missing)"))


if __name__ == "__main__":
    main()

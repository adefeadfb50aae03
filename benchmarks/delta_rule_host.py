"""Host time of one chunked gated delta rule call, level by level: where a host-bound qwen4_exp prefill spends it.

    PYTHONPATH=/tmp/site_fla:/tmp/site:. python benchmarks/delta_rule_host.py --out delta_rule_host.json   # GPU, fla
    python benchmarks/delta_rule_host.py --cpu-smoke --out /tmp/smoke.json     # CPU: the plumbing, tiny sizes

Why: the compiled 3-layer real-size qwen4_exp forward is host-bound (docs/BENCHMARKS.md): the GPU idles between
flash-linear-attention's kernels while fla's Python launch path (3.4-5.8 ms of host time per forward under the
profiler) runs. This measures one call of the delta rule at the shapes one rank of qwen4_exp runs (B = 1, T tokens,
16 / tp key heads and 32 / tp value heads of 128, bf16 q/k/v/beta, fp32 g, ``use_qk_l2norm_in_kernel=True``, no
state, under ``torch.no_grad()`` as the benchmark runs), from the outermost caller inwards:

- ``hcpasses_op``: ``torch.ops.hcpasses.chunk_gated_delta_rule`` (what a compiled graph calls, ``hcpasses.hf``);
- ``transformers``: qwen4_exp's ``torch_chunk_gated_delta_rule`` (fla's function where fla is installed, else the
  torch reference);
- ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (its backend dispatch, ``torch.compiler.disable``,
  the autograd function and its input guard around the kernels);
- ``fla_kernels``: fla's internal forward alone: two ``l2norm_fwd`` and ``chunk_gated_delta_rule_fwd``, the
  kernels without the layers around them (an internal API, read here to size those layers, not called by hcpasses);
- ``fla_one_kernel``: one ``l2norm_fwd`` (a single Triton launch through fla's wrapper).

Per level: ``host_us`` (median over ``--repeats`` calls of the time until the call returns, each started with the
GPU idle: what the host spends launching), ``gpu_us`` (CUDA events around the same calls), ``back_to_back_us``
(``--repeats`` calls with no synchronisation, per call: the larger of host and GPU sets it), ``host_bound`` (host
above GPU time) and the kernels per call (``torch.profiler``). The fla levels need fla and CUDA and are left out,
with the reason, where either is missing. Every level's output must equal the outermost level's (the run stops
otherwise), except ``fla_one_kernel``'s, which is one l2norm of q and not the rule's. ``--cpu-smoke``: tiny sizes
on CPU, the torch reference levels only: the plumbing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from prefill_hf import profiled, sync

import hcpasses.hf.delta_rule_op  # noqa: F401  # registers torch.ops.hcpasses.chunk_gated_delta_rule

MODULE = "transformers.models.qwen4_exp.modeling_qwen4_exp"
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 32, 128  # qwen4_exp's real config (linear_num_key_heads, ...)
SMOKE = {"tokens": 128, "key_heads": 2, "value_heads": 4, "head_dim": 8}
# levels that run a part of the delta rule (one l2norm of q): their output is not the rule's, so it is not checked
PART_LEVELS = frozenset({"fla_one_kernel"})

Inputs = tuple[torch.Tensor, ...]


def make_inputs(tokens: int, key_heads: int, value_heads: int, head_dim: int, device: torch.device) -> Inputs:
    """q, k, v, g, beta as qwen4_exp's GatedDeltaNet hands them to the delta rule (random, not zeros)."""
    bf16 = torch.bfloat16
    query = torch.randn(1, tokens, key_heads, head_dim, device=device, dtype=bf16)
    key = torch.randn(1, tokens, key_heads, head_dim, device=device, dtype=bf16)
    value = torch.randn(1, tokens, value_heads, head_dim, device=device, dtype=bf16)
    # g = -exp(A_log) * softplus(a + dt_bias) in fp32 (log decay < 0); beta = sigmoid(b) in bf16
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, value_heads, device=device)) * 0.5
    beta = torch.rand(1, tokens, value_heads, device=device, dtype=bf16)
    return query, key, value, g, beta


def levels(device: torch.device) -> tuple[dict[str, Callable[[Inputs], torch.Tensor]], dict[str, str]]:
    """The callers to time, outermost first, and the reason for each level left out."""
    module = importlib.import_module(MODULE)
    chosen: dict[str, Callable[[Inputs], torch.Tensor]] = {
        "hcpasses_op": lambda x: torch.ops.hcpasses.chunk_gated_delta_rule(MODULE, *x, None, False, True, None)[0],
        "transformers": lambda x: module.torch_chunk_gated_delta_rule(
            *x[:3], g=x[3], beta=x[4], use_qk_l2norm_in_kernel=True
        )[0],
    }
    left_out: dict[str, str] = {}
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError as error:
        reason = f"flash-linear-attention not importable: {error}"
        return chosen, dict.fromkeys(("fla", "fla_kernels", "fla_one_kernel"), reason)
    if device.type != "cuda":
        return chosen, dict.fromkeys(("fla", "fla_kernels", "fla_one_kernel"), "fla's kernels run on CUDA only")

    def kernels_alone(x: Inputs) -> torch.Tensor:
        query, key, value, g, beta = x
        query, _ = l2norm_fwd(query)
        key, _ = l2norm_fwd(key)
        out = chunk_gated_delta_rule_fwd(
            q=query, k=key, v=value, g=g, beta=beta, scale=query.shape[-1] ** -0.5, initial_state=None,
            output_final_state=False,
        )[1]  # fmt: skip
        return out.to(query.dtype)

    chosen["fla"] = lambda x: chunk_gated_delta_rule(*x[:3], g=x[3], beta=x[4], use_qk_l2norm_in_kernel=True)[0]
    chosen["fla_kernels"] = kernels_alone
    chosen["fla_one_kernel"] = lambda x: l2norm_fwd(x[0])[0]
    return chosen, left_out


def timed(call: Callable[[], Any], repeats: int, device: torch.device) -> dict[str, Any]:
    """Host and GPU microseconds per call (each call from an idle GPU), and per call back to back."""
    host, gpu = [], []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        call()
        host.append((time.perf_counter() - began) * 1e6)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
    sync(device)
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    sync(device)
    back_to_back = (time.perf_counter() - began) * 1e6 / repeats
    host_us = statistics.median(host)
    gpu_us = statistics.median(gpu) if gpu else None
    return {
        "host_us": round(host_us, 1),
        "gpu_us": None if gpu_us is None else round(gpu_us, 1),
        "back_to_back_us": round(back_to_back, 1),
        "host_bound": gpu_us is not None and host_us > gpu_us,
    }


def run_case(
    tp: int,
    tokens: int,
    shape: dict[str, int],
    device: torch.device,
    warmup: int,
    repeats: int,
    measured: Callable[[dict[str, Any], str], None] | None = None,
) -> dict[str, Any]:
    """Every level at one shape; ``measured(case, level)`` after each level (the case so far)."""
    x = make_inputs(tokens, shape["key_heads"], shape["value_heads"], shape["head_dim"], device)
    chosen, left_out = levels(device)
    case: dict[str, Any] = {"tp": tp, "tokens": tokens, **shape, "levels": {}, "left_out": left_out}
    reference = None
    for name, level in chosen.items():
        for _ in range(warmup):  # Triton compiles and autotunes on the first calls
            out = level(x)
        if reference is None:
            reference = out
        elif name not in PART_LEVELS and not torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
            raise SystemExit(f"{name}'s output differs from {next(iter(chosen))}'s by {(out - reference).abs().max()}")
        case["levels"][name] = {
            **timed(lambda level=level: level(x), repeats, device),
            "kernels": profiled(lambda level=level: level(x), 3, device)["kernels"],
        }
        if measured is not None:
            measured(case, name)
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the plumbing only")
    parser.add_argument("--tp", default="1,8", help="tp sizes: each rank's heads are 16 / tp and 32 / tp")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs CUDA (or --cpu-smoke)")
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "cases": [],
    }

    def measured(case: dict[str, Any], name: str) -> None:
        # each level printed and kept as it is measured: a time-limited call that ends the run keeps what it got
        if not any(known is case for known in result["cases"]):
            result["cases"].append(case)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"tp {case['tp']} T {case['tokens']} {name}: {case['levels'][name]}")

    for tp in (int(t) for t in args.tp.split(",")):
        if args.cpu_smoke:
            tokens, shape = SMOKE["tokens"], {k: v for k, v in SMOKE.items() if k != "tokens"}
        else:
            if KEY_HEADS % tp:
                parser.error(f"--tp {tp}: qwen4_exp's {KEY_HEADS} key heads do not split over it")
            tokens = args.tokens
            shape = {"key_heads": KEY_HEADS // tp, "value_heads": VALUE_HEADS // tp, "head_dim": HEAD_DIM}
        with torch.no_grad():
            run_case(tp, tokens, shape, device, args.warmup, args.repeats, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())

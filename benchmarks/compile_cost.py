"""Compile cost of the hcpasses passes against Inductor's compile of the same graph (issue #26: all passes together
stay within 10 % of it on the real-size models).

For each model: the first call under ``torch.compile`` with plain Inductor and with ``hcpasses.backend()`` (caches
off, so each compiles from scratch), minus one eager call (the first call also runs the model); the passes' own
time is the sum of every pass's time in the hcpasses reports (the reports are kept in the JSON, with the
evaluation's notes). Runs on CPU (the passes are device-independent Python over the FX graph;
Inductor's CPU codegen is not its CUDA one, so the ratio is against this device's compile).

    python benchmarks/compile_cost.py --models qwen4_exp deepseek_v4 --tokens 64 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

import hcpasses
from hcpasses.testing.hf_models import real_deepseek_v4, real_qwen4_exp

BUILDERS: dict[str, Callable[[int], torch.nn.Module]] = {
    "qwen4_exp": lambda layers: real_qwen4_exp(num_layers=layers),
    "deepseek_v4": lambda layers: real_deepseek_v4(num_layers=layers),
}
GOAL = 0.10  # passes' time / Inductor's compile time, at most


def first_call_s(model: torch.nn.Module, ids: torch.Tensor, backend: Any) -> float:
    """Wall time of the first call of ``model`` compiled with ``backend`` (compile + one run), caches off."""
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        started = time.perf_counter()
        torch.compile(model, backend=backend)(ids)
        return time.perf_counter() - started


def eager_s(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        model(ids)  # warm
        started = time.perf_counter()
        model(ids)
        return time.perf_counter() - started


def measure(name: str, layers: int, tokens: int) -> dict[str, Any]:
    model = BUILDERS[name](layers)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    run_s = eager_s(model, ids)
    inductor_s = first_call_s(model, ids, "inductor") - run_s
    backend = hcpasses.backend()
    with_passes_s = first_call_s(model, ids, backend) - run_s
    passes = [record for report in backend.reports for record in report.passes]
    passes_ms = sum(record.seconds * 1e3 for record in passes)
    per_pass: dict[str, float] = {}
    for record in passes:
        per_pass[record.name] = per_pass.get(record.name, 0.0) + record.seconds * 1e3
    return {
        "model": name,
        "layers": layers,
        "tokens": tokens,
        "graphs": len(backend.reports),
        "inductor_compile_s": round(inductor_s, 2),
        "hcpasses_compile_s": round(with_passes_s, 2),
        "passes_ms": round(passes_ms, 1),
        "per_pass_ms": {k: round(v, 1) for k, v in per_pass.items()},
        "passes_over_inductor": round(passes_ms / 1e3 / inductor_s, 4),
        "goal_met": passes_ms / 1e3 / inductor_s <= GOAL,
        "report": [str(report) for report in backend.reports],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--layers", type=int, default=4, help="qwen4_exp layers (deepseek_v4: 1)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "runs": [],
    }
    for name in args.models:
        result = measure(name, args.layers if name == "qwen4_exp" else 1, args.tokens)
        print({k: v for k, v in result.items() if k != "report"}, flush=True)
        results["runs"].append(result)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()

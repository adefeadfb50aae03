"""Kernel time of a long running max with and without the ``blocked_scans`` pass, side by side in one process.

    PYTHONPATH=. python benchmarks/blocked_scans.py --out benchmarks/results/blocked_scans_h200.json        # GPU
    python benchmarks/blocked_scans.py --cpu-smoke --out /tmp/smoke.json     # CPU: the plumbing, tiny sizes

The scan is qwen4_exp's n-gram hashing's (``_shift_right_ignore_eos``): ``cummax(where(history == eos, positions,
-1), dim=1).values`` over the token history (``cat`` of a 2-id EOS history and ``[batch, length]`` int64 ids, as
transformers builds it: the ``cat`` changes how Inductor classifies the scan), then one pointwise user. Variants, each
compiled with ``fullgraph=True`` and static shapes: ``inductor`` (plain Inductor), ``off`` (``hcpasses.backend(
blocked_scans=False)``), ``blocked`` (``hcpasses.backend()``). Every variant's values must equal eager's bit for bit
(the run stops otherwise). Per case and variant: ``kernel_ms`` (device time of all kernels per call over
``--repeats`` calls, measured as ``prefill_hf.profiled`` measures it), the kernels per call and the names with the
most time, whether the pass applied (from the hcpasses report), and ``aten_scans``: each ATen scan the compiled
code calls, with the shape of what it scans (a blocked scan that Inductor still sends to ATen shows here which
level went: ``[rows, blocks, block]`` the blocks, ``[rows, blocks]`` the carry). ``--cpu-smoke`` runs the same on CPU
at tiny sizes, where the pass does not apply (Inductor scans with ATen on CPU) and kernel times are CPU ops' self
times: it checks the plumbing only.

``--source ngram`` scans with transformers' own code instead of this file's copy: ``Qwen4ExpTextNGramEmbedding``
(qwen4_exp's PLE n-gram hashing, real config; tiny with ``--cpu-smoke``) on ``[batch, length]`` ids, which it
extends by its 2-id history, scans twice (one shift each, of the same EOS positions) and embeds; run under
``torch.no_grad()`` as inference is. (On the H200, 2026-12-05, a copy without the ``cat`` ran every level in Triton
while the real module sent its blocks of 1024 to ATen: this source is how that was found.)
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from prefill_hf import profiled
from torch._inductor.utils import run_and_get_code

import hcpasses
from hcpasses.testing import hf_models

EOS = 0
GPU_CASES = ((1, 16384), (1, 65536), (8, 2048), (1, 262144))  # T; the scan is T + the history's 2 ids
SMOKE_CASES = ((1, 300), (2, 50))
HISTORY = 2  # ids of context qwen4_exp keeps before the prompt (ngram_size - 1)


def eos_scan(ids: torch.Tensor) -> torch.Tensor:
    history = torch.cat([ids.new_full((ids.shape[0], HISTORY), EOS), ids], dim=1)
    positions = torch.arange(history.shape[1], device=ids.device)
    previous_eos = torch.cummax(torch.where(history == EOS, positions, -1), dim=1).values
    return positions - previous_eos  # a user of the values, as the hashing's position in the segment


def ngram_hashing(device: torch.device, smoke: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' qwen4_exp n-gram embedding (its ``_shift_right_ignore_eos`` scans), as one function of the ids."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    fields = hf_models.QWEN4_EXP_TINY if smoke else {**hf_models.QWEN4_EXP_REAL, **hf_models.QWEN4_EXP_INDEXER}
    config = Qwen4ExpTextConfig(**{**fields, "eos_token_id": EOS})
    with torch.device(device):
        module = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0).eval()
    return lambda ids: module(ids, None)


def compiled(variant: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Callable[..., Any], Any]:
    torch._dynamo.reset()
    if variant == "inductor":
        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False), None
    be = hcpasses.backend(blocked_scans=variant == "blocked")
    return torch.compile(fn, backend=be, fullgraph=True, dynamic=False), be


ATEN_SCAN = re.compile(  # the scanned buffer, named, or through a view with its own shape
    r"^\s*\w+ = torch\.ops\.aten\.(cummax|cummin)\.default\((?:reinterpret_tensor\((\w+), (\([^)]*\)))?(\w+)?"
)
SHAPE = re.compile(r"^\s*(?:(\w+) = empty_strided\w*\(|assert_size_stride\((\w+), )(\([^)]*\))")


def aten_scans(code: str) -> list[dict[str, str]]:
    """The ATen scans ``code`` (Inductor's output code) calls, each with the shape of the buffer or input it scans
    (a view's own shape, else that buffer's allocation or first size assertion); comments, which name the FX nodes,
    do not count."""
    lines = code.splitlines()
    shapes: dict[str, str] = {}
    for match in filter(None, map(SHAPE.match, lines)):
        shapes.setdefault(match[1] or match[2], match[3])
    return [
        {"op": match[1], "scans": match[2] or match[4], "shape": match[3] or shapes.get(match[4], "?")}
        for match in filter(None, map(ATEN_SCAN.match, lines))
    ]


def kernel_times(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float, dict[str, float]]:
    """Kernel ms per call, kernels per call and the names with the most ms (GPU only): ``prefill_hf.profiled``."""
    kernels = profiled(fn, repeats, device)
    by_name = dict(list(kernels.get("kernel_ms_by_name", {}).items())[:6])
    return kernels["kernel_ms"], kernels["kernels"], by_name


def run_case(
    batch: int, length: int, device: torch.device, warmup: int, repeats: int, scan: Callable[[torch.Tensor], Any]
) -> dict[str, Any]:
    ids = torch.randint(0, 50, (batch, length), device=device)
    want = scan(ids)
    row: dict[str, Any] = {"batch": batch, "length": length}
    for variant in ("inductor", "off", "blocked"):
        fn, be = compiled(variant, scan)
        got, code = run_and_get_code(fn, ids)
        if not torch.equal(got, want):
            raise SystemExit(f"{variant} at [{batch}, {length}]: values differ from eager")
        for _ in range(warmup):
            fn(ids)
        ms, kernels, by_name = kernel_times(lambda fn=fn: fn(ids), device, repeats)
        applied = be.reports[0].applied.get("blocked_scans", 0) if be is not None else None
        row[variant] = {
            "kernel_ms": round(ms, 4),
            "kernels": kernels,
            "by_name": by_name,
            "applied": applied,
            "aten_scans": aten_scans("\n".join(code)),
        }
    row["off_over_blocked"] = round(row["off"]["kernel_ms"] / max(row["blocked"]["kernel_ms"], 1e-9), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the plumbing only")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", default=None, help="BATCHxLENGTH,... (default: the four GPU cases)")
    parser.add_argument("--source", choices=("copy", "ngram"), default="copy", help="this file's scan or transformers'")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs CUDA (or --cpu-smoke)")
    torch.manual_seed(0)
    scan = eos_scan if args.source == "copy" else ngram_hashing(device, args.cpu_smoke)
    result: dict[str, Any] = {
        "source": args.source,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "cases": [],
    }
    chosen = SMOKE_CASES if args.cpu_smoke else GPU_CASES
    if args.cases:
        chosen = tuple(tuple(int(n) for n in case.split("x")) for case in args.cases.split(","))
    for batch, length in chosen:
        with torch.no_grad():
            result["cases"].append(run_case(batch, length, device, args.warmup, args.repeats, scan))
        args.out.write_text(json.dumps(result, indent=1))  # kept so far, should a time-limited call end it
        case = result["cases"][-1]
        print(
            f"[{batch}, {length}] kernel ms: inductor {case['inductor']['kernel_ms']}, off {case['off']['kernel_ms']}, "
            f"blocked {case['blocked']['kernel_ms']} (applied {case['blocked']['applied']}); "
            f"off / blocked {case['off_over_blocked']}x; ATen scans left {case['blocked']['aten_scans']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

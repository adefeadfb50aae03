"""``python -m hcpasses.testing.demo``: the tiny reference HC model at TP 2 through the backend.

Starts ``--tp`` processes (gloo on CPU; NCCL when that many GPUs are present), builds the tiny
reference model on each, compiles it with ``hcpasses.backend(dump_dir=...)``, and prints rank 0's
report, the largest difference from a single-device eager run of the same weights, and where the
dumps are.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import hcpasses
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.testing.multiproc import run_ranks


@dataclass(frozen=True)
class DemoResult:
    reports: list[str]
    logits: torch.Tensor


def _demo_config(fp8: bool, ple_layer: int | None) -> HCConfig:
    return HCConfig.tiny(fp8=fp8, ple_layer=ple_layer, seed=1234)


def _rank_main(
    rank: int, world_size: int, ids: torch.Tensor, fp8: bool, ple: int | None, dumps: str, sp_min_tokens: int
) -> DemoResult:
    on_gpu = torch.cuda.is_available() and world_size <= torch.cuda.device_count()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    model = HCDecoder(_demo_config(fp8, ple)).to(device)
    be = hcpasses.backend(dump_dir=dumps, sp_min_tokens=sp_min_tokens)
    with torch.no_grad():
        logits = torch.compile(model, backend=be)(ids.to(device))
    return DemoResult([str(r) for r in be.reports], logits.float().cpu())


def run_demo(tp: int, tokens: int, fp8: bool, ple_layer: int | None, dump_dir: str, sp_min_tokens: int) -> float:
    """Run the demo, print what happened, return the max |compiled TP - eager single device|."""
    cfg = _demo_config(fp8, ple_layer)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = HCDecoder(cfg, tp_rank=0, tp_size=1)(ids).float()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= tp else "gloo"
    args = (ids, fp8, ple_layer, dump_dir, sp_min_tokens)
    results = run_ranks(_rank_main, tp, *args, backend=backend, timeout_s=600)
    max_diff = max(float((r.logits - reference).abs().max()) for r in results)
    print(
        f"hcpasses demo: tiny HC model (fp8={fp8}, ple_layer={ple_layer}), T={tokens}, TP {tp} over {backend}, "
        f"sp_min_tokens={sp_min_tokens}"
    )
    print("\nrank 0 reports:")
    for text in results[0].reports:
        print(text)
    print(f"\nmax |compiled TP{tp} - eager single device| over logits: {max_diff:.3e}")
    print(f"dumps: {Path(dump_dir).resolve()} (index.md per rank folder)")
    return max_diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hcpasses.testing.demo",
        description="compile the tiny reference HC model at TP 2 through hcpasses and print the report",
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (processes), default 2")
    parser.add_argument("--tokens", type=int, default=64, help="number of tokens T, default 64")
    parser.add_argument(
        "--fp8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per-token FP8 sub-layer input projections, so the gated-mean + quant fusion fires (default on)",
    )
    parser.add_argument("--ple-layer", type=int, default=None, help="layer index holding the PLE layer")
    parser.add_argument("--dump-dir", default=os.environ.get("HCPASSES_DUMP_DIR", "hcpasses_dumps"))
    parser.add_argument(
        "--sp-min-tokens", type=int, default=None, help="SP threshold (default: the demo's T, so SP fires)"
    )
    args = parser.parse_args(argv)
    if args.tp < 1 or args.tokens < 1:
        parser.error("--tp and --tokens must be >= 1")
    sp_min_tokens = args.sp_min_tokens if args.sp_min_tokens is not None else args.tokens
    max_diff = run_demo(args.tp, args.tokens, args.fp8, args.ple_layer, args.dump_dir, sp_min_tokens)
    tolerance = 1e-3
    if max_diff > tolerance:
        print(f"FAILED: difference {max_diff:.3e} exceeds {tolerance:.0e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

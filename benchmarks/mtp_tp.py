"""MTP drafter under TP on GPUs: fused vs separate target+drafter prefill, and the draft-step time.

Run from the repository root with one process per GPU (NCCL)::

    PYTHONPATH=. python benchmarks/mtp_tp.py --tp 2 --out benchmarks/results

Model: ``hcpasses.testing.models.HCDecoder`` at real per-layer sizes (``HCConfig.real``, bf16, ``--layers``
layers, no PLE) and its ``hcpasses.testing.models.MTPDrafter``, TP-sharded. Measured per rank with CUDA events
(ranks aligned by a barrier, warm-up calls first, medians; the slowest rank's median is reported):

- prefill at T tokens: ``prefill_target_and_drafter`` compiled as one function (the HC state stays
  row-sharded into the drafter) vs the target (returning its state) and the drafter compiled
  separately (the target's exit gathers the n*S-wide state), both with ``hcpasses.backend``;
- draft step: the drafter's forward on b tokens (b = decode batch: one new position per sequence, its
  KV cache left out) eager vs compiled with hcpasses vs compiled with ``cudagraphs=True``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_sp import log, time_calls  # the timing helpers of the SP benchmark

import hcpasses
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.testing.models.mtp import MTPDrafter, prefill_target_and_drafter
from hcpasses.testing.multiproc import run_ranks

REPEATS, WARMUP = 10, 3


def median_ms(step: Any, device: torch.device) -> float:
    for i in range(WARMUP):
        step(i)
    return statistics.median(time_calls(step, REPEATS, device))


def prefill_times(target: Any, drafter: Any, tokens: int, device: torch.device) -> dict[str, Any]:
    ids = torch.randint(0, 32000, (tokens,), device=device, generator=torch.Generator(device).manual_seed(tokens))
    nxt = torch.roll(ids, -1)
    fused_be, target_be, drafter_be = (hcpasses.backend(sp_min_tokens=1024) for _ in range(3))
    fused = torch.compile(lambda i, n: prefill_target_and_drafter(target, drafter, i, n), backend=fused_be)
    target_c = torch.compile(lambda i: target(i, return_hc_state=True), backend=target_be)
    drafter_c = torch.compile(drafter, backend=drafter_be)

    def separate(i: torch.Tensor, n: torch.Tensor) -> Any:
        logits, state = target_c(i)
        return (logits, *drafter_c(state, n))

    with torch.no_grad():
        a, b = fused(ids, nxt), separate(ids, nxt)
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
        row = {
            "tokens": tokens,
            "fused_ms": median_ms(lambda _: fused(ids, nxt), device),
            "separate_ms": median_ms(lambda _: separate(ids, nxt), device),
            "max_abs_diff": diff,
            "fused_facts": fused_be.reports[-1].record("sp_rewrite").facts,
            "target_facts": target_be.reports[-1].record("sp_rewrite").facts,
        }
    row["separate_over_fused"] = row["separate_ms"] / row["fused_ms"]
    return row


def draft_times(drafter: Any, cfg: HCConfig, batches: list[int], device: torch.device) -> list[dict[str, Any]]:
    compiled = torch.compile(drafter, backend=hcpasses.backend(), dynamic=True)
    graphed = torch.compile(drafter, backend=hcpasses.backend(cudagraphs=True), dynamic=True)
    rows = []
    with torch.no_grad():
        for b in batches:
            state = torch.randn(b, cfg.n_streams, cfg.hidden, device=device, dtype=cfg.dtype)
            nxt = torch.randint(0, cfg.vocab_size, (b,), device=device)
            row: dict[str, Any] = {"batch": b}
            for name, fn in (("eager", drafter), ("compiled", compiled), ("cudagraphs", graphed)):
                row[f"{name}_ms"] = median_ms(lambda _, fn=fn, s=state, i=nxt: fn(s.clone(), i.clone()), device)
            rows.append(row)
    return rows


def rank_main(rank: int, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    cfg = HCConfig.real(n_layers=args.layers)
    target = HCDecoder(cfg).to(device)
    drafter = MTPDrafter(cfg, target=target).to(device)
    log(rank, "built")
    prefill = [prefill_times(target, drafter, t, device) for t in args.tokens]
    log(rank, f"prefill {prefill}")
    draft = draft_times(drafter, cfg, args.batches, device)
    log(rank, f"draft {draft}")
    return {"prefill": prefill, "draft": draft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--timeout", type=float, default=560)
    args = parser.parse_args()
    per_rank = run_ranks(rank_main, args.tp, args, backend="nccl", timeout_s=args.timeout)
    slowest = per_rank[0]
    for other in per_rank[1:]:  # the slowest rank's median per row
        for kind in ("prefill", "draft"):
            for mine, theirs in zip(slowest[kind], other[kind], strict=True):
                for key, value in theirs.items():
                    if key.endswith("_ms"):
                        mine[key] = max(mine[key], value)
    for row in slowest["prefill"]:
        row["separate_over_fused"] = row["separate_ms"] / row["fused_ms"]
    summary = {
        "date": __import__("time").strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tp": args.tp,
        "layers": args.layers,
        **slowest,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"mtp_tp{args.tp}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

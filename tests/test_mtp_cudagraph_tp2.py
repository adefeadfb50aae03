"""A TP 2 decode step of the tiny MTP drafter captured as CUDA graphs over NCCL (issue #25 item 2).

``hcpasses.backend(cudagraphs=True)`` compiles the drafter's ``step`` (one all-reduce per HC block); each rank
makes the same calls in the same order, with a device sync and a barrier around each, as
``benchmarks/mtp_draft.py``'s capture guard does: the cudagraph trees warm up on a shape's first call, record
and replay on the second, replay on the third. Every replay must equal eager. Skipped without 2 GPUs; run on a
2-GPU machine with ``python -m pytest -q tests/test_mtp_cudagraph_tp2.py``. Not yet run (no 2-GPU machine lent).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hcpasses
from hcpasses.testing.models import HCConfig, MTPDrafter
from hcpasses.testing.multiproc import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, TP 2)"),
]

CONTEXT, BATCHES, CALLS = 16, (4, 1), 3  # largest batch first, as the benchmark captures


def settle(device: torch.device) -> None:
    """No NCCL work in flight on this rank, and both ranks at the same point."""
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)


def seeded_rows(rows: int, width: int, seed: int, device: torch.device) -> torch.Tensor:
    """The same rows on both ranks."""
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(device)


def rank_main(rank: int, world_size: int) -> list[float]:
    """Eager references first, then each batch's captured calls; the largest difference from eager per call."""
    device = torch.device("cuda", rank)
    cfg = HCConfig.tiny(seed=5)
    drafter = MTPDrafter(cfg).to(device)
    diffs = []
    with torch.no_grad():
        state = seeded_rows(CONTEXT, cfg.streams_width, 1, device)
        ids = torch.arange(1, CONTEXT + 1, device=device) % cfg.vocab_size
        _, _, cache = drafter.step(state, ids, drafter.empty_cache())
        inputs = {b: (seeded_rows(b, cfg.streams_width, b, device), ids[:b].clone(), cache) for b in BATCHES}
        eager = {b: drafter.step(*args)[:2] for b, args in inputs.items()}
        torch._dynamo.reset()
        be = hcpasses.backend(cudagraphs=True)
        step = torch.compile(drafter.step, backend=be, dynamic=True)
        for batch in BATCHES:
            for _ in range(CALLS):
                settle(device)
                got = [t.clone() for t in step(*inputs[batch])[:2]]
                diffs.append(max(float((g - e).abs().max()) for g, e in zip(got, eager[batch], strict=True)))
        settle(device)
        assert any(report.variant == "cudagraphs" for report in be.reports), [r.variant for r in be.reports]
        torch._dynamo.reset()  # frees the graphs before the process group is destroyed
        settle(device)
    return diffs


def test_tp2_decode_step_captured_and_replayed_matches_eager() -> None:
    per_rank = run_ranks(rank_main, 2, backend="nccl", timeout_s=600)
    for diffs in per_rank:
        assert len(diffs) == len(BATCHES) * CALLS
        # fp32, the same ops as eager; Inductor's fusions may round differently
        assert max(diffs) < 1e-4, diffs

"""``benchmarks/mtp_draft.py``: its command line quickly, and its ``--device cpu --tiny`` run end to end over gloo
(thorough: two processes compile every prefill and draft variant on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # prefill_sp imports its neighbours by bare name
from benchmarks import mtp_draft  # noqa: E402


def test_tiny_defaults_and_the_merged_options() -> None:
    settings, _ = mtp_draft.parse_args(["--device", "cpu", "--tiny"])
    assert (settings.layers, settings.ple_layer, settings.batches) == (2, 0, (1, 2, 4))
    assert settings.draft_calls == ("step", "forward") and settings.capture_guard
    # mtp_tp.py's old run: 2 layers, no PLE, the forward call only, no guard
    argv = ["--layers", "2", "--ple-layer", "-1", "--draft-calls", "forward", "--no-capture-guard"]
    settings, _ = mtp_draft.parse_args(argv)
    assert (settings.layers, settings.ple_layer, settings.draft_calls, settings.capture_guard) == (
        2,
        None,
        ("forward",),
        False,
    )
    with pytest.raises(SystemExit):
        mtp_draft.parse_args(["--draft-calls", "step,verify"])


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_cpu_tiny_run_end_to_end(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/mtp_draft.py", "--device", "cpu", "--tiny", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "smoke_mtp_draft_tp2.json").read_text())
    [prefill] = report["prefill"]
    assert prefill["tokens"] == 16 and prefill["ratio"] > 0
    assert [(row["call"], row["batch"]) for row in report["draft"]] == [
        (call, batch) for call in ("step", "forward") for batch in (1, 2, 4)
    ]
    for rank in report["per_rank"]:
        point = rank["prefill"]["16"]
        assert point["fused_vs_separate_max_abs_diff"] < 1e-4
        assert point["fused"]["sp_facts"] and point["separate"]["sp_facts"]
        for call in ("step", "forward"):
            for variant, result in rank["draft"][call].items():
                for row in result["batches"].values():
                    assert row["rel_diff_vs_eager"] < 1e-4, (call, variant, row)
            # the guard's aligned first calls ran for the cudagraphs variant only
            guarded = rank["draft"][call]["cudagraphs"]["batches"]
            assert all("capture_calls_s" in row for row in guarded.values())
            assert all("capture_calls_s" not in row for row in rank["draft"][call]["compiled"]["batches"].values())
    assert "forward" in done.stdout and "wrote" in done.stdout

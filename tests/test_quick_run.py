"""The quick run's skip list (tests/harness/quick_run.py: QUICK_RUN_SKIPS) names tests that exist: a renamed test
must not drop out of it silently (it would then run in the quick run, or a stale entry would hide nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.quick_run import QUICK_RUN_SKIPS

ROOT = Path(__file__).resolve().parents[1]


def test_every_quick_run_skip_names_a_collected_test() -> None:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ids = [line for line in collected if "::" in line]
    assert len(ids) > 400, collected[-5:]
    stale = [prefix for prefix in QUICK_RUN_SKIPS if not any(i.startswith(prefix) for i in ids)]
    assert not stale, stale

"""The quick run's skip list (tests/harness/quick_run.py: QUICK_RUN_SKIPS) names tests that exist: a renamed test
must not drop out of it silently (it would then run in the quick run, or a stale entry would hide nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.quick_run import QUICK_RUN_SKIPS, skipped_in_quick_run, stale_entries

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
    assert not stale_entries(ids), stale_entries(ids)
    # an entry with a wildcard leaves the other cases of its test in the quick run
    for entry in (e for e in QUICK_RUN_SKIPS if "[*" in e):
        family = [i for i in ids if i.startswith(entry.split("[", 1)[0] + "[")]
        assert any(skipped_in_quick_run(i) for i in family) and not all(map(skipped_in_quick_run, family)), entry


def test_an_entry_matches_by_prefix_and_its_star_stands_for_any_text() -> None:
    entry = next(e for e in QUICK_RUN_SKIPS if "[*-" in e)
    head, tail = entry.split("*", 1)
    assert skipped_in_quick_run(f"{head}anything{tail}") and skipped_in_quick_run(f"{head}x{tail}-more")
    assert not skipped_in_quick_run(f"{head}anything{tail[:-1]}?") and not skipped_in_quick_run(f"x{head}{tail}")
    assert skipped_in_quick_run(QUICK_RUN_SKIPS[0] + "[case]")  # "[" is literal, not a character class

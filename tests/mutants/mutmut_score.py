"""The mutation score of the pass infrastructure, measured by mutmut (configured in pyproject.toml's
``[tool.mutmut]``: which modules are mutated, which fast tests judge them).

    python tests/mutants/mutmut_score.py                 # every mutant (about 1200; see docs/TESTING.md)
    python tests/mutants/mutmut_score.py --sample        # the fixed sample CI runs (mutants numbered *0 and *5)
    python tests/mutants/mutmut_score.py --floor 90      # fail below this score (percent)

Runs ``mutmut run`` from the repository root (mutmut writes its copy to ``mutants/``, ignored by git), reads each
mutant's status back with ``mutmut results --all true``, and prints the score per module and the survivors, each
with its note from ``EQUIVALENT`` where one says why no test can kill it. Score = (killed + timeout) / mutants
run: a mutant that makes the tests hang is caught too. Exits 1 when the score is below ``--floor``.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ("*__mutmut_*0", "*__mutmut_*5")  # about a fifth of the mutants, the same ones every run
DETECTED = {"killed", "timeout"}
RESULT = re.compile(r"^\s+(\S+): (.+)$")

# Survivors no test can kill, one line each (mutmut's name: why the mutant computes what the original does).
# Names carry a number per function: an edit of the function renumbers them, so a stale line only loses its note.
EQUIVALENT: dict[str, str] = {}


def run_mutmut(patterns: tuple[str, ...], jobs: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs), *patterns], cwd=ROOT, check=False
    )


def statuses(patterns: tuple[str, ...]) -> dict[str, str]:
    """Status of every mutant of the last run that matches ``patterns`` (all when empty)."""
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        match = RESULT.match(line)
        if match and (not patterns or any(fnmatch.fnmatch(match[1], p) for p in patterns)):
            found[match[1]] = match[2]
    return found


def module_of(name: str) -> str:
    """``hcpasses.config`` of ``hcpasses.config.x«Class»method__mutmut_3`` or ``hcpasses.config.function__mutmut_3``."""
    marker = ".x\u01c1"  # mutmut's prefix of a method's mangled name
    return name.split(marker)[0] if marker in name else name.rsplit(".", 1)[0]


def report(found: dict[str, str]) -> float:
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name, status in found.items():
        by_module[module_of(name)][status] += 1
    print("| module | mutants | killed | timeout | survived | other | score |")
    print("|---|---|---|---|---|---|---|")
    for module, counts in sorted(by_module.items()):
        total = sum(counts.values())
        detected = sum(counts[s] for s in DETECTED)
        other = total - detected - counts["survived"]
        print(
            f"| {module} | {total} | {counts['killed']} | {counts['timeout']} | {counts['survived']} | {other} "
            f"| {100 * detected / total:.1f} % |"
        )
    total = len(found)
    detected = sum(status in DETECTED for status in found.values())
    score = 100 * detected / total if total else 0.0
    print(f"\nmutation score: {detected} / {total} = {score:.1f} %")
    survivors = sorted(name for name, status in found.items() if status not in DETECTED)
    if survivors:
        print(f"\nnot detected ({len(survivors)}):")
        for name in survivors:
            note = EQUIVALENT.get(name)
            print(f"  {name}: {found[name]}" + (f"  -- equivalent: {note}" if note else ""))
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", action="store_true", help="run the fixed sample CI runs, not every mutant")
    parser.add_argument("--floor", type=float, default=0.0, help="fail below this score, in percent")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--no-run", action="store_true", help="report the last run's results only")
    args = parser.parse_args(argv)
    patterns = SAMPLE if args.sample else ()
    if not args.no_run:
        run_mutmut(patterns, args.jobs)
    found = statuses(patterns)
    if not found:
        print("no mutant results: did mutmut run?")
        return 1
    score = report(found)
    if score < args.floor:
        print(f"FAILED: mutation score {score:.1f} % is below the floor of {args.floor:g} %")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

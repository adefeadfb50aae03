"""Run the mutants of ``tests/mutants/mutants.py`` against their selected tests; every mutant must be killed.

For each mutant: copy the working tree (tracked and untracked-not-ignored files) into a temp dir, apply the
mutant there, and run its selected tests on the copy in a subprocess (``python -m pytest -q -x``, the dev
hypothesis profile with a fixed seed, a fresh Inductor cache dir). ``hcpasses`` (its reference models too:
``hcpasses.testing.models``) is imported from the copy, never from the editable install: PYTHONPATH and the
working directory point at the copy, and a pytest plugin in the child checks where both came from and stops
the run (a runner error) if either is not the copy. Two self-checks run first: the baseline (the union of
the selected tests on the unmutated copy, one run per selected test or file) must pass, and a canary mutant that breaks
``import hcpasses`` must be killed.

A mutant is *killed* when pytest fails (exit 1: a test failed; exit 2: collection or import failed),
*survived* on exit 0; any other exit (no tests collected, usage error, internal error) or a timeout is a
runner *error*. Prints a markdown table; exits nonzero when a mutant survives, a run errs, or an anchor is
stale (its ``old`` snippet does not occur exactly once in its file).

Usage, from the repository root::

    python tests/mutants/run.py [--list] [--only NAME ...] [--jobs N] [--timeout S] [--no-baseline]
    python -m tests.mutants.run ...
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

try:  # python -m tests.mutants.run
    from .mutants import MUTANTS, Mutant
except ImportError:  # python tests/mutants/run.py
    from mutants import MUTANTS, Mutant  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PYTEST_ARGS = ("-q", "-x", "-p", "no:cacheprovider", "-rfE", "--hypothesis-seed=0", "-p", "_mutant_guard")
BASELINE = "baseline"
KILLED_EXITS = {1, 2}  # tests failed; interrupted (collection / import errors)

CANARY = Mutant(
    name="canary_import_breaks",
    fault="(runner self-check) importing hcpasses raises: proves the child runs the mutated copy",
    file="hcpasses/__init__.py",
    old="",  # empty: prepend ``new``
    new="raise ImportError('mutant canary: this copy of hcpasses is broken on purpose')\n",
    tests=("tests/test_mutant_killers.py",),
)

# Loaded in the child with ``-p _mutant_guard``: after collection (the test modules have imported the
# package and its reference models) both must come from the copy under MUTANT_ROOT.
GUARD = textwrap.dedent(
    """
    import importlib
    import os
    import sys

    import pytest


    def pytest_collection_finish(session):
        root = os.path.realpath(os.environ["MUTANT_ROOT"])
        for name in ("hcpasses", "hcpasses.testing.models"):
            module = sys.modules.get(name)
            if module is None:
                try:
                    module = importlib.import_module(name)
                except Exception as err:  # a broken mutated package: the tests report it, not the guard
                    print(f"[mutant guard] import {name} failed: {err!r}")
                    continue
            path = os.path.realpath(module.__file__)
            print(f"[mutant guard] {name} from {path}")
            if not path.startswith(root + os.sep):
                raise pytest.UsageError(f"{name} was imported from {path}, not from the mutated copy {root}")
    """
)


class StaleMutant(Exception):
    """A mutant's ``old`` snippet does not occur exactly once in its file."""


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed / SURVIVED / ERROR
    failed: list[str]
    seconds: float
    detail: str = ""


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-not-ignored files of the working tree (paths relative to ``root``)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True, capture_output=True
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)


def mutated_source(mutant: Mutant, source: str) -> str:
    """``source`` with the mutant applied; raises ``StaleMutant`` unless its anchor occurs exactly once."""
    if not mutant.old:
        return mutant.new + source
    count = source.count(mutant.old)
    if count != 1:
        first = mutant.old.strip().splitlines()[0]
        raise StaleMutant(
            f"mutant {mutant.name} is stale: its anchor occurs {count} times (expected exactly once) in "
            f"{mutant.file}; anchor starts: {first!r}"
        )
    return source.replace(mutant.old, mutant.new)


def check_anchors(mutants: list[Mutant]) -> list[str]:
    """Stale-anchor messages for ``mutants`` against the working tree (empty when all apply)."""
    problems = []
    for mutant in mutants:
        path = ROOT / mutant.file
        if not path.is_file():
            problems.append(f"mutant {mutant.name} is stale: {mutant.file} does not exist")
            continue
        try:
            mutated_source(mutant, path.read_text())
        except StaleMutant as err:
            problems.append(str(err))
    return problems


def summary_lines(output: str) -> list[str]:
    """The ``FAILED`` / ``ERROR`` lines of pytest's short summary (``-rfE``): node id, then the error."""
    return [line for line in output.splitlines() if re.match(r"(FAILED|ERROR) \S", line)]


def failed_tests(output: str) -> list[str]:
    """Node ids of the ``FAILED`` / ``ERROR`` lines of pytest's short summary."""
    return [line.split()[1] for line in summary_lines(output)]


def run_mutant(mutant: Mutant, files: list[str], timeout: float, keep: bool) -> Outcome:
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"mutant-{mutant.name}-"))
    try:
        tree, cache, plugins = work / "tree", work / "inductor-cache", work / "plugins"
        copy_tree(ROOT, files, tree)
        plugins.mkdir()
        (plugins / "_mutant_guard.py").write_text(GUARD)
        if mutant.file:  # the baseline run has none
            target = tree / mutant.file
            target.write_text(mutated_source(mutant, target.read_text()))
        env = dict(os.environ)
        for var in ("PYTEST_ADDOPTS", "PYTHONSTARTUP", "TORCHINDUCTOR_FORCE_DISABLE_CACHES"):
            env.pop(var, None)
        env.update(
            PYTHONPATH=os.pathsep.join([str(tree), str(plugins)]),
            PYTHONDONTWRITEBYTECODE="1",
            HYPOTHESIS_PROFILE="mutants",
            TORCHINDUCTOR_CACHE_DIR=str(cache),
            MUTANT_ROOT=str(tree),
            COLUMNS="240",  # the short summary keeps the error after the node id
        )
        command = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *mutant.tests]
        if mutant.k:
            command += ["-k", mutant.k]
        try:
            proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome(mutant, "ERROR", [], time.monotonic() - start, f"timed out after {timeout:.0f} s")
        output = proc.stdout + proc.stderr
        seconds = time.monotonic() - start
        if proc.returncode == 0:
            return Outcome(mutant, "SURVIVED", [], seconds, output)
        if proc.returncode in KILLED_EXITS:
            killers = failed_tests(output) or [f"(pytest exit {proc.returncode})"]
            return Outcome(mutant, "killed", killers, seconds, output)
        why = f"pytest exit {proc.returncode}"
        if "ERROR: not found:" in output:
            why += " (a selected test id does not exist any more: update the mutant's tests)"
        return Outcome(mutant, "ERROR", failed_tests(output), seconds, f"{why}\n{output}")
    except StaleMutant as err:
        return Outcome(mutant, "ERROR", [], time.monotonic() - start, str(err))
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def baseline_runs(selected: list[Mutant]) -> list[Mutant]:
    """The baseline self-check: the union of the selected tests on the unmutated copy, one run per selected entry
    (a test id or a whole file), each with a mutant's timeout, side by side with ``--jobs``.

    One run of the whole union took 580 s on a 2-core dev machine and passed the 600 s timeout on CI's slower
    one (2026-12-05); a chunk of 6 entries with three whole files in it still took 473 s.
    """
    tests = list(dict.fromkeys(t for m in selected for t in m.tests))
    fault = "(runner self-check) no mutant: the selected tests must pass"
    return [Mutant(f"{BASELINE}-{i}-of-{len(tests)}", fault, "", "", "", (t,)) for i, t in enumerate(tests, 1)]


def is_baseline(mutant: Mutant) -> bool:
    return mutant.name.startswith(BASELINE + "-")  # mutants' names are snake_case: none starts so


def is_self_check(mutant: Mutant) -> bool:
    return is_baseline(mutant) or mutant.name == CANARY.name


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | fault | killed by | status |", "|---|---|---|---|"]
    for o in outcomes:
        killers = "<br>".join(f"`{t}`" for t in o.failed) or "—"
        lines.append(f"| `{o.mutant.name}` | {o.mutant.fault} | {killers} | {o.status} ({o.seconds:.0f} s) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant run (default 600)")
    parser.add_argument("--no-canary", action="store_true", help="skip the import-breaking self-check")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip running the selected tests on the unmutated copy first"
    )
    parser.add_argument(
        "--tests", nargs="+", metavar="NODEID", help="run these tests instead of each mutant's selection (exploring)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp copies (paths on stderr)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output of every run")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        print("duplicate mutant names in tests/mutants/mutants.py", file=sys.stderr)
        return 2
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        print(f"unknown mutant(s) {unknown}; known: {', '.join(names)}", file=sys.stderr)
        return 2
    selected = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in selected:
            k = f" -k {m.k!r}" if m.k else ""
            print(f"{m.name}: {m.fault}\n    {m.file}\n    tests: {' '.join(m.tests)}{k}")
        return 0
    stale = check_anchors(selected)
    if stale:
        print("STALE MUTANTS (fix the anchor in tests/mutants/mutants.py):", file=sys.stderr)
        print("\n".join(stale), file=sys.stderr)
        return 3
    if args.tests:
        selected = [dataclasses.replace(m, tests=tuple(args.tests), k=None) for m in selected]
    empty = [m.name for m in selected if not m.tests]
    if empty:
        print(f"mutants without tests: {', '.join(empty)}", file=sys.stderr)
        return 2

    files = tree_files(ROOT)
    runs = list(selected)
    if not args.no_canary:
        runs.insert(0, CANARY)
    if not args.no_baseline:
        runs[:0] = baseline_runs(selected)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_mutant, m, files, args.timeout, args.keep) for m in runs]
        outcomes = []
        for future in futures:
            outcome = future.result()
            outcomes.append(outcome)
            print(f"{outcome.mutant.name}: {outcome.status} in {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
            for line in summary_lines(outcome.detail):
                print(f"    {line[:300]}", file=sys.stderr)
            if args.verbose or outcome.status == "ERROR":
                print(
                    textwrap.indent(outcome.detail if args.verbose else outcome.detail[-6000:], "    "), file=sys.stderr
                )
    total = time.monotonic() - start

    bad = []
    checks = [o for o in outcomes if is_self_check(o.mutant)]
    for o in checks:
        expected = "SURVIVED" if is_baseline(o.mutant) else "killed"
        if o.status != expected:
            want = "its tests pass" if expected == "SURVIVED" else "killed"
            bad.append(f"runner self-check {o.mutant.name}: {o.status}, expected {want}")
            if o.detail and not args.verbose and o.status != "ERROR":
                print(textwrap.indent(o.detail[-6000:], "    "), file=sys.stderr)
    results = [o for o in outcomes if not is_self_check(o.mutant)]
    print(table(results))
    print(f"\n{len(results)} mutants in {total:.0f} s")
    bad += [f"{o.mutant.name}: {o.status}" for o in results if o.status != "killed"]
    if bad:
        print("\nFAILED: " + "; ".join(bad), file=sys.stderr)
        print("A surviving mutant is a missing test: add a test that fails on it (do not weaken it).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The hand-written mutants' runner (``tests/mutants/run.py``): its baseline self-check runs each selected test (or
file) on its own, so that no run of it comes near a mutant's timeout (the whole union took 580 s here and timed out
at 600 s on CI, 2026-12-05), and every selected test is still run exactly once.
"""

from __future__ import annotations

from mutants.mutants import MUTANTS, Mutant
from mutants.run import CANARY, baseline_runs, is_baseline, is_self_check


def test_the_baseline_runs_every_selected_test_once_on_its_own_in_order() -> None:
    union = list(dict.fromkeys(t for m in MUTANTS for t in m.tests))
    runs = baseline_runs(list(MUTANTS))
    assert [run.tests for run in runs] == [(t,) for t in union]
    assert [run.name for run in runs] == [f"baseline-{i}-of-{len(runs)}" for i in range(1, len(runs) + 1)]
    assert all("/" not in run.name for run in runs), "the name is a temp dir's prefix"
    assert all(run.file == "" and run.k is None for run in runs), "a baseline run must not mutate anything"


def test_tests_shared_by_mutants_run_once_in_the_baseline() -> None:
    shared = ("tests/test_a.py::test_x",)
    mutants = [Mutant(f"m{i}", "fault", "f.py", "a", "b", (*shared, f"tests/test_a.py::test_{i}")) for i in range(3)]
    runs = baseline_runs(mutants)
    assert [t for run in runs for t in run.tests] == [shared[0]] + [f"tests/test_a.py::test_{i}" for i in range(3)]


def test_self_checks_are_the_baseline_runs_and_the_canary_and_nothing_else() -> None:
    runs = baseline_runs(list(MUTANTS))
    assert all(is_baseline(run) and is_self_check(run) for run in runs)
    assert is_self_check(CANARY) and not is_baseline(CANARY)
    assert not any(is_self_check(m) for m in MUTANTS)
    assert not is_baseline(Mutant("baseline_like_name", "fault", "f.py", "a", "b", ("t",)))

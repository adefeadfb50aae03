"""Shared test setup: hypothesis profiles and small graph helpers.

Profiles, picked with ``HYPOTHESIS_PROFILE``: ``dev`` (the default: the quick local run, a few examples per
property, and the tests marked ``thorough`` skipped), ``ci`` (thorough, set by .ci/run: every test, 100 examples per
property, the checked-graph floor) and ``mutants`` (the hand-written mutants' selected tests: every test, 40).
"""

from __future__ import annotations

import os
from typing import Any

# Scalar C++ for Inductor's CPU kernels, in this process and the ones tests start (set before torch imports
# Inductor's config, which reads it once). A CI run compiles about 1000 C++ kernels from a cold cache (counted:
# 1027 on 2026-12-02), 1.5 s each with the vector ISA and 1.0 s scalar; a two-layer FP8 HC model compiled at two
# T, cold: 38.6 s vectorised, 22.3 s scalar. The passes rewrite the graph before codegen, and on CPU the fused
# ops run as custom-op fallbacks, not as Inductor's generated loops. Scalar code may round an fp32 reduction
# otherwise than eager (``unfused`` in test_gated_mean_quant.py): bit-exact checks hold to eager, not to it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest
import torch
from harness.quick_run import skipped_in_quick_run
from harness.tally import CheckedGraphs
from hypothesis import HealthCheck, settings

# 100 examples: the SP properties now run every example twice (SP and the SP-off reference) over a wider
# case grid, and the whole suite must stay within 25 minutes on 2 cores (300 took over 35).
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
# The quick profile: every property still draws its edge cases (each test's own @example / explicit cases) and two
# random examples; the suite runs in a few minutes from a cold cache on 2 cores (README: Tests).
settings.register_profile("dev", max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The hand-written mutants' selected tests (tests/mutants/run.py): no test skipped, a moderate number of examples.
settings.register_profile("mutants", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
settings.load_profile(PROFILE)
THOROUGH = PROFILE != "dev"  # only the quick profile skips the tests marked thorough


# The long property tests run first: under pytest-xdist (-n 2, load scheduling deals the first tests round
# robin) each worker starts one of them at once and the short tests fill in around them. Left at the end of
# the collection order, they would start last and run alone.
# Clean-clone CI runs of 2026-12-01: with the spelling properties (about 5 min each) left in collection order the
# suite took 29 min; with them in front, 27 min.
LONG_TESTS = (
    "test_every_block_spelling_is_sharded_and_fused",
    "test_sharded_graph_matches_sp_off_and_eager",
    "test_every_mhc_collapse_spelling_is_sharded_and_fused",
    "test_triton_kernels_under_interpreter",
    "test_batched_streams_are_sharded_and_match_sp_off_and_eager",
)


def _thorough_only(item: pytest.Item) -> bool:
    return item.get_closest_marker("thorough") is not None or skipped_in_quick_run(item.nodeid)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: index for index, name in enumerate(LONG_TESTS)}
    items.sort(key=lambda item: rank.get(item.originalname, len(LONG_TESTS)))
    if not THOROUGH:
        skip = pytest.mark.skip(reason=f"thorough profile only (HYPOTHESIS_PROFILE=ci); this run: {PROFILE}")
        for item in items:
            if _thorough_only(item):
                item.add_marker(skip)


# The reliability budget (issue #11): rewritten graphs checked against eager per run, summed over the workers.
CHECKED = pytest.StashKey[CheckedGraphs]()
MIN_CHECKED_ENV = "HCPASSES_MIN_CHECKED_GRAPHS"  # set by .ci/run for the whole suite


@pytest.fixture(scope="session")
def checked_graphs(request: pytest.FixtureRequest) -> CheckedGraphs:
    """The session's tally: a property test adds each example's graphs once its checks passed."""
    return request.config.stash.setdefault(CHECKED, CheckedGraphs())


FLOOR = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # Taken out of the environment: pytest runs that tests start in subprocesses (the Triton interpreter's)
    # check a few tests, not the suite, and must not inherit the suite's floor.
    config.stash[FLOOR] = int(os.environ.pop(MIN_CHECKED_ENV, "0"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One intra-op thread per xdist worker: the workers already fill the cores, and the simulator runs up to
        # 8 rank threads whose ops would each start a thread pool of their own (oversubscribed, they spin).
        torch.set_num_threads(1)


def _total(config: pytest.Config) -> int:
    return config.stash.setdefault(CHECKED, CheckedGraphs()).graphs


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the controller: add what a finished worker counted."""
    node.config.stash.setdefault(CHECKED, CheckedGraphs()).graphs += node.workeroutput.get("checked_graphs", 0)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its count to the controller; the controller (or a run without workers) enforces the floor."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["checked_graphs"] = _total(session.config)
        return
    floor = session.config.stash[FLOOR]
    if _total(session.config) < floor and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    floor = config.stash[FLOOR]
    line = f"rewritten graphs checked against eager: {_total(config)}"
    if floor:
        line += f" (floor {floor}: {'met' if _total(config) >= floor else 'NOT MET, the run fails'})"
    terminalreporter.write_line(line)

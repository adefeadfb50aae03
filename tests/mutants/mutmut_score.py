"""The mutation score of the pass infrastructure, measured by mutmut (configured in pyproject.toml's
``[tool.mutmut]``: which modules are mutated, which fast tests judge them).

    python tests/mutants/mutmut_score.py                 # every mutant (1195: 12 min on 2 cores)
    python tests/mutants/mutmut_score.py --sample        # the fixed sample CI runs (numbered *0 and *5: 209)
    python tests/mutants/mutmut_score.py --floor 90      # fail below this score (percent)
    python tests/mutants/mutmut_score.py --scope passes  # canonical_forms.py and the SP region analysis (slower tests)
    python tests/mutants/mutmut_score.py --scope scans   # blocked_scans.py, judged by tests/test_blocked_scans.py
    python tests/mutants/mutmut_score.py --scope canonical  # canonical_forms.py alone, judged by the spelling tests
    python tests/mutants/mutmut_score.py --scope region  # sp_rewrite/region.py alone
    python tests/mutants/mutmut_score.py --scope emit    # sp_rewrite/emit.py and kept.py

Runs ``mutmut run`` from the repository root (mutmut writes its copy to ``mutants/``, ignored by git), reads each
mutant's status back with ``mutmut results --all true``, and prints the score per module and the survivors, each
with its note from ``EQUIVALENT`` where one says why no test can kill it. Score = (killed + timeout) / mutants
run: a mutant that makes the tests hang is caught too. Exits 1 when the score is below ``--floor``.

``--scope passes`` mutates canonical_forms and the SP region analysis, judged by their own tests (graphs captured
through Inductor): it runs in a copy of the working tree under ``mutants-passes/`` (ignored by git) whose
``[tool.mutmut]`` names those modules and tests, as mutmut reads its configuration from the working directory only.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Other scopes than pyproject.toml's: the [tool.mutmut] keys a scope replaces.
SCOPES: dict[str, dict[str, list[str]]] = {
    "passes": {
        "only_mutate": ["hcpasses/passes/canonical_forms.py", "hcpasses/passes/sp_rewrite/region.py"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_canonical.py",
            "tests/test_sp_parts.py",
            "tests/test_sp_region.py",
        ],
    },
    # the canonical forms alone, judged by the tests that feed it the spellings of public code (graphs through Inductor)
    "canonical": {
        "only_mutate": ["hcpasses/passes/canonical_forms.py"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_canonical.py",
            "tests/test_spellings.py",
            "tests/test_mhc_spellings.py",
        ],
    },
    # the SP region analysis alone (half the passes scope's mutants), judged by the analysis tests on captured graphs
    "region": {
        "only_mutate": ["hcpasses/passes/sp_rewrite/region.py"],
        "pytest_add_cli_args_test_selection": ["tests/test_sp_parts.py", "tests/test_sp_region.py"],
    },
    "tokens": {
        "only_mutate": ["hcpasses/passes/sp_rewrite/tokens.py"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_sp_layouts.py",
            "tests/test_sp_seq_split.py",
            "tests/test_sp_parts.py",
        ],
    },
    # the SP emission and the kept-rows analysis, judged by the tests that read the emitted graphs and run them
    "emit": {
        "only_mutate": ["hcpasses/passes/sp_rewrite/emit.py", "hcpasses/passes/sp_rewrite/kept.py"],
        "pytest_add_cli_args_test_selection": [
            "tests/test_sp_parts.py",
            "tests/test_sp_kept_rows.py",
            "tests/test_sp_windows.py",
        ],
    },
    "scans": {
        "only_mutate": ["hcpasses/passes/blocked_scans.py"],
        # mutmut's copy holds hcpasses/ and tests/ only: the benchmark's tests have no script to run or import there
        "pytest_add_cli_args_test_selection": [
            "tests/test_blocked_scans.py",
            "--deselect=tests/test_blocked_scans.py::test_the_benchmark_runs_on_cpu_and_records_each_variant",
            "--deselect=tests/test_blocked_scans.py::test_the_benchmarks_aten_scan_record_reads_calls_not_comments",
        ],
    },
}
SAMPLE = ("*__mutmut_*0", "*__mutmut_*5")  # a sixth of the mutants, the same ones every run
DETECTED = {"killed", "timeout"}
RESULT = re.compile(r"^\s+(\S+): (.+)$")

# Why a surviving mutant computes what the original does (the reasons the entries below name).
ZIP = "zip's strict= only matters for unequal lengths, which the length or dim() comparison before it rejects"
OWN_GRAPH = "fx.Interpreter defaults to module.graph, and verify only runs graphs their owning module holds"
GC = "garbage_collect_values frees the interpreter's values early: memory, not verdicts"
PLACEHOLDER_RUN = "a placeholder's run returns its own recorded fake value: the check passes, the record stays"
OUTPUT_RUN = "the output node's run returns the outputs' values: recording or checking them changes no verdict"
NONE_INPUTS = (
    "an input without a value: the rerun returns False at its first user, as the guard does, or never reads it"
)
ARG_WITHOUT_VALUE = (
    "unreachable: an argument without a value is a placeholder (no fake mode: returned before) or ran first"
)
EQUAL_INT = "an int record overwritten by an equal int is the same record"
OUTPUT_NODE = "create_node('output', 'output', args) makes the node graph.output(args) makes"
FALSY = "overwrite=None is falsy, as False is"
RENUMBERED = "_add_report numbers every report it adds, overwriting this index"
SEPARATOR = "another separator inside a hashed key: still one key per input"
NO_GROUP = "another constant for 'no process group': still the same key in every such process"
REPLACE = "dataclasses.replace with no overrides returns an equal config"
JSON_LAYOUT = "the indentation of index.json: readers parse the JSON"
NO_DUMP_TEXT = "the text before the pass is read only when a dump is written"
IDENTITY_PERMUTE = "where the scanned dim is already last, the order is the identity: the permute changes nothing"
SLICE_FROM_NONE = "a slice from None starts at 0"
SAME_FLOAT = "float() parses the spelling case-insensitively: the same infinity"
OVERWRITTEN = "every entry of the list is assigned in the loop after it"
GRAPH_ORDER = (
    "an fx.Node orders itself by its place in its graph (torch._C._NodeBase.__lt__), the order self.order holds: the "
    "analysis does not edit the graph"
)
F32_OPERANDS = (
    "a rewrite at the second position needs the second operand to be an f32 upcast, so the first position's dtype "
    "check skips only muls nothing rewrites: break ends the loop where continue would find nothing"
)
WHOLE_ROW = "a block of the whole row asks Inductor what the gate asked, which split: it never fits either way"

# Survivors no test can kill, one line each (mutmut's name: why). Names carry a number per function: an edit of
# the function renumbers them, so a stale line only loses its note (the floor, not this list, gates CI).
EQUIVALENT: dict[str, str] = {
    "hcpasses.passes.canonical_forms.x_upcast_into_promoting_mul__mutmut_40": F32_OPERANDS,
    "hcpasses.passes.blocked_scans.x__inverse__mutmut_3": OVERWRITTEN,
    "hcpasses.passes.blocked_scans.x__lowest__mutmut_5": SAME_FLOAT,
    "hcpasses.passes.blocked_scans.x__lowest__mutmut_11": SAME_FLOAT,
    "hcpasses.passes.blocked_scans.x__blocked_values__mutmut_112": SLICE_FROM_NONE,
    "hcpasses.passes.blocked_scans.x__blocked_values__mutmut_191": SLICE_FROM_NONE,
    "hcpasses.passes.blocked_scans.x_block_scan__mutmut_13": IDENTITY_PERMUTE,
    "hcpasses.passes.blocked_scans.x_block_scan__mutmut_16": IDENTITY_PERMUTE,
    "hcpasses.passes.blocked_scans.x_block_scan__mutmut_41": IDENTITY_PERMUTE,
    "hcpasses.passes.blocked_scans.x_inductor_block__mutmut_14": WHOLE_ROW,
    "hcpasses.backend.xǁHCPassesBackendǁ_reload_reports__mutmut_10": RENUMBERED,
    "hcpasses.backend.xǁHCPassesBackendǁ_reload_reports__mutmut_11": RENUMBERED,
    "hcpasses.backend.xǁHCPassesBackendǁ_reload_reports__mutmut_9": RENUMBERED,
    "hcpasses.backend.xǁHCPassesBackendǁ_report_key__mutmut_14": SEPARATOR,
    "hcpasses.config.xǁHCPassesConfigǁ_with_env__mutmut_36": REPLACE,
    "hcpasses.dumps.xǁGraphDumpǁwrite_index__mutmut_17": JSON_LAYOUT,
    "hcpasses.dumps.xǁGraphDumpǁwrite_index__mutmut_19": JSON_LAYOUT,
    "hcpasses.dumps.xǁGraphDumpǁwrite_index__mutmut_20": JSON_LAYOUT,
    "hcpasses.manager.xǁPassManagerǁ__init____mutmut_19": SEPARATOR,
    "hcpasses.manager.xǁPassManagerǁ_run_one__mutmut_40": NO_DUMP_TEXT,
    "hcpasses.manager.xǁPassManagerǁuuid__mutmut_5": NO_GROUP,
    "hcpasses.passes.sp_rewrite.region.xǁ_RegionBuilderǁ_check_partial_sum__mutmut_15": GRAPH_ORDER,
    "hcpasses.passes.sp_rewrite.region.xǁ_RegionBuilderǁ_halos__mutmut_5": GRAPH_ORDER,
    "hcpasses.passes.sp_rewrite.region.xǁ_RegionBuilderǁ_region__mutmut_75": GRAPH_ORDER,
    "hcpasses.passes.sp_rewrite.region.xǁ_RegionBuilderǁ_sources__mutmut_10": GRAPH_ORDER,
    "hcpasses.verify.x__check_value__mutmut_14": ZIP,
    "hcpasses.verify.x__check_value__mutmut_17": ZIP,
    "hcpasses.verify.x__check_value__mutmut_18": ZIP,
    "hcpasses.verify.x__check_value__mutmut_30": ZIP,
    "hcpasses.verify.x__check_value__mutmut_33": ZIP,
    "hcpasses.verify.x__check_value__mutmut_34": ZIP,
    "hcpasses.verify.x__propagate__mutmut_19": OWN_GRAPH,
    "hcpasses.verify.x__rerun__mutmut_20": OWN_GRAPH,
    "hcpasses.verify.x__rerun__mutmut_35": ARG_WITHOUT_VALUE,
    "hcpasses.verify.x__rerun__mutmut_9": NONE_INPUTS,
    "hcpasses.verify.x__same_items__mutmut_10": ZIP,
    "hcpasses.verify.x__same_items__mutmut_11": ZIP,
    "hcpasses.verify.x__same_items__mutmut_7": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_16": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_19": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_20": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_28": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_31": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_32": ZIP,
    "hcpasses.verify.x__same_metadata__mutmut_45": EQUAL_INT,
    "hcpasses.verify.x__same_metadata__mutmut_46": EQUAL_INT,
    "hcpasses.verify.x__same_metadata__mutmut_47": EQUAL_INT,
    "hcpasses.verify.x__same_metadata__mutmut_48": EQUAL_INT,
    "hcpasses.verify.x_restore_graph__mutmut_36": OUTPUT_NODE,
    "hcpasses.verify.x_restore_graph__mutmut_37": OUTPUT_NODE,
    "hcpasses.verify.x_verify_graph__mutmut_11": FALSY,
    "hcpasses.verify.xǁGraphStateǁstructure_differs__mutmut_16": ZIP,
    "hcpasses.verify.xǁGraphStateǁstructure_differs__mutmut_19": ZIP,
    "hcpasses.verify.xǁGraphStateǁstructure_differs__mutmut_20": ZIP,
    "hcpasses.verify.xǁ_FakeRepropagationǁ__init____mutmut_2": GC,
    "hcpasses.verify.xǁ_FakeRepropagationǁ__init____mutmut_3": OWN_GRAPH,
    "hcpasses.verify.xǁ_FakeRepropagationǁ__init____mutmut_5": GC,
    "hcpasses.verify.xǁ_FakeRepropagationǁ__init____mutmut_6": OWN_GRAPH,
    "hcpasses.verify.xǁ_FakeRepropagationǁ__init____mutmut_7": GC,
    "hcpasses.verify.xǁ_FakeRepropagationǁrun_node__mutmut_4": PLACEHOLDER_RUN,
    "hcpasses.verify.xǁ_FakeRepropagationǁrun_node__mutmut_5": PLACEHOLDER_RUN,
    "hcpasses.verify.xǁ_FakeRepropagationǁrun_node__mutmut_6": OUTPUT_RUN,
    "hcpasses.verify.xǁ_FakeRepropagationǁrun_node__mutmut_7": OUTPUT_RUN,
}


def scope_copy(scope: str) -> Path:
    """A copy of the working tree (tracked and untracked files git does not ignore) configured for ``scope``."""
    dest = ROOT / f"mutants-{scope}"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for name in listed:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    pyproject = (dest / "pyproject.toml").read_text()
    for key, value in SCOPES[scope].items():
        pattern = rf"^{key} = \[.*?\]"
        pyproject, count = re.subn(pattern, f"{key} = {json.dumps(value)}", pyproject, flags=re.M | re.S)
        if count != 1:
            raise SystemExit(f"pyproject.toml has no single [tool.mutmut] key {key!r} to replace")
    (dest / "pyproject.toml").write_text(pyproject)
    return dest


def run_mutmut(workdir: Path, patterns: tuple[str, ...], jobs: int) -> None:
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs), *patterns]
    subprocess.run(command, cwd=workdir, check=False)


def statuses(workdir: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """Status of every mutant of the last run that matches ``patterns`` (all when empty)."""
    command = [sys.executable, "-m", "mutmut", "results", "--all", "true"]
    out = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=True).stdout
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
    equivalent = sum(name in EQUIVALENT for name, status in found.items() if status not in DETECTED)
    if equivalent and total > equivalent:
        print(f"without the {equivalent} documented equivalent mutants: {100 * detected / (total - equivalent):.1f} %")
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
    parser.add_argument("--scope", choices=sorted(SCOPES), help="mutate another scope than pyproject.toml's")
    args = parser.parse_args(argv)
    patterns = SAMPLE if args.sample else ()
    workdir = ROOT
    if args.scope:
        workdir = ROOT / f"mutants-{args.scope}" if args.no_run else scope_copy(args.scope)
    if not args.no_run:
        run_mutmut(workdir, patterns, args.jobs)
    found = statuses(workdir, patterns)
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

"""``benchmarks/compile_cost.py``: its rows and table quickly, and its ``--cpu-smoke`` run end to end (thorough:
each variant compiles in a fresh process with Inductor's caches off, about 2 minutes a depth on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_cost  # noqa: E402


def test_depth_row_compares_the_passes_with_inductor() -> None:
    jobs = compile_cost.jobs_for("qwen4_exp", 2, compile_cost.parse_args(["--tokens", "8"]))
    assert [job.variant for job in jobs] == list(compile_cost.VARIANTS) and {job.tokens for job in jobs} == {8}
    measured = {
        "inductor": {"compile_s": 40.0},
        "hcpasses": {"compile_s": 41.0, "passes_s": 2.0, "nodes": 500, "per_pass_s": {"gated_mean_quant": 2.0}},
        "sp": {"error": "x failed"},
    }
    row = compile_cost.depth_row(jobs, measured)
    assert row["passes_over_inductor"] == 0.05 and row["goal_met"]
    assert (row["inductor_ms_per_node"], row["passes_ms_per_node"]) == (80.0, 4.0)
    assert "x failed" in compile_cost.table({"runs": [row]})
    failed = compile_cost.depth_row(jobs, {"inductor": {"error": "y failed"}})
    assert "nodes" not in failed and "y failed" in compile_cost.table({"runs": [failed]})


def test_variant_seconds_follow_the_relabelled_reports() -> None:
    reports = [SimpleNamespace(variant=variant) for variant in ("sharded", "only", "unsharded")]
    backend = SimpleNamespace(reports=reports)
    calls = [{"seconds": 3.0, "reports": [0]}, {"seconds": 1.0, "reports": [1]}, {"seconds": 2.0, "reports": [2]}]
    calls.append({"seconds": 0.5, "reports": []})  # a compile whose report Inductor's cache would have served
    seconds = compile_cost.variant_seconds(backend, calls)
    assert seconds == {"sharded": 3.0, "only": 1.0, "unsharded": 2.0, "unreported": 0.5}


def test_arguments() -> None:
    args = compile_cost.parse_args(["--cpu-smoke"])
    assert (args.models, args.tokens, args.layers, args.device) == (
        ["qwen4_exp"],
        compile_cost.SMOKE_TOKENS,
        None,
        "cpu",
    )
    assert compile_cost.parse_args(["--layers", "2,4,8,16"]).layers == (2, 4, 8, 16)
    with pytest.raises(SystemExit):
        compile_cost.parse_args(["--variants", "inductor,eager"])
    with pytest.raises(SystemExit):
        compile_cost.parse_args(["--cpu-smoke", "--device", "cuda"])


@pytest.mark.thorough
def test_cpu_smoke_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    command = [sys.executable, "benchmarks/compile_cost.py", "--cpu-smoke", "--layers", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert {"date", "device", "torch", "command", "caches"} <= set(results)
    [row] = results["runs"]
    assert (row["model"], row["layers"], row["tokens"]) == ("qwen4_exp", 1, compile_cost.SMOKE_TOKENS)
    variants = row["variants"]
    assert all("error" not in result for result in variants.values()), variants
    with_passes, sp = variants["hcpasses"], variants["sp"]
    # caches off: the passes ran on every graph, and on the graphs plain Inductor compiled
    assert with_passes["cached_graphs"] == 0 and with_passes["graphs"] >= 1
    assert with_passes["dynamo_graphs"] == variants["inductor"]["dynamo_graphs"]
    assert row["nodes"] == with_passes["nodes"] > 0
    assert row["passes_s"] == pytest.approx(sum(row["per_pass_s"].values()), abs=0.005)
    assert row["passes_over_inductor"] == pytest.approx(row["passes_s"] / row["inductor_compile_s"], abs=1e-4)
    assert row["goal_met"] == (row["passes_over_inductor"] <= compile_cost.GOAL)
    assert row["passes_ms_per_node"] == pytest.approx(row["passes_s"] * 1e3 / row["nodes"], abs=1e-3)
    # symbolic T and SP: each graph compiled sharded, and unsharded on the first call with T < sp_min_tokens; a graph
    # Dynamo traced and then dropped (it may trace a dynamic frame twice) is never called, so never compiled unsharded
    by_variant = sp["graphs_by_variant"]
    assert set(by_variant) == {"sharded", "unsharded"} and by_variant["sharded"] == sp["dispatched_graphs"]
    assert 1 <= by_variant["unsharded"] <= sp["dispatched_graphs"]
    assert set(sp["variant_compile_s"]) == {"sharded", "unsharded"}
    assert sp["variant_calls"] == {"sharded": 2, "unsharded": 1}
    assert sp["small_t_first_call_s"] >= sp["variant_compile_s"]["unsharded"] > 0
    assert sp["per_pass_s"]["sp_rewrite"] > 0 and "unsharded" in done.stdout

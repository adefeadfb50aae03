"""``benchmarks/generate_hf.py --cpu-smoke``: the tiny deepseek_v4 generates with its forward compiled by the
backend; at tp 1 the greedy tokens equal eager's, at a simulated tp 2 the prompt's prefill is sharded and no decode
step is, and each run records its timings and graphs (issue #27 item 6; the real-size run is a GPU run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.thorough  # tiny models through generate(), 2 tp sizes: CI, not the quick local run
def test_cpu_smoke_generates_eagers_tokens_and_shards_only_the_prefill(tmp_path: Path) -> None:
    out = tmp_path / "generate.json"
    command = [sys.executable, "benchmarks/generate_hf.py", "--cpu-smoke", "--new-tokens", "3", "--repeats", "1"]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads(out.read_text())["cases"]
    assert "error" not in one and "error" not in two, (one, two)
    assert (one["tp"], two["tp"]) == (1, 2)
    for name in ("hcpasses", "hcpasses_cudagraphs"):
        row = one[name]
        assert row["tokens_equal"] and len(row["tokens"]) == 3, row
        assert row["forward_calls"] == [16, 1, 1]  # the prompt, then one token per step (the cache is used)
        assert row["prefill_ms"] > 0 and row["decode_ms"] > 0 and row["graphs_compiled"] >= 1
        assert all(graph["sp_rewrite"] != "applied" for graph in row["graphs"])  # one rank: nothing to shard
        sharded = two[name]
        assert sharded["prefill_sharded"] and sharded["decode_unsharded"], sharded["reports"]
        assert sharded["graphs"][0]["sp_rewrite"] == "applied" and len(sharded["graphs"]) >= 2
    assert one["eager"]["tokens"] == one["hcpasses"]["tokens"] and "graphs" not in one["eager"]

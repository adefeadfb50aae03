"""``benchmarks/generate_hf.py --cpu-smoke``: the tiny deepseek_v4 generates with its forward compiled by the
backend; at tp 1 the greedy tokens equal eager's, at a simulated tp 2 the prompt's prefill is sharded and no decode
step is, and each run records its timings and graphs (issue #27 item 6; the real-size run is a GPU run)."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    for line in ("tp 1 eager: done", "tp 1 hcpasses: done", "tp 1 hcpasses_cudagraphs: done", "tp 2 hcpasses: done"):
        assert line in done.stdout, done.stdout[-2000:]  # each variant's line, as it finishes
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


def smoke_args(generate_hf: Any, variants: list[str]) -> argparse.Namespace:
    """``generate_hf.py --cpu-smoke``'s arguments for ``run_case``: the tiny model, 2 new tokens, no repeats."""
    return argparse.Namespace(
        cpu_smoke=True,
        model="deepseek_v4",
        layers=generate_hf.LAYERS["deepseek_v4"][0],
        prompt=generate_hf.SMOKE_PROMPT,
        new_tokens=2,
        repeats=0,
        variants=variants,
    )


@pytest.mark.thorough  # the tiny model through generate() three times: CI, not the quick local run
def test_a_variant_that_fails_keeps_the_other_variants_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant's error (as the CUDA-graph one of deepseek_v4's cache on the GPU) is its own row: the case keeps
    eager's and the plain backend's rows and their verdicts, and the summary names the error."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # benchmarks/ is not a package
    import generate_hf

    runs = []
    real_run = generate_hf.run_generate

    def third_run_fails(*args: object) -> dict[str, object]:
        runs.append(args[-1])  # the backend: None for eager
        if len(runs) == 3:  # eager, hcpasses, then hcpasses_cudagraphs
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        return real_run(*args)

    monkeypatch.setattr(generate_hf, "run_generate", third_run_fails)
    args = smoke_args(generate_hf, list(generate_hf.VARIANTS))
    with generate_hf.eager_kernels_under_compile():
        case = generate_hf.run_case(1, args, torch.device("cpu"))
    assert len(runs) == 3 and runs[0] is None
    assert case["hcpasses"]["tokens_equal"] and "error" not in case["hcpasses"], case["hcpasses"]
    failed = case["hcpasses_cudagraphs"]
    assert failed["error"].startswith("RuntimeError: accessing tensor output of CUDAGraphs") and failed["traceback"]
    assert "tokens_equal" not in failed
    assert "hcpasses_cudagraphs: RuntimeError: accessing tensor output" in generate_hf.summary(case)


@pytest.mark.thorough  # the tiny model through generate() twice
def test_variants_runs_only_the_compiled_variants_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--variants hcpasses_cudagraphs``: eager (the reference at tp 1) and that variant run, the other does not."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # benchmarks/ is not a package
    import generate_hf

    args = smoke_args(generate_hf, ["hcpasses_cudagraphs"])
    with generate_hf.eager_kernels_under_compile():
        case = generate_hf.run_case(1, args, torch.device("cpu"))
    assert "hcpasses" not in case and case["hcpasses_cudagraphs"]["tokens_equal"], case
    assert case["eager"]["tokens"] == case["hcpasses_cudagraphs"]["tokens"]


def test_an_unknown_variant_is_refused_naming_the_valid_ones() -> None:
    command = [sys.executable, "benchmarks/generate_hf.py", "--cpu-smoke", "--variants", "hcpasses,fast", "--out", "x"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--variants hcpasses,fast: choose among hcpasses, hcpasses_cudagraphs" in done.stderr


def test_the_qwen4_exp_it_generates_with_ends_with_the_indexed_attention_layer() -> None:
    """A cache needs an attention layer: the GatedDeltaNet layers come first, the indexed-attention layer last, PLE
    on a GatedDeltaNet layer (the second, as in the real checkpoint, or the first of two); fewer than 2 is refused."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import generate_hf

    for layers, ple in ((2, [1]), (4, [2])):
        config = generate_hf.build("qwen4_exp", True, layers, torch.device("cpu")).config
        assert config.layer_types == ["linear_attention"] * (layers - 1) + ["indexed_attention"]
        assert config.ple_layer_ids == ple
    with pytest.raises(SystemExit):
        generate_hf.main(["--cpu-smoke", "--model", "qwen4_exp", "--layers", "1", "--out", "/dev/null"])


@pytest.mark.parametrize("flag", [False, True])
def test_qsa_batched_reaches_the_selection_op_and_the_json(flag: bool, tmp_path: Path, monkeypatch) -> None:
    """``--qsa-batched`` (default off) opens ``eager_kernels_under_compile(qsa_batched=True)`` around every case and
    is recorded in the JSON."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import generate_hf

    opened = []

    @contextlib.contextmanager
    def kernels(qsa_batched: bool = False):
        opened.append(qsa_batched)
        yield {}

    monkeypatch.setattr(generate_hf, "eager_kernels_under_compile", kernels)
    monkeypatch.setattr(generate_hf, "run_case", lambda tp, args, device: {"error": "not run"})
    out = tmp_path / "g.json"
    argv = ["--out", str(out), "--cpu-smoke", "--tp", "1", "--model", "qwen4_exp"] + (["--qsa-batched"] if flag else [])
    assert generate_hf.main(argv) == 0
    assert opened == [flag] and json.loads(out.read_text())["qsa_batched"] is flag

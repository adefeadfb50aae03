"""``benchmarks/prefill_hf.py``: its pieces quickly (KV replication, the HC bound, the hand-written ratio, error
records, the table), and its ``--cpu-smoke`` run end to end with every variant (thorough: compiles on CPU)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hcpasses.testing.hf_models import tiny_qwen4_exp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import prefill_hf  # noqa: E402
from simulated_tp import simulated_tp  # noqa: E402


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextAttention"]


def test_replicate_kv_heads_gives_each_rank_the_kv_head_of_its_query_heads() -> None:
    model = tiny_qwen4_exp()  # 4 query heads, 2 KV heads of 16
    (attention,) = attention_modules(model)
    before = attention.k_proj.weight.detach().clone().unflatten(0, (2, 16))
    assert prefill_hf.replicate_kv_heads(model, 4) == 1
    after = attention.k_proj.weight.detach().unflatten(0, (4, 16))
    for head in range(4):  # query head h of 4 reads KV head h // 2
        assert torch.equal(after[head], before[head // 2])
    assert attention.config.num_key_value_heads == 4 and attention.num_key_value_groups == 1
    assert model.config.num_key_value_heads == 2  # the model's own config is untouched
    assert prefill_hf.replicate_kv_heads(tiny_qwen4_exp(), 2) == 0  # enough KV heads already


def kernel_event(name: str, start: int, end: int) -> SimpleNamespace:
    """A profiler event as the helpers read it: a name and a time range in us."""
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, time_range=span)


def test_device_gaps_sums_the_idle_time_between_kernels_and_names_the_longest_gaps() -> None:
    # two calls of three kernels each, given out of order; "b" overlaps "a" (another stream): no gap there, and
    # "inner" runs within "b": the gap after it is measured from the end of "b"
    kernels = [kernel_event("c", 40, 50), kernel_event("a", 0, 10), kernel_event("b", 5, 12)]
    kernels += [kernel_event("inner", 6, 7)]
    kernels += [kernel_event("a", 100, 110), kernel_event("b", 111, 120), kernel_event("c", 1120, 1130)]
    gaps = prefill_hf.device_gaps(kernels, repeats=2)
    # gaps: 12..40 (28), 50..100 (50), 110..111 (1), 120..1120 (1000): 1079 us over 2 calls
    assert gaps["idle_ms"] == pytest.approx(1079 / 2 / 1e3)
    assert [(g["us"], g["after"], g["before"]) for g in gaps["gaps_top_us"][:2]] == [(1000, "b", "c"), (50, "c", "a")]
    assert len(gaps["gaps_top_us"]) == 4
    many = [kernel_event(str(i), 10 * i, 10 * i + 5) for i in range(20)]
    assert len(prefill_hf.device_gaps(many, repeats=1)["gaps_top_us"]) == prefill_hf.GAPS_TOP


def test_kernel_ms_by_name_sums_each_name_per_call_most_first() -> None:
    kernels = [kernel_event("gemm", 0, 300), kernel_event("norm", 300, 400), kernel_event("gemm", 500, 800)]
    kernels += [kernel_event("norm", 800, 850), kernel_event("quant", 900, 1600)]
    by_name = prefill_hf.kernel_ms_by_name(kernels, repeats=2)
    assert by_name == pytest.approx({"quant": 0.35, "gemm": 0.3, "norm": 0.075})
    assert list(by_name) == ["quant", "gemm", "norm"]


def test_device_allocs_is_empty_on_cpu() -> None:
    assert prefill_hf.device_allocs(torch.device("cpu")) == {}


def test_a_kv_replicated_sharded_model_runs_under_simulated_tp() -> None:
    for rank in range(2):
        model = tiny_qwen4_exp(num_key_value_heads=1)
        with simulated_tp(2, rank) as ledger, torch.no_grad():
            prefill_hf.replicate_kv_heads(model, 2)
            prefill_hf.shard_for_tp(model, rank, 2)
            (attention,) = attention_modules(model)
            assert attention.k_proj.out_features == 16 and attention.num_key_value_groups == 2
            ids = prefill_hf.input_ids(12, model.config.vocab_size, torch.device("cpu"))
            logits = model(input_ids=ids, logits_to_keep=1).logits
        assert logits.shape == (1, 1, model.config.vocab_size) and bool(logits.isfinite().all())
        assert ledger.counts() == {"all_reduce": 8}  # 4 layers x (token mixer + MoE)


def test_hc_bound_and_error_records() -> None:
    bound = prefill_hf.hc_bound({"unsharded_kernel_ms": 3.0, "sharded_kernel_ms": 0.8}, 12.0, tp=4)
    assert bound == {"hc_share": 0.25, "hc_bound": 0.25 * 0.75}

    def fails() -> dict:
        raise ValueError("num_key_value_heads = 2 is not divisible by tp = 8")

    record = prefill_hf.guarded(fails)
    assert record["error"].startswith("ValueError: num_key_value_heads") and "Traceback" in record["traceback"]
    report = {"cases": [{"model": "qwen4_exp", "dtype": "fp8", "tp": 8, "tokens": 16, **record}]}
    assert "error: ValueError" in prefill_hf.table(report)


def test_hcpasses_vs_handwritten_is_handwritten_ms_over_hcpasses_ms() -> None:
    variants = {
        "handwritten_sp": {"compute_ms": 2.4, "kernel_ms": 3.0, "wall_ms": 4.0},
        "hcpasses_sp": {"compute_ms": 2.0, "kernel_ms": 2.0, "wall_ms": 5.0},
    }
    assert prefill_hf.vs_handwritten(variants) == pytest.approx({"compute_ms": 1.2, "kernel_ms": 1.5, "wall_ms": 0.8})
    assert prefill_hf.vs_handwritten({**variants, "handwritten_sp": {"error": "ValueError: deepseek_v4"}}) == {}
    assert prefill_hf.vs_handwritten({"hcpasses_sp": variants["hcpasses_sp"]}) == {}
    case = {"model": "qwen4_exp", "dtype": "bf16", "tp": 2, "tokens": 16, "variants": {}}
    case["hcpasses_vs_handwritten"] = prefill_hf.vs_handwritten(variants)
    assert "hand-written ms / hcpasses ms): compute 1.200x, wall 0.800x" in prefill_hf.table({"cases": [case]})


def test_sp_gains_are_fractions_of_sp_off_and_of_the_bound() -> None:
    variants = {
        "sp_off": {"compute_ms": 20.0, "kernel_ms": 20.0, "wall_ms": 25.0},
        "hcpasses_sp": {"compute_ms": 15.0, "kernel_ms": 16.0, "wall_ms": 21.0},
    }
    gains = prefill_hf.sp_gains(variants, bound=0.3)
    assert gains == pytest.approx(
        {"sp_compute_gain": 0.25, "sp_gain_of_bound": 0.25 / 0.3, "sp_wall_over_kernel_gain": 0.16 / 0.2}
    )
    assert prefill_hf.sp_gains({"sp_off": variants["sp_off"], "hcpasses_sp": {"error": "x"}}, bound=0.3) == {}
    assert prefill_hf.sp_gains(variants, bound=0.0) == {"sp_compute_gain": 0.25}  # tp 1


def test_subsets_are_checked() -> None:
    with pytest.raises(SystemExit):
        prefill_hf.parse_args(["--models", "llama"])
    settings, path = prefill_hf.parse_args(["--cpu-smoke", "--tp", "1,2", "--tag", "x"])
    assert settings.tps == (1, 2) and settings.tokens == (32,) and path.name == "smoke_prefill_hf_x.json"


def test_qsa_batched_reaches_the_selection_op_and_the_header(monkeypatch, tmp_path: Path) -> None:
    """``--qsa-batched`` (default off) opens ``eager_kernels_under_compile(qsa_batched=True)`` and is recorded in
    the JSON header's settings; ``--as-traced`` opens no context at all."""
    opened = []

    @contextlib.contextmanager
    def kernels(qsa_batched: bool = False):
        opened.append(qsa_batched)
        yield {"qsa_selection_op": []}

    monkeypatch.setattr(prefill_hf, "eager_kernels_under_compile", kernels)
    monkeypatch.setattr(prefill_hf, "run_cases", lambda settings, path, report: None)
    for argv, wanted in ((["--cpu-smoke"], [False]), (["--cpu-smoke", "--qsa-batched"], [True])):
        opened.clear()
        settings, _ = prefill_hf.parse_args(argv)
        report = prefill_hf.run(settings, tmp_path / "x.json", "cmd")
        assert opened == wanted and report["settings"]["qsa_batched"] is wanted[0]
    opened.clear()
    prefill_hf.run(prefill_hf.parse_args(["--cpu-smoke", "--as-traced"])[0], tmp_path / "x.json", "cmd")
    assert opened == []


@pytest.mark.thorough
def test_cpu_smoke_end_to_end(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/prefill_hf.py", "--cpu-smoke", "--models", "qwen4_exp", "--tp", "1,2"]
    command += ["--dtypes", "bf16", "--variants", ",".join(prefill_hf.VARIANTS), "--repeats", "1", "--warmup", "0"]
    command += ["--out", str(tmp_path), "--trace", str(tmp_path / "traces")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "smoke_prefill_hf.json").read_text())
    assert [(case["tp"], case["tokens"]) for case in report["cases"]] == [(1, 32), (2, 32)]
    # the header says which code ran, when and how: the grid picks each cell's newest run by it
    assert report["command"] == " ".join(["python benchmarks/prefill_hf.py", *command[2:]])
    assert datetime.datetime.fromisoformat(report["started"]).tzinfo is not None
    if (ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", report["commit"]), report["commit"]
    assert (tmp_path / "smoke_prefill_hf.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    traces = sorted(path.name for path in (tmp_path / "traces").iterdir())
    expected = [f"trace_qwen4_exp_bf16_tp{tp}_T32_{v}.json" for tp in (1, 2) for v in prefill_hf.VARIANTS]
    assert traces == sorted(expected)
    trace = json.loads((tmp_path / "traces" / "trace_qwen4_exp_bf16_tp2_T32_hcpasses_sp.json").read_text())
    assert any(event.get("name", "").startswith("simulated_tp::") for event in trace["traceEvents"])
    for case in report["cases"]:
        assert "error" not in case, case
        for variant, row in case["variants"].items():
            assert "error" not in row, (variant, row["error"])
            assert row["kernels"] > 0 and row["kernel_ms"] > 0 and row["compile_s"] > 0
            assert (row["comm_ms"] > 0) == (case["tp"] == 2)
            # the stand-in collectives' copies are taken out of compute: the gathers and scatters of the SP variants
            # at tp 2; tp 1 runs none, and the in-place all-reduce stand-in of the others copies nothing (as on the GPU)
            assert (row["standin_ms"] > 0) == (case["tp"] == 2 and variant in ("hcpasses_sp", "handwritten_sp"))
            assert row["compute_ms"] == pytest.approx(row["kernel_ms"] - row["standin_ms"])
            host = row["host_top_ms"]  # the calls with the most host time, most first
            assert 0 < len(host) <= prefill_hf.HOST_TOP and list(host.values()) == sorted(host.values(), reverse=True)
            assert all(ms >= 0 for ms in host.values()) and max(host.values()) > 0, host
            assert row["allocator_per_call"] == {} and "idle_ms" not in row and "kernel_ms_by_name" not in row
            if variant == "inductor":
                assert row["rel_diff_vs_inductor"] == 0.0 and "reports" not in row
                continue
            if variant == "handwritten_sp":  # plain Inductor on the hand-written model: sharded at tp 2, no reports
                assert row["sp_applied"] == (case["tp"] == 2) and "reports" not in row
                if case["tp"] == 1:  # one rank: the same function as the model, so inductor's logits (fp32)
                    assert row["rel_diff_vs_inductor"] < 1e-5
                continue
            assert row["sp_applied"] == (variant == "hcpasses_sp" and case["tp"] == 2), (case["tp"], variant)
            assert len(row["reports"]) == row["graphs"] and all("sp_rewrite" in text for text in row["reports"])
            # no comparison where the stand-in gathers make the rows another rank's copies
            assert (row["rel_diff_vs_inductor"] is None) == row["sp_applied"], (variant, row["rel_diff_vs_inductor"])
        assert 0 < case["hc_share"] < 1 and case["hc_bound"] == pytest.approx(case["hc_share"] * (1 - 1 / case["tp"]))
        assert set(case["hcpasses_vs_handwritten"]) == {"compute_ms", "kernel_ms", "wall_ms"}
        if case["tp"] == 2:
            assert case["sp_gain_of_bound"] == pytest.approx(case["sp_compute_gain"] / case["hc_bound"])
        else:  # nothing to shard at tp 1: no bound to be a fraction of
            assert "sp_gain_of_bound" not in case
        assert all(ratio > 0 for ratio in case["hcpasses_vs_handwritten"].values())
    sharded = report["cases"][1]["variants"]
    assert sharded["sp_off"]["collectives"] == {"all_reduce": 4}  # 2 layers x (token mixer + MoE)
    assert {"all_gather", "reduce_scatter"} <= set(sharded["hcpasses_sp"]["collectives"])
    # by hand: an all-gather of x and a reduce-scatter per sub-layer, the PLE conv's halo, the last token's row
    assert sharded["handwritten_sp"]["collectives"] == {"all_gather": 6, "reduce_scatter": 4}
    assert "hcpasses SP vs hand-written SP" in done.stdout


def test_the_timed_calls_run_with_the_garbage_collector_paused_and_it_is_restored() -> None:
    import gc

    seen = []
    times = prefill_hf.wall_ms(lambda: seen.append(gc.isenabled()), 3, torch.device("cpu"))
    assert seen == [False] * 3 and len(times) == 3 and all(ms >= 0 for ms in times)
    assert gc.isenabled()
    prefill_hf.profiled(lambda: seen.append(gc.isenabled()), 2, torch.device("cpu"))
    assert seen[3:] == [False, False] and gc.isenabled()
    gc.disable()
    try:
        with prefill_hf.gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    with pytest.raises(KeyError), prefill_hf.gc_paused():
        raise KeyError("body")
    assert gc.isenabled()

"""``benchmarks/prefill_hf_grid.py``: which run each cell's row comes from, the cells not measured, which JSONs it
reads, the README's table kept current, and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import prefill_hf_grid as grid  # noqa: E402


def variant(compute: float, wall: float, **extra: Any) -> dict[str, Any]:
    return {"compute_ms": compute, "wall_ms": wall, **extra}


def case(tp: int = 8, tokens: int = 16384, model: str = "qwen4_exp", dtype: str = "bf16", **variants: Any) -> dict:
    return {"model": model, "dtype": dtype, "tp": tp, "tokens": tokens, "variants": variants}


def report(path: Path, cases: list[dict], date: str = "2026-12-05", **header: Any) -> Path:
    settings = {"layers": header.pop("layers", 3)}
    body = {"date": date, "device": "NVIDIA H200", "torch": "2.11.0+cu130", "settings": settings, "cases": cases}
    path.write_text(json.dumps({**body, **header}))
    return path


def test_a_cells_row_is_its_newest_run_then_the_one_comparing_more_variants_then_the_later_file(tmp_path: Path) -> None:
    three = {"sp_off": variant(20, 21), "hcpasses_sp": variant(11, 12), "handwritten_sp": variant(11.1, 12.1)}
    two = {"hcpasses_sp": variant(10, 11), "handwritten_sp": variant(10.2, 11.3)}
    old = report(tmp_path / "prefill_hf_old.json", [case(**three)], date="2026-12-04")
    full = report(tmp_path / "prefill_hf_full.json", [case(**three)])
    pair = report(tmp_path / "prefill_hf_pair.json", [case(**two)])
    newer = report(tmp_path / "prefill_hf_newer.json", [case(**two)], started="2026-12-05T20:00:00+00:00")
    cell = grid.Cell("qwen4_exp", "bf16", 8, 16384)
    assert grid.newest(grid.load([full, old]))[cell].file == full.name  # the newer date, whatever the order
    assert grid.newest(grid.load([full, pair]))[cell].file == full.name  # same date: more variants compared
    assert grid.newest(grid.load([pair, full]))[cell].file == full.name
    assert grid.newest(grid.load([full, newer]))[cell].file == newer.name  # a start time beats none
    again = report(tmp_path / "prefill_hf_again.json", [case(**three)])
    assert grid.newest(grid.load([full, again]))[cell].file == again.name  # a tie: the later file
    assert grid.newest(grid.load([again, full]))[cell].file == full.name
    # a variant that raised does not count as compared
    failed = {**three, "handwritten_sp": {"error": "ValueError: no hand-written SP"}}
    assert grid.load([report(tmp_path / "prefill_hf_failed.json", [case(**failed)])])[0].compared == 2


def test_missing_names_every_cell_of_the_grid_no_run_measured(tmp_path: Path) -> None:
    cases = [case(tp=tp, sp_off=variant(1, 1)) for tp in (1, 2, 4, 8)]
    cases.append(case(tp=3, sp_off=variant(1, 1)))  # outside the grid: measured, not counted against it
    rows = grid.newest(grid.load([report(tmp_path / "prefill_hf_a.json", cases)]))
    gaps = grid.missing(rows)
    assert len(gaps) == len(grid.MODELS) * len(grid.DTYPES) * len(grid.TPS) * len(grid.TOKENS) - 4
    assert grid.Cell("qwen4_exp", "bf16", 2, 16384) not in gaps and grid.Cell("qwen4_exp", "bf16", 2, 65536) in gaps
    assert grid.Cell("deepseek_v4", "fp8", 8, 16384) in gaps


def test_the_default_runs_leave_out_smoke_runs_scratch_jsons_and_superseded_runs(tmp_path: Path) -> None:
    kept = report(tmp_path / "prefill_hf_kept.json", [case(sp_off=variant(1, 1))])
    report(tmp_path / "smoke_prefill_hf.json", [case(sp_off=variant(1, 1))])
    superseded = next(iter(grid.SUPERSEDED))
    report(tmp_path / superseded, [case(sp_off=variant(1, 1))])
    scratch = tmp_path / "prefill_hf_kernel_profile.json"
    scratch.write_text(json.dumps({"date": "2026-12-03", "cases": []}))  # a scratch script's: no settings
    assert grid.default_paths(tmp_path) == [kept]
    with pytest.raises(ValueError, match=r"prefill_hf_kernel_profile\.json: not a prefill_hf\.py run"):
        grid.load([scratch])


def test_a_row_shows_what_its_run_measured_and_marks_the_rest(tmp_path: Path) -> None:
    measured = case(
        sp_off=variant(20.0, 21.0),
        hcpasses_sp=variant(10.0, 11.5, kernels_per_layer=107.4),
        handwritten_sp=variant(10.5, 11.0),
    )
    measured |= {"sp_compute_gain": 0.5, "sp_gain_of_bound": 1.5, "sp_wall_over_kernel_gain": 0.93}
    measured["hcpasses_vs_handwritten"] = {"compute_ms": 1.05}
    (run,) = grid.load([report(tmp_path / "prefill_hf_a.json", [measured], layers=None)])
    cells = dict(zip(grid.HEADER, grid.row_cells(run), strict=True))
    assert cells["layers"] == "4"  # prefill_hf.py's default for qwen4_exp where the settings say None
    assert cells["GPU, date"] == "H200, 2026-12-05"
    assert cells["SP off compute / wall ms"] == "20.00 / 21.00"
    assert cells["hand-written SP compute / wall ms"] == "10.50 / 11.00"
    assert cells["SP compute gain (of HC bound)"] == "50.0 % (1.50)"
    assert cells["wall gain / kernel gain"] == "0.93"
    assert cells["hcpasses / hand-written compute"] == "1.050x"
    assert cells["kernels per layer"] == "107"
    ds = case(model="deepseek_v4", sp_off=variant(57.0, 58.0), hcpasses_sp=variant(46.0, 48.0))
    ds["variants"]["handwritten_sp"] = {"error": "ValueError: handwritten_sp covers qwen4_exp"}
    ds["hcpasses_vs_handwritten"] = {"compute_ms": 9.9}  # stale: the hand-written variant raised
    (run,) = grid.load([report(tmp_path / "prefill_hf_ds.json", [ds], layers=None)])
    cells = dict(zip(grid.HEADER, grid.row_cells(run), strict=True))
    assert cells["layers"] == "2"
    assert cells["hand-written SP compute / wall ms"] == grid.NOT_RUN
    assert cells["hcpasses / hand-written compute"] == grid.NOT_RUN
    assert cells["SP compute gain (of HC bound)"] == grid.NOT_RUN and cells["kernels per layer"] == grid.NOT_RUN


def test_the_table_lists_same_day_runs_of_a_cell_and_the_cells_not_measured(tmp_path: Path) -> None:
    three = {"sp_off": variant(20, 21), "hcpasses_sp": variant(11, 12), "handwritten_sp": variant(11.1, 12.1)}
    pair = case(hcpasses_sp=variant(10, 11), handwritten_sp=variant(10.2, 11.3))
    pair["hcpasses_vs_handwritten"] = {"compute_ms": 1.02}
    runs = grid.load(
        [
            report(tmp_path / "prefill_hf_old.json", [case(**three)], date="2026-12-04"),
            report(tmp_path / "prefill_hf_full.json", [case(**three)]),
            report(tmp_path / "prefill_hf_pair.json", [pair]),
        ]
    )
    table = grid.markdown(runs)
    assert table.count("| qwen4_exp |") == 1 and "`prefill_hf_full.json` |" in table
    assert "- qwen4_exp bf16 tp 8 T = 16384: `prefill_hf_pair.json` (H200, 2026-12-05, 1.020x)" in table
    assert "prefill_hf_old.json" not in table  # another day's run: older code, docs/BENCHMARKS.md has it
    assert "Not measured (31 of 32 cells): qwen4_exp bf16 tp 1 T = 16384," in table


def test_the_readme_table_is_the_one_the_committed_runs_give() -> None:
    text = (ROOT / "README.md").read_text()
    table = grid.markdown(grid.load(grid.default_paths(ROOT / "benchmarks" / "results")))
    assert grid.replace_block(text, table) == text, "stale: python benchmarks/prefill_hf_grid.py --readme"


def test_replace_block_rewrites_between_one_pair_of_markers_only() -> None:
    text = f"head\n{grid.BEGIN}\nold\n{grid.END}\ntail\n"
    assert grid.replace_block(text, "new") == f"head\n{grid.BEGIN}\nnew\n{grid.END}\ntail\n"
    for broken in ("no markers", text + grid.BEGIN, text + grid.END):
        with pytest.raises(ValueError, match=r"README\.md needs one"):
            grid.replace_block(broken, "new")


def test_the_plot_is_written_where_matplotlib_imports_and_refused_where_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = case(sp_off=variant(20, 21), hcpasses_sp=variant(11, 12), handwritten_sp=variant(11.1, 12.1))
    rows = grid.newest(grid.load([report(tmp_path / "prefill_hf_a.json", [measured | {"hc_bound": 0.3}])]))
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "matplotlib", None)  # import fails
        assert grid.plot(rows, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()
    pytest.importorskip("matplotlib")
    assert grid.plot(rows, tmp_path / "grid.png") is True
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speedup_is_sp_offs_compute_over_the_variants_within_one_run(tmp_path: Path) -> None:
    measured = case(sp_off=variant(30, 31), hcpasses_sp=variant(12, 13))
    (run,) = grid.load([report(tmp_path / "prefill_hf_a.json", [measured])])
    assert grid.speedup(run, "hcpasses_sp") == pytest.approx(2.5)
    assert grid.speedup(run, "handwritten_sp") is None


def test_the_missing_cells_become_one_prefill_hf_run_per_model_dtype_and_tp_tp_1_last(tmp_path: Path) -> None:
    every = [
        case(model=m, dtype=d, tp=tp, tokens=t, sp_off=variant(1, 1), handwritten_sp=variant(1, 1))
        for m in grid.MODELS
        for d in grid.DTYPES
        for tp in grid.TPS
        for t in grid.TOKENS
    ]
    left = [(c["model"], c["dtype"], c["tp"]) for c in every]
    keep = [
        c
        for c, key in zip(every, left, strict=True)
        if key not in {("qwen4_exp", "fp8", 4), ("qwen4_exp", "bf16", 1), ("deepseek_v4", "bf16", 8)}
        and not (key == ("qwen4_exp", "fp8", 8) and c["tokens"] == 65536)
    ]
    rows = grid.newest(grid.load([report(tmp_path / "prefill_hf_a.json", keep)]))
    commands = grid.missing_commands(rows)
    assert [c.split(" --variants")[0] for c in commands] == [
        "--models qwen4_exp --layers 3 --dtypes fp8 --tp 8 --tokens 65536",
        "--models qwen4_exp --layers 3 --dtypes fp8 --tp 4 --tokens 16384,65536",
        "--models deepseek_v4 --layers 2 --dtypes bf16 --tp 8 --tokens 16384,65536",
        "--models qwen4_exp --layers 3 --dtypes bf16 --tp 1 --tokens 16384,65536",  # tp 1 last, whatever the model
    ]
    assert all(" --variants sp_off,hcpasses_sp,handwritten_sp " in command for command in commands)
    assert commands[0].endswith("--tag grid_qwen4_exp_fp8_tp8")
    assert grid.missing_commands(grid.newest(grid.load([report(tmp_path / "prefill_hf_all.json", every)]))) == []


def test_a_cell_measured_without_the_hand_written_sp_is_measured_again_and_named(tmp_path: Path) -> None:
    anchored = case(model="deepseek_v4", tp=8, tokens=16384, sp_off=variant(9, 9), handwritten_sp=variant(8, 8))
    alone = case(model="deepseek_v4", tp=4, tokens=65536, sp_off=variant(9, 9), hcpasses_sp=variant(7, 7))
    failed = case(model="deepseek_v4", tp=2, tokens=16384, sp_off=variant(9, 9), hcpasses_sp=variant(7, 7))
    failed["variants"]["handwritten_sp"] = {"error": "RuntimeError: out of memory"}
    rows = grid.newest(grid.load([report(tmp_path / "prefill_hf_a.json", [anchored, alone, failed])]))
    assert set(grid.unanchored(rows)) == {
        grid.Cell("deepseek_v4", "bf16", 4, 65536),
        grid.Cell("deepseek_v4", "bf16", 2, 16384),
    }
    commands = [c.split(" --variants")[0] for c in grid.missing_commands(rows)]
    assert "--models deepseek_v4 --layers 2 --dtypes bf16 --tp 4 --tokens 16384,65536" in commands  # missing + alone
    assert "--models deepseek_v4 --layers 2 --dtypes bf16 --tp 2 --tokens 16384,65536" in commands
    assert "--models deepseek_v4 --layers 2 --dtypes bf16 --tp 8 --tokens 65536" in commands  # the anchored T stays
    text = grid.markdown(grid.load([report(tmp_path / "prefill_hf_a.json", [anchored, alone, failed])]))
    named = "deepseek_v4 bf16 tp 2 T = 16384, deepseek_v4 bf16 tp 4 T = 65536"
    assert f"Measured without the hand-written SP beside hcpasses': {named}." in text


def test_a_cell_whose_run_failed_in_every_variant_is_named_with_its_error_and_measured_last(tmp_path: Path) -> None:
    """deepseek_v4 at T = 65536 ran out of memory on an 80 GB H100 in every variant (2026-12-07): such a run is no
    row (an earlier run's row stays), the table names the cell with the error, GPU, date and file, and its command
    comes after every other (it may need a GPU with more memory)."""
    oom = {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.06 GiB."}
    failed = case(model="deepseek_v4", tp=8, tokens=65536, sp_off=oom, hcpasses_sp=oom, handwritten_sp=oom)
    ran = case(model="deepseek_v4", tp=8, tokens=16384, sp_off=variant(9, 9), handwritten_sp=variant(8, 8))
    runs = grid.load([report(tmp_path / "prefill_hf_a.json", [failed, ran], device="NVIDIA H100 80GB HBM3")])
    rows = grid.newest(runs)
    cell = grid.Cell("deepseek_v4", "bf16", 8, 65536)
    assert cell not in rows and set(grid.failures(runs, rows)) == {cell}
    text = grid.markdown(runs)
    expected = f"- {grid.label(cell)}: OutOfMemoryError on H100, 2026-12-05, `prefill_hf_a.json`"
    assert expected in text.splitlines(), text
    assert "; 1 of them failed, below)" in text and f"{grid.label(cell)}," not in text.split("Failed in every")[0]
    commands = [c.split(" --variants")[0] for c in grid.missing_commands(rows, frozenset(grid.failures(runs, rows)))]
    assert commands[-1] == "--models deepseek_v4 --layers 2 --dtypes bf16 --tp 8 --tokens 65536"
    assert commands.index(commands[-1]) > commands.index("--models qwen4_exp --layers 3 --dtypes bf16 --tp 1 "
                                                         "--tokens 16384,65536")  # fmt: skip
    # a later run that fails leaves the earlier row where it was
    earlier = case(model="deepseek_v4", tp=8, tokens=65536, sp_off=variant(30, 31), hcpasses_sp=variant(25, 26))
    both = [report(tmp_path / "prefill_hf_0.json", [earlier], date="2026-12-04"), tmp_path / "prefill_hf_a.json"]
    runs = grid.load(both)
    assert grid.newest(runs)[cell].file == "prefill_hf_0.json" and not grid.failures(runs, grid.newest(runs))

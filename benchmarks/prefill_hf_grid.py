"""Issue #27's grid of ``prefill_hf.py`` runs, from the JSONs measured so far: a table, a plot, and what is missing.

Run from the repository root (no GPU: it reads results)::

    python benchmarks/prefill_hf_grid.py                  # every prefill_hf JSON under benchmarks/results
    python benchmarks/prefill_hf_grid.py a.json b.json    # those runs only
    python benchmarks/prefill_hf_grid.py --readme         # rewrite README.md's table between its markers
    python benchmarks/prefill_hf_grid.py --missing-commands   # prefill_hf.py arguments for the cells not measured

The grid is models x dtypes x tp (1, 2, 4, 8) x T (16384, 65536), as issue #27 asks of ``prefill_hf.py``. One row
per cell that a run measured. A row holds one run's case (one process, one device call): variants are compared only
side by side in the run that timed them (the device tool's METHOD). Where several runs measured a cell, the row
is the newest run's (its date), then the one comparing more of ``sp_off``, ``hcpasses_sp`` and ``handwritten_sp``
without error, then the later file in sorted (or argument) order. Runs listed in ``SUPERSEDED`` are left out by
default, each for the reason given there.

Columns: compute ms (kernel time less the stand-in collectives' copies) and wall ms per variant, SP's compute gain
over SP off and its fraction of the HC-only bound (goal >= 0.9), the wall gain over the kernel gain (goal >= 0.9),
hcpasses SP over the hand-written SP in compute (hand-written ms / hcpasses ms; goal >= 1), kernels per decoder
layer of hcpasses SP (goal <= 150). Prints the table (markdown), writes ``prefill_hf_grid.png`` to ``--out`` where
matplotlib imports, and with ``--readme`` puts the table into README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")
README = Path("README.md")
BEGIN, END = "<!-- prefill-hf:begin -->", "<!-- prefill-hf:end -->"
MODELS = ("qwen4_exp", "deepseek_v4")
DTYPES = ("bf16", "fp8")
TPS = (1, 2, 4, 8)
TOKENS = (16384, 65536)
COMPARED = ("sp_off", "hcpasses_sp", "handwritten_sp")
NOT_RUN = "\u2013"  # an en dash: the table's mark for what a run did not measure
DEFAULT_LAYERS = {"qwen4_exp": 4, "deepseek_v4": 2}  # prefill_hf.py's default where a run's settings say None

# Runs of code or settings that a later fix changed in the measured cell, left out of the grid (they stay in
# docs/BENCHMARKS.md as history).
SUPERSEDED = {
    "prefill_hf_ds_h200_pad_refused.json": "before f1f3a18: SP refused the pads Inductor's pad_mm writes on CUDA",
    "prefill_hf_ds_tp8_h200.json": "1 layer, before the SP prologue (f70825c) and the kept exit rows",
    "prefill_hf_q1_fla_graph_breaks_h200.json": "1 layer: the graph-break experiment of issue #27 item 4",
}


@dataclass(frozen=True)
class Cell:
    model: str
    dtype: str
    tp: int
    tokens: int


@dataclass(frozen=True)
class Run:
    """One case of one JSON: the cell, the run's header and the case's rows."""

    cell: Cell
    file: str
    date: str
    started: str  # the run's start time where its header records it (since 2026-12-06), else ""
    device: str
    torch: str
    layers: int
    case: dict[str, Any]

    def variant(self, name: str) -> dict[str, Any] | None:
        row = self.case.get("variants", {}).get(name)
        return None if row is None or "error" in row else row

    @property
    def compared(self) -> int:
        return sum(self.variant(name) is not None for name in COMPARED)


def is_prefill_hf_run(report: dict[str, Any]) -> bool:
    """Written by ``prefill_hf.py`` (its header), not by a scratch script that shares the name (a kernel profile)."""
    return "settings" in report and "cases" in report


def load(paths: Sequence[Path]) -> list[Run]:
    """Every case of every run in ``paths`` that has variants (a case that failed whole is left out)."""
    runs = []
    for path in paths:
        report = json.loads(path.read_text())
        if not is_prefill_hf_run(report):
            raise ValueError(f"{path}: not a prefill_hf.py run (no 'settings' and 'cases' in it)")
        layers = report["settings"].get("layers")
        for case in report.get("cases", []):
            if "variants" not in case:
                continue
            cell = Cell(case["model"], case["dtype"], case["tp"], case["tokens"])
            n_layers = layers if layers is not None else DEFAULT_LAYERS[cell.model]
            header = (path.name, report["date"], report.get("started", ""), report["device"], report["torch"])
            runs.append(Run(cell, *header, n_layers, case))
    return runs


def _latest(runs: Sequence[Run]) -> dict[Cell, Run]:
    chosen: dict[Cell, tuple[tuple[str, str, int, int], Run]] = {}
    for order, run in enumerate(runs):
        rank = (run.date, run.started, run.compared, order)
        if run.cell not in chosen or rank > chosen[run.cell][0]:
            chosen[run.cell] = (rank, run)
    return {cell: run for cell, (_, run) in chosen.items()}


def newest(runs: Sequence[Run]) -> dict[Cell, Run]:
    """Each cell's row: of the runs in which a variant ran, the newest date (and start time, where recorded), then
    the most compared variants, then the later file in ``runs``' order."""
    return _latest([run for run in runs if run.compared])


def failures(runs: Sequence[Run], rows: dict[Cell, Run]) -> dict[Cell, Run]:
    """The cells without a row whose runs failed in every variant (out of memory on an 80 GB H100, say), each with
    its newest such run."""
    return _latest([run for run in runs if not run.compared and run.cell not in rows])


def failure(run: Run) -> str:
    """What a failed run's variants raised (the exception's name; the distinct ones), where and when."""
    errors = sorted({str(row["error"]).split(":")[0] for row in run.case["variants"].values() if "error" in row})
    return f"{', '.join(errors) or 'no variant ran'} on {short_device(run.device)}, {run.date}, `{run.file}`"


def default_paths(results: Path) -> list[Path]:
    """The prefill_hf.py runs under ``results`` (not its CPU smoke runs, named ``smoke_``; not a scratch script's
    JSON of the same name), less ``SUPERSEDED``, in sorted order."""
    paths = [p for p in sorted(results.glob("prefill_hf_*.json")) if p.name not in SUPERSEDED]
    return [p for p in paths if is_prefill_hf_run(json.loads(p.read_text()))]


def missing(rows: dict[Cell, Run]) -> list[Cell]:
    """The cells of issue #27's grid that no run measured."""
    grid = [Cell(m, d, tp, t) for m in MODELS for d in DTYPES for tp in TPS for t in TOKENS]
    return [cell for cell in grid if cell not in rows]


def unanchored(rows: dict[Cell, Run]) -> list[Cell]:
    """The measured cells whose row has no hand-written SP beside hcpasses' (deepseek_v4 had none before 2026-12-07)."""
    return [cell for cell, run in rows.items() if run.variant("handwritten_sp") is None]


GRID_LAYERS = {"qwen4_exp": 3, "deepseek_v4": 2}  # what fits a device call (4 qwen4_exp layers do not: BENCHMARKS)


def missing_commands(rows: dict[Cell, Run], failed: frozenset[Cell] = frozenset()) -> list[str]:
    """``prefill_hf.py`` arguments that measure the missing cells and those measured without the hand-written SP,
    one run per model, dtype and tp (one model build serves its T): every tp > 1 before any tp 1 (SP's goals are at
    tp > 1), then qwen4_exp first, tp 8, 4, 2, bf16 before fp8; runs of ``failed`` cells alone come last (they may
    need a GPU with more memory than the one they failed on)."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    for cell in missing(rows) + unanchored(rows):
        groups.setdefault((cell.model, cell.dtype, cell.tp), []).append(cell.tokens)
    order = {m: i for i, m in enumerate(MODELS)}

    def only_failed(key: tuple[str, str, int]) -> bool:
        return all(Cell(*key, tokens) in failed for tokens in groups[key])

    keys = sorted(groups, key=lambda k: (only_failed(k), k[2] == 1, order[k[0]], -k[2], DTYPES.index(k[1])))
    return [
        f"--models {model} --layers {GRID_LAYERS[model]} --dtypes {dtype} --tp {tp} "
        f"--tokens {','.join(map(str, sorted(groups[model, dtype, tp])))} --variants {','.join(COMPARED)} "
        f"--warmup 1 --repeats 3 --tag grid_{model}_{dtype}_tp{tp}"
        for model, dtype, tp in keys
    ]


def short_device(device: str) -> str:
    match = re.search(r"[HABL]\d{2,3}", device)
    return match.group(0) if match else device


def ms(row: dict[str, Any] | None) -> str:
    return NOT_RUN if row is None else f"{row['compute_ms']:.2f} / {row['wall_ms']:.2f}"


def ratio(value: float | None, digits: int = 3, suffix: str = "x") -> str:
    return NOT_RUN if value is None else f"{value:.{digits}f}{suffix}"


def row_cells(run: Run) -> list[str]:
    """One table row: the cell, where and when, each variant's ms, the gains and ratios."""
    case, sp, hand = run.case, run.variant("hcpasses_sp"), run.variant("handwritten_sp")
    gain = case.get("sp_compute_gain")
    of_bound = case.get("sp_gain_of_bound")
    gain_text = NOT_RUN if gain is None else f"{100 * gain:.1f} %" + ("" if of_bound is None else f" ({of_bound:.2f})")
    vs_hand = case.get("hcpasses_vs_handwritten", {}).get("compute_ms") if sp and hand else None
    per_layer = None if sp is None else sp.get("kernels_per_layer")
    cell = run.cell
    return [
        cell.model,
        cell.dtype,
        str(cell.tp),
        str(cell.tokens),
        str(run.layers),
        f"{short_device(run.device)}, {run.date}",
        ms(run.variant("sp_off")),
        ms(sp),
        ms(hand),
        gain_text,
        ratio(case.get("sp_wall_over_kernel_gain"), 2, ""),
        ratio(vs_hand),
        NOT_RUN if per_layer is None else f"{per_layer:.0f}",
        f"`{run.file}`",
    ]


HEADER = [
    "model",
    "dtype",
    "tp",
    "T",
    "layers",
    "GPU, date",
    "SP off compute / wall ms",
    "hcpasses SP compute / wall ms",
    "hand-written SP compute / wall ms",
    "SP compute gain (of HC bound)",
    "wall gain / kernel gain",
    "hcpasses / hand-written compute",
    "kernels per layer",
    "run",
]


def others(runs: Sequence[Run], rows: dict[Cell, Run], cell: Cell) -> str:
    """The other runs of ``cell`` on the date of its row (older days ran older code: docs/BENCHMARKS.md has them): file,
    GPU and date, and hcpasses over the hand-written SP where both ran."""
    found = []
    for run in runs:
        if run.cell != cell or run is rows[cell] or run.date != rows[cell].date:
            continue
        vs_hand = run.case.get("hcpasses_vs_handwritten", {}).get("compute_ms")
        where = f"`{run.file}` ({short_device(run.device)}, {run.date}"
        found.append(where + (f", {vs_hand:.3f}x)" if vs_hand else ")"))
    return "; ".join(found)


def label(cell: Cell) -> str:
    return f"{cell.model} {cell.dtype} tp {cell.tp} T = {cell.tokens}"


def markdown(runs: Sequence[Run]) -> str:
    """The table of measured cells in grid order, the other runs of those cells, and the cells not measured."""
    rows = newest(runs)
    order = {m: i for i, m in enumerate(MODELS)}
    cells = sorted(rows, key=lambda c: (order[c.model], c.dtype, c.tokens, c.tp))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row_cells(rows[cell])) + " |" for cell in cells]
    repeated = [(cell, others(runs, rows, cell)) for cell in cells]
    if any(text for _, text in repeated):
        lines += ["", "Other runs of these cells on the same date (hcpasses / hand-written compute where both ran):"]
        lines += [""]
        lines += [f"- {label(cell)}: {text}" for cell, text in repeated if text]
    gaps, failed = missing(rows), failures(runs, rows)
    if untried := [cell for cell in gaps if cell not in failed]:
        named = ", ".join(label(c) for c in untried)
        of_them = f"; {len(failed)} of them failed, below" if failed else ""
        lines += ["", f"Not measured ({len(gaps)} of {len(gaps) + len(rows)} cells{of_them}): {named}."]
    if failed:
        lines += ["", "Failed in every variant:", ""]
        lines += [f"- {label(cell)}: {failure(failed[cell])}" for cell in gaps if cell in failed]
    if alone := [cell for cell in cells if cell in unanchored(rows)]:
        named = ", ".join(label(c) for c in alone)
        lines += ["", f"Measured without the hand-written SP beside hcpasses': {named}."]
    return "\n".join(lines)


def speedup(run: Run, variant: str) -> float | None:
    """SP off's compute ms over ``variant``'s, in one run (None unless both ran)."""
    off, row = run.variant("sp_off"), run.variant(variant)
    return None if off is None or row is None else off["compute_ms"] / row["compute_ms"]


def plot(rows: dict[Cell, Run], path: Path) -> bool:
    """Per model and dtype: compute speedup over SP off against tp, for hcpasses SP, the hand-written SP and the
    HC-only bound (1 / (1 - bound)), a line per T. Ratios, each within one run: the cells' runs were on H100s and
    H200s (the marker says which), whose absolute times differ. False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, d) for m in MODELS for d in DTYPES if any(c.model == m and c.dtype == d for c in rows)]
    tps = sorted(set(TPS) | {c.tp for c in rows})
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 4.2), squeeze=False)
    lines = (("hcpasses_sp", "tab:blue"), ("handwritten_sp", "tab:orange"), ("bound", "tab:grey"))
    for axis, (model, dtype) in zip(axes[0], panels, strict=False):
        styles = itertools.cycle(("-", "--", ":", "-."))
        for tokens, style in zip(sorted({c.tokens for c in rows}), styles, strict=False):
            runs = sorted(
                (c.tp, run) for c, run in rows.items() if (c.model, c.dtype, c.tokens) == (model, dtype, tokens)
            )
            for name, colour in lines:
                points = []
                for tp, run in runs:
                    bound = run.case.get("hc_bound")
                    value = (1 / (1 - bound) if bound is not None else None) if name == "bound" else speedup(run, name)
                    if value is not None:
                        points.append((tps.index(tp), value, "s" if short_device(run.device) == "H100" else "o"))
                if points:
                    axis.plot(
                        [x for x, _, _ in points],
                        [y for _, y, _ in points],
                        style,
                        color=colour,
                        label=f"{'HC-only bound' if name == 'bound' else name} T={tokens}",
                    )
                    for x, y, marker in points:
                        axis.plot(x, y, marker, color=colour)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(tps)), [str(tp) for tp in tps])
        axis.set(xlabel="simulated tp", ylabel="compute speedup over SP off (rank 0)", title=f"{model} {dtype}")
        axis.legend(fontsize=7)
    fig.suptitle("prefill_hf.py, simulated TP on one GPU; each cell from its own run (o: H200, s: H100)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between ``BEGIN`` and ``END`` replaced by ``block``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md needs one {BEGIN} / {END} pair")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="prefill_hf JSONs (default: every one under --results)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where prefill_hf_grid.png goes")
    parser.add_argument("--readme", action="store_true", help="also rewrite README.md's table between its markers")
    parser.add_argument(
        "--missing-commands",
        action="store_true",
        help="print only the prefill_hf.py arguments that measure the missing cells, one run per line",
    )
    args = parser.parse_args(argv)
    runs = load(args.runs or default_paths(args.results))
    rows = newest(runs)
    if args.missing_commands:
        print("\n".join(missing_commands(rows, frozenset(failures(runs, rows)))))
        return
    table = markdown(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    plotted = plot(rows, args.out / "prefill_hf_grid.png")
    if args.readme:
        README.write_text(replace_block(README.read_text(), table))
    print(table)
    print(f"wrote {args.out / 'prefill_hf_grid.png'}" if plotted else "no plot: matplotlib is missing")
    if args.readme:
        print(f"rewrote the table in {README}")


if __name__ == "__main__":
    main()

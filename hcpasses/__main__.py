"""The pipeline and the flags, printed from the registry (``hcpasses.passes.PASSES``) and the config's options.

    python -m hcpasses passes             # the passes in pipeline order: default, options read, what each does
    python -m hcpasses flags              # every flag: default, valid values, what it does
    python -m hcpasses flags --markdown   # the same as the README's flags table (tests/test_registry.py compares)

The demo is ``python -m hcpasses.testing.demo``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import hcpasses.passes as registry
from hcpasses.config import BOOL, HCPassesConfig

FLAG_COLUMNS = ("flag", "default", "values", "what it does")
PASS_COLUMNS = ("order", "pass", "default", "reads", "what it does")


def _code(name: str) -> str:
    return f"`{name}`"


def flag_rows() -> list[tuple[str, ...]]:
    """One row per flag (``FLAG_COLUMNS``): the passes in pipeline order, then the options in field order."""
    rows = []
    for order, spec in enumerate(registry.PASSES, start=1):
        reads = f"; reads {', '.join(map(_code, spec.reads))}" if spec.reads else ""
        rows.append((_code(spec.name), _code(repr(spec.default)), BOOL.phrase, f"pass {order}: {spec.summary}{reads}"))
    for field in HCPassesConfig.options():
        readers = [_code(spec.name) for spec in registry.PASSES if field.name in spec.reads]
        meaning = field.metadata["help"] + (f"; read by {', '.join(readers)}" if readers else "")
        if field.metadata["env"]:
            meaning += f"; `{field.metadata['env']}` overrides it"
        rows.append((_code(field.name), _code(repr(field.default)), field.metadata["values"].phrase, meaning))
    return rows


def pass_rows() -> list[tuple[str, ...]]:
    """One row per pass (``PASS_COLUMNS``), in pipeline order."""
    return [
        (str(order), spec.name, "on" if spec.default else "off", ", ".join(spec.reads) or "-", spec.summary)
        for order, spec in enumerate(registry.PASSES, start=1)
    ]


def markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def text(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns, the last one left as long as it is."""
    table = [tuple(columns), *map(tuple, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in table
    )


def flags_markdown() -> str:
    """The README's flags table (between ``<!-- flags:begin -->`` and ``<!-- flags:end -->``)."""
    return markdown(FLAG_COLUMNS, flag_rows())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hcpasses", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("passes", help="the passes in pipeline order")
    flags = commands.add_parser("flags", help="every flag of hcpasses.backend(...)")
    flags.add_argument("--markdown", action="store_true", help="as the README's markdown table")
    args = parser.parse_args(argv)
    if args.command == "passes":
        print(text(PASS_COLUMNS, pass_rows()))
    elif args.markdown:
        print(flags_markdown())
    else:
        print(text(FLAG_COLUMNS, [[cell.replace("`", "") for cell in row] for row in flag_rows()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

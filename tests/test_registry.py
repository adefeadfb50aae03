"""The registry of passes (``hcpasses.passes.PASSES``) is the only list of passes, and what is derived from it
follows it: the config's flags, ``HCPASSES_DISABLE``'s names, the manager's pipeline, ``python -m hcpasses`` and
the README's flags table. A flag walks one way: ``backend(**flags)`` -> the config -> the manager -> the pass.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from harness.graphs import add_unused_neg, traced

import hcpasses
import hcpasses.passes as registry
from hcpasses.__main__ import flag_rows, flags_markdown, main, pass_rows
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.manager import PassManager
from hcpasses.passes import PassSpec

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hcpasses"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


class Extra(GraphPass):
    """A pass added to the registry: it reads one option and says what it read."""

    name = "extra"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        add_unused_neg(graph)
        return PassResult(1, notes=(f"read sp_min_tokens={config.sp_min_tokens}",))


@pytest.fixture
def with_extra(monkeypatch) -> PassSpec:
    """The registry with ``extra`` added after the fusion, off by default, as its author would add it."""
    spec = PassSpec(Extra, False, "an extra pass for the test", reads=("sp_min_tokens",))
    passes = list(registry.PASSES)
    passes.insert(2, spec)
    monkeypatch.setattr(registry, "PASSES", tuple(passes))
    return spec


def test_the_pipeline_order_is_the_public_one() -> None:
    assert registry.names() == ("canonical_forms", "gated_mean_quant", "sp_rewrite", "blocked_scans", "cleanup")
    assert [spec.default for spec in registry.PASSES] == [True, True, True, True, True]
    assert hcpasses.PASSES is registry.PASSES and hcpasses.PassSpec is PassSpec


def test_a_pass_added_to_the_registry_is_everywhere(with_extra: PassSpec, capsys) -> None:
    expected = ("canonical_forms", "gated_mean_quant", "extra", "sp_rewrite", "blocked_scans", "cleanup")
    # the config: a flag, in pipeline order, with its default, validated, described
    assert HCPassesConfig.flag_names()[:6] == expected
    config = HCPassesConfig.resolve(env={})
    assert config.pass_names == expected and config.pass_enabled("extra") is False
    assert "gated_mean_quant=True, extra=False, sp_rewrite=True" in config.describe()
    with pytest.raises(ValueError, match="'extra' must be True or False, got 1"):
        hcpasses.backend(extra=1)
    # HCPASSES_DISABLE names it, and an unknown name's error lists it
    by_env = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "extra"}, extra=True)
    assert (by_env.pass_enabled("extra"), by_env.why_disabled("extra")) == (False, "HCPASSES_DISABLE names extra")
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "fusion"})
    assert str(err.value).endswith(f"valid passes are: {', '.join(expected)}")
    with pytest.raises(ValueError) as err:
        hcpasses.backend(fusion=True)
    assert f"valid flags are: {', '.join(expected)}, sp_min_tokens" in str(err.value)
    # the manager's pipeline: it runs in its place when its flag is on, and is reported disabled when off
    be = hcpasses.backend(extra=True, sp_min_tokens=7)
    assert list(be.manager.passes) == list(expected) and isinstance(be.manager.passes["extra"], Extra)
    be.manager(traced(lambda x, w: torch.relu(x @ w) + 1).graph)
    record = be.reports[0].record("extra")
    assert [r.name for r in be.reports[0].passes] == list(expected)
    assert (record.status, record.notes) == ("applied", ("read sp_min_tokens=7",))  # the option reached the pass
    off = hcpasses.backend()
    off.manager(traced(lambda x, w: torch.relu(x @ w) + 1).graph)
    assert off.reports[0].record("extra").reason == "flag extra=False"
    # the CLI and the flags table
    assert pass_rows()[2] == ("3", "extra", "off", "sp_min_tokens", "an extra pass for the test")
    assert flag_rows()[2] == (
        "`extra`",
        "`False`",
        "True or False",
        "pass 3: an extra pass for the test; reads `sp_min_tokens`",
    )
    assert "read by `extra`, `sp_rewrite`" in flag_rows()[6][3]
    assert main(["flags", "--markdown"]) == 0
    assert "| `extra` | `False` |" in capsys.readouterr().out
    assert main(["passes"]) == 0
    assert [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]][2] == ["3", "extra", "off"]


def test_the_readme_flags_table_is_the_generated_one() -> None:
    """``python -m hcpasses flags --markdown`` writes the table between the markers; edit the registry or the
    config's field metadata, not the README."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines.count(BEGIN) == 1 and lines.count(END) == 1, "README.md needs one flags:begin / flags:end pair"
    block = "\n".join(lines[lines.index(BEGIN) + 1 : lines.index(END)]).strip()
    assert block == flags_markdown(), "README.md's flags table is stale: python -m hcpasses flags --markdown"


def test_the_flags_table_has_a_row_per_flag_with_its_default() -> None:
    rows = flag_rows()
    assert [row[0] for row in rows] == [f"`{name}`" for name in HCPassesConfig.flag_names()]
    defaults = HCPassesConfig()
    assert [row[1] for row in rows] == [
        f"`{value!r}`" for value in (*dict(defaults.pass_flags).values(), 1024, None, False, True, True)
    ]
    assert rows[6][3].endswith("; `HCPASSES_DUMP_DIR` overrides it")
    want = "pass 3: shard the HC residual streams by tokens across the TP ranks; reads `sp_min_tokens`, `overlap`"
    assert rows[2][3] == want
    markdown = flags_markdown().splitlines()
    assert markdown[:2] == ["| flag | default | values | what it does |", "|---|---|---|---|"]
    assert len(markdown) == 2 + len(rows)


def test_the_cli_prints_the_pipeline_and_the_flags_and_has_no_demo(capsys) -> None:
    assert main(["passes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["order", "pass", "default", "reads", "what", "it", "does"]
    assert [line.split()[:4] for line in out[1:]] == [
        ["1", "canonical_forms", "on", "-"],
        ["2", "gated_mean_quant", "on", "-"],
        ["3", "sp_rewrite", "on", "sp_min_tokens,"],
        ["4", "blocked_scans", "on", "-"],
        ["5", "cleanup", "on", "-"],
    ]
    assert out[3].split()[4] == "overlap"
    assert main(["flags"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out and out.splitlines()[6].split()[:3] == ["sp_min_tokens", "1024", "an"]
    for argv in ([], ["demo"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2


def test_python_m_hcpasses_flags_markdown_prints_the_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hcpasses", "flags", "--markdown"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == flags_markdown() + "\n"


def _pass_sources(spec: PassSpec) -> list[Path]:
    """The file of the pass's class, or every file of its package when the class is a package's."""
    source = Path(sys.modules[spec.graph_pass.__module__].__file__)
    return sorted(source.parent.rglob("*.py")) if source.name == "__init__.py" else [source]


def _options_read(paths: list[Path]) -> set[str]:
    """The attributes read off a name ``config`` in these files."""
    read = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config":
                read.add(node.attr)
    return read


@pytest.mark.parametrize("spec", registry.PASSES, ids=lambda spec: spec.name)
def test_each_pass_reads_the_options_its_spec_names(spec: PassSpec) -> None:
    assert _options_read(_pass_sources(spec)) == set(spec.reads)


def test_the_options_check_reads_what_a_pass_reads(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def run(graph, config):\n    return config.sp_min_tokens, other.dump_dir\n")
    (tmp_path / "b.py").write_text("def f(config):\n    config.cudagraphs\n    x = config\n")
    assert _options_read([tmp_path / "a.py", tmp_path / "b.py"]) == {"sp_min_tokens", "cudagraphs"}


def library_files() -> list[Path]:
    """The package's modules, less the test fixtures and the kernels (the op ``hcpasses::gated_mean_quant`` is
    named after the pass that inserts it; that string is the op's name, not a list of passes)."""
    skip = (PACKAGE / "testing", PACKAGE / "kernels")
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not any(p.is_relative_to(s) for s in skip)]


def _named(node: ast.AST) -> str | None:
    """The pass-like name a node spells: a string, a keyword (``replace(c, sp_rewrite=False)``) or an attribute
    (``config.sp_rewrite``; not an op: ``torch.ops.hcpasses.gated_mean_quant``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.keyword):
        return node.arg
    if isinstance(node, ast.Attribute) and not ast.unparse(node.value).startswith("torch.ops"):
        return node.attr
    return None


def pass_name_literals(files: list[Path], names: tuple[str, ...]) -> list[str]:
    """``file:line: name`` for each string, keyword or attribute that is a pass name, other than the
    ``name = "..."`` of a class (a pass naming itself)."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        own = {
            id(stmt.value)
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            for stmt in cls.body
            if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["name"]
        }
        hits = [node for node in ast.walk(tree) if _named(node) in names and id(node) not in own]
        for node in sorted(hits, key=lambda node: (node.lineno, node.col_offset)):
            found.append(f"{path.name}:{node.lineno}: {_named(node)}")
    return found


def test_no_module_of_the_library_lists_the_passes_again() -> None:
    files = library_files()
    assert {"config.py", "manager.py", "backend.py", "__main__.py"} <= {p.name for p in files}
    assert pass_name_literals(files, registry.names()) == []


def test_the_literal_check_finds_pass_names(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        'ORDER = ("canonical_forms", "cleanup")\n'
        "class P:\n"
        '    name = "cleanup"\n'
        "def f(config):\n"
        '    return config.pass_enabled("sp_rewrite"), {"name": "cleanup"}\n'
        'name = "cleanup"\n'
        "c = dataclasses.replace(c, sp_rewrite=False)\n"
        "on = c.gated_mean_quant or torch.ops.hcpasses.gated_mean_quant\n"
    )
    found = pass_name_literals([tmp_path / "bad.py"], registry.names())
    assert found == [
        "bad.py:1: canonical_forms",
        "bad.py:1: cleanup",
        "bad.py:5: sp_rewrite",
        "bad.py:5: cleanup",
        "bad.py:6: cleanup",
        "bad.py:7: sp_rewrite",
        "bad.py:8: gated_mean_quant",
    ]


def test_the_manager_and_the_backend_get_their_passes_from_the_registry() -> None:
    config = HCPassesConfig.resolve(env={})
    assert list(PassManager(config, print).passes.values()) == list(registry.pipeline())
    be = hcpasses.backend()
    assert be.passes == registry.pipeline()
    assert list(be.autograd_manager.passes.values()) == list(registry.pipeline())

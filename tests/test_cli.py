"""The installed surface: the entry point works without importing hcpasses, the library imports neither its
test fixtures (``hcpasses.testing``) nor transformers, and the demo (``python -m hcpasses.testing.demo``) runs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import hcpasses


def run_python(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_entry_point_is_registered() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("hcpasses") == "hcpasses.backend:compile_with_defaults"


def test_string_backend_without_import() -> None:
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend='hcpasses')\n"
        "x = torch.randn(7)\n"
        "torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)\n"
        "assert 'hcpasses' in sys.modules\n"
        "import hcpasses\n"
        "print(hcpasses.default_backend().reports[0].applied)\n"
    )
    proc = run_python("-c", code, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "'cleanup': 0" in proc.stdout


# What the library must not import: the reference models, builders and test utilities (``hcpasses.testing``) and
# transformers (only a test extra). A module of hcpasses outside hcpasses.testing may import transformers inside a
# function (``hcpasses.hf`` works on transformers models), never at import time; hcpasses.testing never.
FIXTURES, TRANSFORMERS = "hcpasses.testing", "transformers"

# Imports every module of the installed hcpasses outside hcpasses.testing (pkgutil, from the package's own path, so
# hcpasses.testing is never imported to find its modules), one by one in sorted order; prints, as JSON, the modules
# and, for hcpasses.testing and transformers, the first module whose import brought it (or a submodule) in.
IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys

import hcpasses

FORBIDDEN = ("hcpasses.testing", "transformers")


def forbidden():
    return {f for f in FORBIDDEN if any(m == f or m.startswith(f + ".") for m in sys.modules)}


def walk(package):
    for info in sorted(pkgutil.iter_modules(package.__path__, package.__name__ + "."), key=lambda i: i.name):
        if info.name == FORBIDDEN[0]:
            continue
        module = importlib.import_module(info.name)
        yield info.name
        if info.ispkg:
            yield from walk(module)


brought_in, seen = {}, forbidden()
modules = ["hcpasses"]
for name in walk(hcpasses):
    modules.append(name)
    for found in sorted(forbidden() - seen):
        brought_in[found] = name
    seen = forbidden()
print(json.dumps({"file": hcpasses.__file__, "modules": modules, "brought_in": brought_in}))
"""


def _library_files() -> dict[str, Path]:
    """Every module of the installed hcpasses outside hcpasses.testing, by dotted name, with its file."""
    root = Path(hcpasses.__file__).parent
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[:2] == ("hcpasses", "testing") or "__pycache__" in parts:
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement in ``module`` names (``from a import b``: a, and a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
    source = ".".join(part for part in (base, node.module) if part)
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def _is_under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _runtime_imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement and whether it runs at import time (not inside a function or ``if TYPE_CHECKING:``)."""

    def visit(node: ast.AST, at_import: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, at_import
            deferred = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            )
            yield from visit(child, at_import and not deferred)

    yield from visit(tree, True)


def forbidden_imports(files: dict[str, Path]) -> list[str]:
    """``file:line: name`` for each import of hcpasses.testing (anywhere) or of transformers at import time."""
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, at_import in _runtime_imports(tree):
            names = _names(node, module, path.name == "__init__.py")
            bad = [n for n in names if _is_under(n, FIXTURES) or (at_import and _is_under(n, TRANSFORMERS))]
            if bad:
                found.append(f"{path}:{node.lineno}: {bad[0]}")
    return found


def test_no_library_module_names_the_fixtures_or_transformers_in_an_import() -> None:
    """No import statement in a module of hcpasses outside ``hcpasses.testing`` names ``hcpasses.testing``, and
    none that runs at import time names ``transformers``."""
    files = _library_files()
    assert {"hcpasses", "hcpasses.hf", "hcpasses.hf.fp8_swap", "hcpasses.kernels.contract"} <= set(files)
    assert forbidden_imports(files) == []


def test_importing_every_library_module_imports_neither_the_fixtures_nor_transformers() -> None:
    """Every module of the installed package outside ``hcpasses.testing``, imported in a fresh interpreter from
    outside the repository, leaves neither ``hcpasses.testing`` nor ``transformers`` in ``sys.modules``."""
    with tempfile.TemporaryDirectory() as elsewhere:  # not the repository root: the installed package
        proc = subprocess.run(
            [sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=300, cwd=elsewhere
        )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["file"]) == Path(hcpasses.__file__)
    assert sorted(result["modules"]) == sorted(_library_files())  # pkgutil found every file the static check reads
    assert result["brought_in"] == {}, f"forbidden package: the module that imported it: {result['brought_in']}"


def test_the_import_check_finds_forbidden_imports(tmp_path: Path) -> None:
    """The static check sees each way of naming the fixtures or transformers, and allows what it should."""
    (tmp_path / "bad.py").write_text(
        "import hcpasses.testing.models\n"
        "from hcpasses import testing\n"
        "from transformers.modeling_utils import PreTrainedModel\n"
        "class Model:\n"
        "    import transformers\n"
        "def f():\n"
        "    from hcpasses.testing.multiproc import run_ranks\n"
        "from .testing import demo\n"
    )
    (tmp_path / "good.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from transformers import PreTrainedModel\n"
        "import hcpasses.hf\n"
        "from hcpasses import testing_notes\n"
        "def f():\n"
        "    import transformers\n"
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .testing import models\nfrom ..testing import demo\n")
    files = {"hcpasses.bad": tmp_path / "bad.py", "hcpasses.good": tmp_path / "good.py"}
    files["hcpasses.pkg"] = tmp_path / "pkg" / "__init__.py"
    found = [line.split(":", 1)[1] for line in forbidden_imports(files)]
    assert found == [
        "1: hcpasses.testing.models",
        "2: hcpasses.testing",
        "3: transformers.modeling_utils",
        "5: transformers",
        "7: hcpasses.testing.multiproc",
        "8: hcpasses.testing",
        "2: hcpasses.testing",  # pkg: ``..testing``; its ``.testing`` is hcpasses.pkg.testing
    ]


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_demo_runs_at_tp2_and_matches_eager(tmp_path) -> None:
    proc = run_python("-m", "hcpasses.testing.demo", "--dump-dir", str(tmp_path), "--tokens", "17", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP 2 over gloo" in proc.stdout
    assert "graph 0:" in proc.stdout and "cleanup" in proc.stdout
    fusion = next(line for line in proc.stdout.splitlines() if line.strip().startswith("gated_mean_quant"))
    assert "applied=4" in fusion  # attention and MLP HC of both layers of the tiny FP8 model
    sp = next(line for line in proc.stdout.splitlines() if line.strip().startswith("sp_rewrite"))
    assert "applied=5" in sp  # the 4 HC blocks and the final mixer run on token shards
    diff_line = next(line for line in proc.stdout.splitlines() if line.startswith("max |compiled TP2"))
    assert float(diff_line.rsplit(" ", 1)[1]) < 1e-4
    assert (tmp_path / "rank0" / "index.md").exists() and (tmp_path / "rank1" / "index.md").exists()


def test_demo_rejects_bad_arguments() -> None:
    proc = run_python("-m", "hcpasses.testing.demo", "--tp", "0", timeout=120)
    assert proc.returncode != 0
    assert "--tp and --tokens must be >= 1" in proc.stderr

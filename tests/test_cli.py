"""The installed surface: the entry point works without importing hcpasses, and the demo
(``python -m hcpasses.testing.demo``) runs."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


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


def test_library_imports_without_the_reference_models() -> None:
    """``hcpasses`` (and ``hcpasses.hf`` with its FP8 swap and TP sharding) must not import the reference models."""
    code = (
        "import sys\n"
        "import hcpasses, hcpasses.fp8, hcpasses.hf, hcpasses.hf.fp8_swap, hcpasses.hf.tp_shard\n"
        "print(sorted(m for m in sys.modules if m.startswith('hcpasses.testing')))\n"
    )
    proc = run_python("-c", code, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


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

"""Tests of the benchmark-side models: mHC decoder, hand-written SP decoder, benchmark model, prefill script.

Multi-rank checks run on gloo through ``hcpasses.testing.multiproc.run_ranks``; one fixture per TP size runs every
rank-side check at once, so each TP size starts its processes only once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hcpasses.testing.models.sp_handwritten as sp_module
from hcpasses.testing.models import HCConfig, HCDecoder
from hcpasses.testing.models.bench_model import BenchDecoder, MixerSizes, chunked_linear_attention
from hcpasses.testing.models.fp8 import Fp8Linear
from hcpasses.testing.models.mhc import ManifoldHyperConnection, ManifoldHyperHead, MHCDecoder, sinkhorn
from hcpasses.testing.models.sp_handwritten import HandwrittenSPDecoder, RowShards
from hcpasses.testing.multiproc import run_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN_COUNTS = (1, 2, 4, 7, 13)  # T = 1, T < tp, a rank holding only padding (T=4, tp=3), odd, larger
SP_BASE = dict(n_heads=12, n_kv_heads=6, intermediate=96, seed=11)
SP_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ple_first": {"ple_layer": 0},
    "ple_last": {"ple_layer": 1},
    "fp8": {"fp8": True},
    "fp8_ple_first": {"fp8": True, "ple_layer": 0},
    "fp8_ple_last": {"fp8": True, "ple_layer": 1},
}
MHC_VARIANTS: dict[str, dict[str, Any]] = {"plain": {}, "ple_first": {"ple_layer": 0}, "fp8": {"fp8": True}}
BENCH_SIZES = MixerSizes(heads=4, key_head_dim=8, value_head_dim=8)
# (T, n_seqs, ple_layer, fp8): sequences of 70 tokens span two mixer chunks (64); PLE in a middle layer; T = n_seqs;
# FP8 input projections (T = 13: ragged at tp 2)
BENCH_CASES = ((140, 2, None, False), (9, 1, 1, False), (3, 3, 0, False), (13, 1, None, True))


def _sp_config(variant: str) -> HCConfig:
    return HCConfig.tiny(**SP_BASE, **SP_VARIANTS[variant])


def _mhc_config(variant: str) -> HCConfig:
    return HCConfig.tiny(seed=5, **MHC_VARIANTS[variant])


def _bench_config(ple_layer: int | None, fp8: bool = False) -> HCConfig:
    return HCConfig.tiny(n_layers=4, n_heads=4, n_kv_heads=2, ple_layer=ple_layer, seed=3, fp8=fp8)


def _ids(n_tokens: int, seed: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed))


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max abs error within ``rel`` times the largest magnitude of ``expected``; finite; same shape."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max abs error {err:.3g}"


# ------------------------------------------------------------------------------------------- rank side


class _CollectiveLog:
    """Stands in for ``torch.ops._c10d_functional`` in ``hcpasses.testing.models.sp_handwritten``: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        op = getattr(torch.ops._c10d_functional, name)

        def call(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
            self.calls.append((name, tensor.dtype, tuple(tensor.shape)))
            return op(tensor, *args)

        return call


@contextmanager
def _recording() -> Iterator[tuple[_CollectiveLog, list[int]]]:
    """Record the hand-written SP collectives and count in-place all-reduces (the sub-layers' own)."""
    log, all_reduces = _CollectiveLog(), [0]
    real_functional, real_all_reduce = sp_module.c10d_functional, dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        all_reduces[0] += 1
        return real_all_reduce(*args, **kwargs)

    sp_module.c10d_functional, dist.all_reduce = log, counting_all_reduce
    try:
        yield log, all_reduces
    finally:
        sp_module.c10d_functional, dist.all_reduce = real_functional, real_all_reduce


def _handwritten_outputs(rank: int, world_size: int) -> dict[str, Any]:
    """Every SP variant at every T: outputs, collectives seen (at T=7) and in-place all-reduce counts."""
    out: dict[str, Any] = {}
    for variant in SP_VARIANTS:
        model = HandwrittenSPDecoder(_sp_config(variant))
        outputs = {t: model(_ids(t, seed=t), return_hc_state=True) for t in TOKEN_COUNTS}
        with _recording() as (log, all_reduces):
            model(_ids(7, seed=7))
        out[variant] = {"outputs": outputs, "collectives": log.calls, "all_reduces": all_reduces[0]}
    return out


class _LargestOutput(TorchDispatchMode):
    """Records the most rows of any tensor an op makes while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        shapes = [t.shape for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() > 0]
        self.rows = max([self.rows, *(shape[0] for shape in shapes)])
        return out


def _shards(rank: int, world_size: int) -> dict[int, tuple[torch.Tensor, int]]:
    """``RowShards.shard`` of a ``[T, 3]`` arange for every T, and the most rows any op made doing it."""
    shards, out = RowShards(rank, world_size), {}
    for n_tokens in TOKEN_COUNTS:
        full = torch.arange(1.0, 3 * n_tokens + 1).view(n_tokens, 3)
        with _LargestOutput() as mode:
            out[n_tokens] = (shards.shard(full), mode.rows)
    return out


def _bench_outputs(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.dtype]]]:
    """Each bench case's all-token logits, plain TP and hand-written SP, and the dtypes the SP one gathered."""
    out = []
    for n_tokens, n_seqs, ple_layer, fp8 in BENCH_CASES:
        ids = _ids(n_tokens, seed=n_tokens)
        plain, sp = (
            BenchDecoder(_bench_config(ple_layer, fp8), handwritten_sp=flag, sizes=BENCH_SIZES, all_logits=True)
            for flag in (False, True)
        )
        with _recording() as (log, _):
            sp_logits = sp(ids, n_seqs)
        out.append((plain(ids, n_seqs), sp_logits, [dtype for name, dtype, _ in log.calls if "gather" in name]))
    return out


def _rank_body(rank: int, world_size: int, extras: bool) -> dict[str, Any]:
    """Everything one rank checks; ``extras`` adds the mHC and benchmark models (run at tp=2 only)."""
    torch.manual_seed(100 + rank)  # weights must not depend on the global RNG
    torch.set_num_threads(1)  # the ranks share the CPU cores; more threads each only contend
    with torch.no_grad():
        result = {"sp": _handwritten_outputs(rank, world_size), "shards": _shards(rank, world_size)}
        if extras:
            result["mhc"] = {v: MHCDecoder(_mhc_config(v))(_ids(13, 5), return_hc_state=True) for v in MHC_VARIANTS}
            result["bench"] = _bench_outputs(rank, world_size)
    return result


@pytest.fixture(scope="module", params=[2, 3], ids=lambda tp: f"tp{tp}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    tp = request.param
    return tp, run_ranks(_rank_body, tp, tp == 2, timeout_s=240.0)


# ------------------------------------------------------------------------------------ hand-written SP


@pytest.mark.parametrize("variant", list(SP_VARIANTS))
def test_handwritten_sp_matches_tp1(ranks: tuple[int, list[dict[str, Any]]], variant: str) -> None:
    _, per_rank = ranks
    reference = HCDecoder(_sp_config(variant), tp_rank=0, tp_size=1)
    rel = 2e-3 if "fp8" in variant else 1e-5  # FP8: a rounding-boundary value may land one code away
    for n_tokens in TOKEN_COUNTS:
        with torch.no_grad():
            ref_logits, ref_state = reference(_ids(n_tokens, seed=n_tokens), return_hc_state=True)
        for rank in per_rank:
            logits, state = rank["sp"][variant]["outputs"][n_tokens]
            _assert_close_rel(logits, ref_logits, rel)
            _assert_close_rel(state, ref_state, rel)
            assert torch.equal(logits, per_rank[0]["sp"][variant]["outputs"][n_tokens][0])


@pytest.mark.parametrize("variant", list(SP_VARIANTS))
def test_handwritten_sp_collectives(ranks: tuple[int, list[dict[str, Any]]], variant: str) -> None:
    """Sharded sub-layers never all-reduce; each gathers its input (FP8: codes + scales) and reduce-scatters."""
    tp, per_rank = ranks
    cfg, rows = _sp_config(variant), -(-7 // tp)
    sharded_layers = cfg.n_layers - (cfg.ple_layer or 0)
    inputs = [(torch.uint8, cfg.hidden), (torch.float32, 1)] if cfg.fp8 else [(cfg.dtype, cfg.hidden)]
    block = []
    for dtype, width in inputs:
        block += [("all_gather_into_tensor", dtype, (rows, width)), ("wait_tensor", dtype, (rows * tp, width))]
    block += [
        ("reduce_scatter_tensor", cfg.dtype, (rows * tp, cfg.hidden)),
        ("wait_tensor", cfg.dtype, (rows, cfg.hidden)),
    ]
    exit_gather = [
        ("all_gather_into_tensor", cfg.dtype, (rows, cfg.hidden)),
        ("wait_tensor", cfg.dtype, (rows * tp, cfg.hidden)),
    ]
    for rank in per_rank:
        record = rank["sp"][variant]
        assert record["collectives"] == block * (2 * sharded_layers) + exit_gather
        assert record["all_reduces"] == 2 * (cfg.n_layers - sharded_layers)


def test_row_shards_slice_then_pad(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    """Each rank gets its rows, zero-padded to ceil(T/tp); no op makes a tensor of more rows than that."""
    tp, per_rank = ranks
    for n_tokens in TOKEN_COUNTS:
        rows = -(-n_tokens // tp)
        full = torch.arange(1.0, 3 * n_tokens + 1).view(n_tokens, 3)
        padded = F.pad(full, (0, 0, 0, rows * tp - n_tokens))
        for rank, result in enumerate(per_rank):
            shard, largest = result["shards"][n_tokens]
            assert torch.equal(shard, padded[rank * rows : (rank + 1) * rows])
            assert largest <= rows


# ---------------------------------------------------------------------------------------------- mHC


@pytest.mark.parametrize("variant", list(MHC_VARIANTS))
def test_mhc_tp2_matches_tp1(ranks: tuple[int, list[dict[str, Any]]], variant: str) -> None:
    tp, per_rank = ranks
    if tp != 2:
        pytest.skip("the mHC decoder is checked at tp=2")
    with torch.no_grad():
        ref_logits, ref_state = MHCDecoder(_mhc_config(variant), tp_rank=0, tp_size=1)(
            _ids(13, 5), return_hc_state=True
        )
    assert ref_state.shape == (13, 4, 32)
    rel = 2e-3 if "fp8" in variant else 1e-5
    for rank in per_rank:
        logits, state = rank["mhc"][variant]
        _assert_close_rel(logits, ref_logits, rel)
        _assert_close_rel(state, ref_state, rel)


def _transformers_mhc() -> Any:
    return pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _ds_config(cfg: HCConfig) -> Any:
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=cfg.hidden, hc_mult=cfg.n_streams, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=cfg.eps
    )


def test_mhc_block_matches_transformers() -> None:
    hf = _transformers_mhc()
    cfg = HCConfig.tiny(seed=9)
    block = ManifoldHyperConnection(cfg, name="hc")
    theirs = hf.DeepseekV4HyperConnection(_ds_config(cfg))
    with torch.no_grad():
        theirs.fn.copy_(block.fn), theirs.base.copy_(block.base), theirs.scale.copy_(block.scale)
        h, y = torch.randn(6, cfg.streams_width) * 2, torch.randn(6, cfg.hidden)
        post, comb, collapsed = theirs(h.view(1, 6, cfg.n_streams, cfg.hidden))
        streams = h.view(1, 6, cfg.n_streams, cfg.hidden)
        expanded = post.unsqueeze(-1) * y.view(1, 6, 1, -1) + torch.matmul(comb.transpose(-1, -2), streams)
        x, our_post, our_comb = block.mix(h)
        torch.testing.assert_close(x, collapsed[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(our_post, post[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(our_comb, comb[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block.combine(h, y, our_post, our_comb), expanded[0].flatten(-2))


def test_mhc_head_matches_transformers() -> None:
    hf = _transformers_mhc()
    cfg = HCConfig.tiny(seed=4)
    head = ManifoldHyperHead(cfg, name="head")
    theirs = hf.DeepseekV4HyperHead(_ds_config(cfg))
    with torch.no_grad():
        theirs.hc_fn.copy_(head.fn), theirs.hc_base.copy_(head.base), theirs.hc_scale.copy_(head.scale)
        h = torch.randn(5, cfg.streams_width) * 3
        torch.testing.assert_close(head(h), theirs(h.view(1, 5, cfg.n_streams, cfg.hidden))[0])


def test_sinkhorn_is_nearly_doubly_stochastic() -> None:
    logits = torch.randn(50, 4, 4)
    comb = sinkhorn(logits, iters=50)
    torch.testing.assert_close(comb.sum(-1), torch.ones(50, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(50, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(sinkhorn(logits).sum(-2), torch.ones(50, 4), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------- bench model


def test_bench_handwritten_sp_matches_plain(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    tp, per_rank = ranks
    if tp != 2:
        pytest.skip("the benchmark model is checked at tp=2")
    for case, (n_tokens, n_seqs, ple_layer, fp8) in enumerate(BENCH_CASES):
        with torch.no_grad():
            model = BenchDecoder(_bench_config(ple_layer, fp8), 0, 1, sizes=BENCH_SIZES, all_logits=True)
            reference = model(_ids(n_tokens, seed=n_tokens), n_seqs)
        assert reference.shape == (n_tokens, 64)
        assert all(isinstance(layer.mlp.in_proj, Fp8Linear) == fp8 for layer in model.layers)
        rel = 2e-3 if fp8 else 1e-5  # FP8: a rounding-boundary value may land one code away
        for rank in per_rank:
            plain, sp, gathered = rank["bench"][case]
            _assert_close_rel(plain, reference, rel)
            _assert_close_rel(sp, reference, rel)
            # each sharded sub-layer gathers its input: FP8 codes (as uint8) and their scales, or x itself
            per_sublayer = [torch.uint8, torch.float32] if fp8 else [torch.float32]
            sharded_layers = len(model.layers) - (ple_layer or 0)  # the layers before the PLE run unsharded
            assert gathered == per_sublayer * (2 * sharded_layers) + [torch.float32], gathered


def test_chunked_linear_attention_matches_quadratic_form() -> None:
    q, k, v = (torch.randn(2, 150, 3, 8, dtype=torch.float64) for _ in range(3))
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
    expected = torch.einsum("bhts,bshd->bthd", scores, v)
    torch.testing.assert_close(chunked_linear_attention(q, k, v, chunk=64), expected)


def test_bench_sequences_are_independent_and_causal() -> None:
    model = BenchDecoder(_bench_config(None), 0, 1, sizes=BENCH_SIZES, all_logits=True)
    ids = _ids(80, seed=1)
    changed = ids.clone()
    changed[50] = (ids[50] + 1) % 64  # sequence 1 of 2 (tokens 40..79), position 10
    with torch.no_grad():
        before, after = model(ids, 2), model(changed, 2)
        last = BenchDecoder(_bench_config(None), 0, 1, sizes=BENCH_SIZES)(ids, 2)
    assert torch.equal(before[:50], after[:50])
    assert not torch.equal(before[50:], after[50:])
    torch.testing.assert_close(last, before.view(2, 40, -1)[:, -1])


# ------------------------------------------------------------------------------------------- benchmark


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_prefill_benchmark_cpu_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "benchmarks/prefill_sp.py", "--cpu-smoke", "--layers", "1", "--repeats", "2"]
    command += ["--warmup", "0", "--kernels", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "smoke_prefill_sp_tp2.json").read_text())
    assert [row["point"] for row in summary["points"]] == ["4x1", "16x2"]
    for row in summary["points"]:
        assert set(row["variants"]) == {"sp_off", "hcpasses_sp", "handwritten_sp"}
        for result in row["variants"].values():
            assert result["ms"] > 0 and result["rel_diff_vs_sp_off"] < 1e-5
            kernels = result["kernel_profile_rank0"]  # --kernels: rank 0's ops by name and kind
            assert kernels["total_us"] > 0 and kernels["launches"] > 0 and kernels["by_name"]
        assert f"kernels at {row['point']}, us per forward:" in done.stdout
    assert summary["hc_only"]["32"]["sharded_rows"] == 16
    assert set(summary["goals"]) == {
        "hc_time_ratio_at_largest_T",
        "hcpasses_vs_handwritten_min_over_prefill",
        "hcpasses_vs_sp_off_at_largest_T",
        "decode_abs_deviation_vs_sp_off",
    }


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_prefill_benchmark_cpu_smoke_fp8(tmp_path: Path) -> None:
    """``--fp8``: the benchmark model's input projections are FP8, hcpasses fuses each gated mean with its quant
    (both HC blocks of the layer) and shards, and every variant's logits are SP off's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "benchmarks/prefill_sp.py", "--cpu-smoke", "--fp8", "--layers", "1", "--repeats", "2"]
    command += ["--warmup", "0", "--points", "16x2", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "smoke_prefill_sp_tp2_fp8.json").read_text())
    assert summary["settings"]["fp8"] is True
    (row,) = summary["points"]
    for result in row["variants"].values():
        assert result["ms"] > 0 and result["rel_diff_vs_sp_off"] < 1e-5
    passes = {p["name"]: p["applied"] for p in row["variants"]["hcpasses_sp"]["reports_rank0"][0]["passes"]}
    assert passes["gated_mean_quant"] == 2 and passes["sp_rewrite"] == 3, passes

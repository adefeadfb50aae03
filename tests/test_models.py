"""Tests of the reference models: TP equivalence over gloo, HC math, FP8 quantisation, PLE causality."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hcpasses.testing.models import (
    ColumnParallelLinear,
    FinalMixer,
    Fp8Linear,
    HCConfig,
    HCDecoder,
    HyperConnection,
    RowParallelLinear,
    quantize_per_token,
)
from hcpasses.testing.models.decoder import PLELayer
from hcpasses.testing.multiproc import run_ranks

N_TOKENS = 13

# 12 query heads over 6 kv heads (GQA) and intermediate 96: divisible by tp 2 and 3.
TP_BASE = dict(n_heads=12, n_kv_heads=6, intermediate=96, seed=7)
TP_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ple_first": {"ple_layer": 0},
    "ple_last": {"ple_layer": 1},
    "fp8": {"fp8": True},
    "fp8_ple_last": {"fp8": True, "ple_layer": 1},
}


def _tp_config(variant: str) -> HCConfig:
    return HCConfig.tiny(**TP_BASE, **TP_VARIANTS[variant])


def _token_ids(cfg: HCConfig, n_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n_tokens,), generator=gen)


Outputs = tuple[torch.Tensor, torch.Tensor]


def _run_all_variants(rank: int, world_size: int, ids: torch.Tensor) -> dict[str, Outputs]:
    """Rank body: every variant's (logits, HC state) from a model built with this rank's slice."""
    torch.manual_seed(1000 + rank)  # the weights must not depend on the global RNG
    out = {}
    with torch.no_grad():
        for variant in TP_VARIANTS:
            model = HCDecoder(_tp_config(variant))
            assert (model.tp_rank, model.tp_size) == (rank, world_size)
            out[variant] = model(ids, return_hc_state=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda tp: f"tp{tp}")
def tp_results(request: pytest.FixtureRequest) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    ids = _token_ids(_tp_config("plain"), N_TOKENS, seed=request.param)
    return ids, run_ranks(_run_all_variants, request.param, ids, timeout_s=120.0)


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max abs error within ``rel`` times the largest magnitude of ``expected``."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max abs error {err:.3g}"


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
def test_tp_matches_tp1(tp_results: tuple[torch.Tensor, list[dict[str, Any]]], variant: str) -> None:
    ids, per_rank = tp_results
    with torch.no_grad():
        ref_logits, ref_state = HCDecoder(_tp_config(variant))(ids, return_hc_state=True)
    assert ref_state.shape == (N_TOKENS, 4, 32)
    # FP8: x is replicated, but the all-reduce sums in another order than the tp=1 GEMM, so a value on a
    # rounding boundary can land one FP8 code away in a later layer.
    rel = 2e-3 if "fp8" in variant else 1e-5
    for logits, state in (r[variant] for r in per_rank):
        _assert_close_rel(logits, ref_logits, rel)
        _assert_close_rel(state, ref_state, rel)
    for logits, state in (r[variant] for r in per_rank[1:]):
        assert torch.equal(logits, per_rank[0][variant][0]) and torch.equal(state, per_rank[0][variant][1])


def test_shards_reassemble_the_tp1_weights() -> None:
    kwargs = dict(seed=3, name="proj", dtype=torch.float32)
    full_col = ColumnParallelLinear(8, [6, 12], **kwargs, tp_rank=0, tp_size=1).weight
    cols = [ColumnParallelLinear(8, [6, 12], **kwargs, tp_rank=r, tp_size=3).weight for r in range(3)]
    assert torch.equal(torch.cat([c[:2] for c in cols]), full_col[:6])
    assert torch.equal(torch.cat([c[2:] for c in cols]), full_col[6:])
    full_row = RowParallelLinear(12, 8, **kwargs, tp_rank=0, tp_size=1).weight
    rows = [RowParallelLinear(12, 8, **kwargs, tp_rank=r, tp_size=2).weight for r in range(2)]
    assert torch.equal(torch.cat(rows, dim=1), full_row)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="ple_layer"):
        HCConfig.tiny(ple_layer=2)
    with pytest.raises(ValueError, match="hidden"):
        HCConfig.tiny(hidden=0)
    with pytest.raises(ValueError, match="n_heads"):
        HCDecoder(HCConfig.tiny(), tp_rank=0, tp_size=3)
    assert HCConfig.real().hidden == 2560


def _hand_mix_combine(hc: HyperConnection, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """DESIGN §2 written out stream by stream in float64."""
    n, size, rank = hc.n, hc.hidden, hc.rank
    h, y = h.double(), y.double()
    w_norm, w_di, w_up = hc.norm_weight.double(), hc.w_down_inject.double(), hc.w_up.double()
    xn = []
    for s in range(n):
        hs = h[:, s * size : (s + 1) * size]
        rms = (hs.pow(2).mean(-1, keepdim=True) + hc.eps).sqrt()
        xn.append(hs / rms * (1 + w_norm[s * size : (s + 1) * size]))
    xn_all = torch.cat(xn, dim=-1)
    d = xn_all @ w_di[:rank].T
    inject = xn_all @ w_di[rank:].T
    u = F.silu(d / n) @ w_up.T
    x = sum(torch.sigmoid(u[:, s * size : (s + 1) * size]) * xn[s] for s in range(n)) / n
    gate = 2 * torch.sigmoid(inject / n)
    out = torch.cat([h[:, s * size : (s + 1) * size] + gate[:, s : s + 1] * y for s in range(n)], -1)
    return x, inject, out


def test_hc_mix_and_combine_match_the_formula() -> None:
    cfg = HCConfig.tiny(seed=11)
    hc = HyperConnection(cfg, name="hc")
    h = torch.randn(9, cfg.streams_width) * 3
    y = torch.randn(9, cfg.hidden)
    x_ref, l_ref, out_ref = _hand_mix_combine(hc, h, y)
    x, logits = hc.mix(h)
    assert x.shape == (9, cfg.hidden) and logits.shape == (9, cfg.n_streams)
    torch.testing.assert_close(x.double(), x_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.double(), l_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hc.combine(h, y, logits).double(), out_ref, rtol=1e-5, atol=1e-5)


def test_hc_bf16_stays_near_fp32() -> None:
    hc32 = HyperConnection(HCConfig.tiny(seed=5), name="hc")
    hc16 = HyperConnection(HCConfig.tiny(seed=5, dtype=torch.bfloat16), name="hc")
    h = torch.randn(7, 128).bfloat16()
    x16, l16 = hc16.mix(h)
    x32, l32 = hc32.mix(h.float())
    assert x16.dtype == torch.bfloat16
    torch.testing.assert_close(x16.float(), x32, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(l16.float(), l32, rtol=3e-2, atol=3e-2)


def test_final_mixer_is_the_mix_without_inject() -> None:
    cfg = HCConfig.tiny(seed=2)
    hc, mixer = HyperConnection(cfg, name="m"), FinalMixer(cfg, name="m")
    with torch.no_grad():
        hc.norm_weight.copy_(mixer.norm_weight)
        hc.w_down_inject[: cfg.hc_rank].copy_(mixer.w_down)
        hc.w_up.copy_(mixer.w_up)
    h = torch.randn(5, cfg.streams_width)
    torch.testing.assert_close(mixer(h), hc.mix(h)[0], rtol=1e-6, atol=1e-6)


def test_quantize_per_token_random_rows() -> None:
    x = torch.randn(16, 64) * torch.logspace(-2, 3, 16).unsqueeze(1)
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (16, 1)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale, amax / 448, rtol=0, atol=0)
    assert torch.equal(q.float().abs().amax(-1), torch.full((16,), 448.0))
    # e4m3: half an ulp is 2^-4 relative for normals, 2^-10 * scale in the subnormal range.
    assert ((q.float() * scale - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all()


def test_quantize_per_token_zero_row_and_huge_value() -> None:
    x = torch.randn(3, 32)
    x[1] = 0.0
    x[2, 5] = 3.0e38
    q, scale = quantize_per_token(x.bfloat16())
    assert torch.isfinite(scale).all() and torch.isfinite(q.float()).all()
    assert scale[1].item() == torch.tensor(1.0 / (448 * 512)).item()
    assert torch.equal(q[1].float(), torch.zeros(32))
    assert q[2, 5].float().item() == 448.0 and torch.isfinite(q[2].float()).all()


def test_fp8_linear_against_the_float_reference() -> None:
    weight, x = torch.randn(24, 32) / 6, torch.randn(10, 32)
    layer = Fp8Linear(weight)
    wq, wscale = quantize_per_token(weight)
    q, scale = quantize_per_token(x)
    expected = (q.float() * scale) @ (wq.float() * wscale).T
    assert torch.equal(layer(x), expected)
    # Each factor is within 2^-4 relative (plus a subnormal step) of its float value.
    bound = (x.abs() @ weight.abs().T) * (2 * 2**-4 + 2**-8) + 1e-3
    assert ((layer(x) - x @ weight.T).abs() <= bound).all()
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_ple_receptive_field() -> None:
    cfg = HCConfig.tiny(seed=4, ple_layer=0)
    ple = PLELayer(cfg, name="ple")
    ids = _token_ids(cfg, 20, seed=1)
    h = torch.randn(20, cfg.streams_width)
    j = 6
    changed_ids = ids.clone()
    changed_ids[j] = (ids[j] + 1) % cfg.vocab_size
    diff = (ple(h, changed_ids) - ple(h, ids)).abs().amax(-1)
    assert sorted(torch.nonzero(diff).flatten().tolist()) == [j, j + 3, j + 6, j + 9]


def test_model_is_causal() -> None:
    cfg = HCConfig.tiny(seed=4, ple_layer=1, fp8=True)
    model = HCDecoder(cfg)
    ids = _token_ids(cfg, N_TOKENS, seed=2)
    j = 8
    changed_ids = ids.clone()
    changed_ids[j] = (ids[j] + 1) % cfg.vocab_size
    with torch.no_grad():
        logits, state = model(ids, return_hc_state=True)
        changed_logits, changed_state = model(changed_ids, return_hc_state=True)
    torch.testing.assert_close(changed_logits[:j], logits[:j], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(changed_state[:j], state[:j], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(changed_logits[j], logits[j])


def test_bf16_model_tracks_fp32() -> None:
    ids = _token_ids(HCConfig.tiny(), N_TOKENS, seed=3)
    with torch.no_grad():
        ref = HCDecoder(HCConfig.tiny(ple_layer=0))(ids)
        out = HCDecoder(HCConfig.tiny(ple_layer=0, dtype=torch.bfloat16))(ids)
    assert out.dtype == torch.bfloat16
    _assert_close_rel(out.float(), ref, 5e-2)


def test_traces_as_one_graph() -> None:
    model = HCDecoder(HCConfig.tiny(ple_layer=1, fp8=True))
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n_tokens in (5, 14):
            ids = _token_ids(model.cfg, n_tokens, seed=n_tokens)
            logits, state = compiled(ids, return_hc_state=True)
            ref_logits, ref_state = model(ids, return_hc_state=True)
            torch.testing.assert_close(logits, ref_logits)
            torch.testing.assert_close(state, ref_state)

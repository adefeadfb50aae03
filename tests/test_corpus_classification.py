"""The corpus's labels, found by eager evaluation: a quant spelling (``tests/corpus/quants.py``) is identical when
its codes (as bytes) and scales (as bits) equal ``hcpasses.kernels.contract.per_token_quant``'s on every probe
below in fp32, bf16 and fp16; otherwise it is a near miss, labelled with the first probe (in ``PROBES`` order) that
separates it in some dtype. A wrong label in ``IDENTICAL`` / ``NEAR_MISSES`` fails here.

The probes are written here, independently of the fusion's own (``hcpasses.patterns.quant_evaluation``), so that
the corpus is evidence for that mechanism rather than a copy of it. Collapse spellings
(``tests/corpus/collapses.py``) are checked against the fused ops' torch references: within the one rounding the
fused op is allowed (DESIGN §5), which is what lets the fusion replace them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from corpus.collapses import GATED_MEANS, WEIGHTED_SUMS
from corpus.quants import CORPUS, IDENTICAL, NEAR_MISSES

from hcpasses.kernels.contract import (
    FP8_MAX,
    MIN_SCALE,
    gated_mean_quant_reference,
    per_token_quant,
    weighted_sum_quant_reference,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIDTH = 64
# e4m3 midpoints at scale 1 (each halfway between two codes); times a scale whose reciprocal is inexact, a
# reciprocal multiply lands beside the midpoint and rounds the other way.
MIDPOINTS = (1.0625, -1.1875, 1.5625, 2.125, -2.375, 3.25, 5.5, -13.0, 0.5 + 1 / 32, 0.0078125 * 1.5)
INEXACT_RECIPROCAL_SCALES = (1.75, 1.25, 1.375, 3.5)


def _row_with_amax(values: torch.Tensor, amax: float) -> torch.Tensor:
    """``values`` (one row) rescaled so its largest magnitude is ``amax``, held by element 0."""
    row = values / values.abs().max() * amax
    row[0] = amax
    return row


def _tiled_row(values: tuple[float, ...], head: float) -> torch.Tensor:
    """A row of ``WIDTH``: ``head`` then ``values`` repeated."""
    body = torch.tensor(values).repeat(WIDTH // len(values) + 1)[: WIDTH - 1]
    return torch.cat([torch.tensor([head]), body])


def probes(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rows ``[R, WIDTH]`` representable in ``dtype``, by what they tell apart: the targeted probes first, the
    generic mixed-magnitude rows last (so a near miss is labelled by the edge it gets wrong)."""
    gen = torch.Generator().manual_seed(26)
    floor_amax = FP8_MAX * MIN_SCALE  # 1/512: amax / 448 is the scale floor exactly
    big = torch.finfo(dtype).max / 8
    mixed = torch.randn(11, WIDTH, generator=gen).clamp(-4, 4) * 10.0 ** torch.arange(-6, 5).unsqueeze(-1)
    ties = [_tiled_row(tuple(m * c for m in MIDPOINTS), FP8_MAX * c) for c in (1.0, *INEXACT_RECIPROCAL_SCALES)]
    signed_zeros = torch.tensor([-0.0, 1.0, 0.0, -3.0]).repeat(WIDTH // 4)
    rows = {
        "all-zero rows": torch.zeros(2, WIDTH),
        "amax on the scale floor": torch.stack([_row_with_amax(torch.randn(WIDTH, generator=gen), floor_amax)]),
        "amax below the floor": torch.stack(
            [_row_with_amax(torch.randn(WIDTH, generator=gen), floor_amax * f) for f in (0.5, 0.25, 1 / 64)]
        ),
        "ties between FP8 codes": torch.stack(ties),
        "negative zeros": torch.stack([signed_zeros, -torch.zeros(WIDTH)]),
        "large values": torch.randn(2, WIDTH, generator=gen).clamp(-4, 4) * big,
        "mixed magnitudes": mixed,
    }
    out = {name: value.to(dtype) for name, value in rows.items()}
    for name, value in out.items():  # each probe must mean in dtype what it says in fp32
        assert torch.isfinite(value).all() and (value.abs().amax(-1) < torch.finfo(dtype).max).all(), name
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def separating_probe(quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """The first probe on which ``quant``'s (codes, scale) differ from the contract's in some dtype; None if none."""
    for name in probes(torch.float32):
        for dtype in DTYPES:
            x = probes(dtype)[name]
            codes, scale = quant(x)
            want_codes, want_scale = per_token_quant(x)
            if codes.dtype != want_codes.dtype or scale.dtype != torch.float32 or scale.shape != want_scale.shape:
                return name
            if not (torch.equal(_bits(codes), _bits(want_codes)) and torch.equal(_bits(scale), _bits(want_scale))):
                return name
    return None


def test_the_labels_cover_the_corpus_once() -> None:
    assert IDENTICAL.isdisjoint(NEAR_MISSES) and IDENTICAL | set(NEAR_MISSES) == set(CORPUS)


@pytest.mark.parametrize("name", list(CORPUS))
def test_each_quant_is_labelled_as_evaluation_finds(name: str) -> None:
    found = separating_probe(CORPUS[name])
    assert found == NEAR_MISSES.get(name), f"{name}: evaluation finds {found or 'identical'}"


def test_the_edge_probes_are_what_separates_the_near_misses() -> None:
    """The corpus's near misses differ from the contract at its edges (a zero row, a tie between codes), which
    mixed-magnitude rows alone might not show."""
    assert {"all-zero rows", "ties between FP8 codes"} <= set(NEAR_MISSES.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GATED_MEANS))
def test_each_gated_mean_is_the_fused_ops_mean_within_one_rounding(name: str, dtype: torch.dtype) -> None:
    n, hidden, tokens = 4, 16, 9
    gen = torch.Generator().manual_seed(3)
    u, xn = (torch.randn(tokens, n * hidden, generator=gen).to(dtype) for _ in range(2))
    want = gated_mean_quant_reference(xn, u, n)[0]
    got = GATED_MEANS[name](u, xn, n, hidden)
    assert got.dtype == dtype and got.shape == want.shape
    # one rounding of the mean: the fused op's; a spelling may round each product first (transformers'
    # mean in the activation dtype), so allow a few ulps of dtype at the row's magnitude
    ulp = torch.finfo(dtype).eps * want.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= 4 * ulp).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(WEIGHTED_SUMS))
def test_each_weighted_sum_is_the_fused_ops_sum_within_one_rounding(name: str, dtype: torch.dtype) -> None:
    n, hidden, tokens = 4, 16, 9
    gen = torch.Generator().manual_seed(4)
    pre = torch.rand(tokens, n, generator=gen)
    h = torch.randn(tokens, n, hidden, generator=gen).to(dtype)
    want = weighted_sum_quant_reference(h.flatten(-2).contiguous(), pre, n)[0]
    got = WEIGHTED_SUMS[name](pre, h)
    assert got.dtype == dtype and got.shape == want.shape
    ulp = torch.finfo(dtype).eps * want.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()

"""``benchmarks/handwritten_sp_hf.py``: the hand-written SP of transformers' qwen4_exp and deepseek_v4 (issue #27's
fourth variant).

Over 2 real gloo processes (thorough) it gives eager's logits at ragged and even T, at T < tp and (qwen4_exp) with
the PLE halo longer and shorter than a shard, and (deepseek_v4) with T longer than the sliding window and than the
compressors' blocks; under simulated TP (in process, quick) it issues exactly the collectives its docstring lists
and never all-reduces; calls it does not cover are refused with a ``ValueError``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hf_cases import ONE_LAYER, relative_error

from hcpasses.hf import shard_for_tp
from hcpasses.testing.hf_models import tiny_deepseek_v4, tiny_qwen4_exp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the spawned ranks inherit sys.path
from handwritten_sp_hf import handwritten_sp  # noqa: E402
from simulated_tp import simulated_tp  # noqa: E402

TP = 2
EOS = 1  # the tiny config's: PLE's n-grams restart after it
# 1: rank 1 holds only padding; 5: ragged, shards of 3 rows, shorter than the PLE conv's reach of 9 rows (kernel 4,
# dilation 3); 21: ragged, shards of 11 rows, longer than it; 32: even.
TOKENS = (1, 5, 21, 32)
FP32_TOLERANCE = 1e-5


def sequence(tokens: int, seed: int = 0) -> torch.Tensor:
    """Fresh random ids ``[1, T]`` with an EOS every 7 tokens (one on each side of a shard boundary at T = 21, 32)."""
    ids = torch.randint(2, 128, (1, tokens), generator=torch.Generator().manual_seed(seed + tokens))
    ids[:, 6::7] = EOS
    return ids


BUILDERS = {"qwen4_exp": tiny_qwen4_exp, "deepseek_v4": tiny_deepseek_v4}


def eager_logits(tokens: int, family: str = "qwen4_exp", **overrides: object) -> torch.Tensor:
    with torch.no_grad():
        return BUILDERS[family](**overrides)(input_ids=sequence(tokens)).logits


def sp_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """One gloo rank, per family: the 4-layer tiny model sharded, its hand-written SP run eagerly; then the one-layer
    model's SP compiled by Inductor at one ragged T."""
    out = {}
    for family, build in BUILDERS.items():
        model = handwritten_sp(shard_for_tp(build(), rank, world_size))
        with torch.no_grad():
            for tokens in TOKENS:
                out[f"{family} all {tokens}"] = model(sequence(tokens), logits_to_keep=0).logits
                out[f"{family} last {tokens}"] = model(sequence(tokens), logits_to_keep=1).logits
            one_layer = handwritten_sp(shard_for_tp(build(**ONE_LAYER[family]), rank, world_size))
            compiled = torch.compile(one_layer, backend="inductor")
            out[f"{family} compiled"] = compiled(sequence(21), logits_to_keep=1).logits
    return out


@pytest.mark.thorough  # processes over gloo: CI, not the quick local run
def test_handwritten_sp_over_gloo_gives_eager_logits() -> None:
    from hcpasses.testing.multiproc import run_ranks

    results = run_ranks(sp_rank, TP, timeout_s=900)
    for family in BUILDERS:
        for tokens in TOKENS:
            expected = eager_logits(tokens, family)
            for rank, result in enumerate(results):
                full, last = result[f"{family} all {tokens}"], result[f"{family} last {tokens}"]
                assert full.shape == expected.shape, (family, rank, tokens)
                assert relative_error(full, expected) < FP32_TOLERANCE, (family, rank, tokens)
                assert relative_error(last, expected[:, -1:]) < FP32_TOLERANCE, (family, rank, tokens)
        expected = eager_logits(21, family, **ONE_LAYER[family])[:, -1:]
        for result in results:
            assert relative_error(result[f"{family} compiled"], expected) < FP32_TOLERANCE, family


def simulated_counts(
    tokens: int, logits_to_keep: int, family: str = "qwen4_exp"
) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """The collectives of one eager forward as rank 0 of a simulated tp 2: counts, and (kind, full bytes) each."""
    with simulated_tp(TP, 0) as ledger, torch.no_grad():
        model = handwritten_sp(shard_for_tp(BUILDERS[family](), 0, TP))
        ledger.clear()
        model(sequence(tokens), logits_to_keep=logits_to_keep)
    return ledger.counts(), [(call.kind, call.full_bytes) for call in ledger.calls]


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize(("tokens", "logits_to_keep"), [(21, 1), (32, 0), (5, 1)])
def test_collectives_per_forward_under_simulated_tp(tokens: int, logits_to_keep: int, family: str) -> None:
    counts, calls = simulated_counts(tokens, logits_to_keep, family)
    # 4 layers: an all-gather of x and a reduce-scatter per sub-layer (8 each), the exit, and qwen4_exp's PLE halo
    halos = 1 if family == "qwen4_exp" else 0
    assert counts == {"all_gather": 9 + halos, "reduce_scatter": 8}
    rows = -(-tokens // TP)
    x_bytes = TP * rows * 32 * 4  # fp32, S = 32: x, never the n*S-wide streams
    gathers = [nbytes for kind, nbytes in calls if kind == "all_gather"]
    halo = TP * min(rows, 9) * 4 * 32 * 4  # every rank's last min(L, 9) rows of the n*S-wide conv input
    exit_bytes = TP * 32 * 4 if logits_to_keep == 1 else x_bytes  # one row per rank, or the whole exit value
    assert sorted(gathers) == sorted([x_bytes] * 8 + [halo] * halos + [exit_bytes])
    assert all(nbytes == x_bytes for kind, nbytes in calls if kind == "reduce_scatter")


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_one_process_without_a_group_is_tp_1_and_exact(family: str) -> None:
    model = BUILDERS[family]()
    with torch.no_grad():
        expected = model(input_ids=sequence(21)).logits
        assert torch.equal(handwritten_sp(model)(sequence(21)).logits, expected)


def test_what_it_does_not_cover_is_refused() -> None:
    family = r"covers transformers' Qwen4ExpForCausalLM and DeepseekV4ForCausalLM; got Linear"
    with pytest.raises(ValueError, match=family):
        handwritten_sp(torch.nn.Linear(2, 2))
    model = handwritten_sp(tiny_qwen4_exp(num_hidden_layers=1, layer_types=["linear_attention"], ple_layer_ids=[]))
    with pytest.raises(ValueError, match=r"one sequence, input_ids \[1, T\]; got shape \(2, 8\)"):
        model(torch.cat([sequence(8), sequence(8)]))
    with pytest.raises(ValueError, match="logits_to_keep as an int >= 0; got -1"):
        model(sequence(8), logits_to_keep=-1)
    unsharded = r"layers\.0: linear_attn value heads 4 of 4: not sharded for tp = 2"
    with simulated_tp(TP, 0), pytest.raises(ValueError, match=unsharded):
        handwritten_sp(tiny_qwen4_exp())
    with simulated_tp(TP, 0), pytest.raises(ValueError, match=r"layers\.0: self_attn heads 4 of 4: not sharded"):
        handwritten_sp(tiny_deepseek_v4())
